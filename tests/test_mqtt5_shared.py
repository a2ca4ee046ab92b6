"""Shared subscriptions ``$share/<ShareName>/<filter>`` (MQTT 5.0 section 4.8.2) on ordinary topics, over TCP against
real ``ecq broker`` processes: paho-mqtt MQTTv5 members (and 3.1.1 ones, which ECQ serves alike), raw v5 SUBSCRIBEs
for malformed share names."""

from __future__ import annotations

import threading
import time

import pytest

from tests.harness import Client, wait_until
from tests.mqtt_wire import SUBACK, SUBSCRIBE, WireClient, fixed_header, subscribe_packet
from tests.test_acl_broker import acl_broker
from tests.test_mqtt5 import WAIT_S, V5Client, v5, wire  # noqa: F401 (v5 is a fixture)

GROUP_FILTER = "$share/workers/jobs/#"


def received(clients: list[V5Client | Client], count: int) -> list[list[bytes]]:
    """The payloads each of ``clients`` got until ``count`` arrived among them all (bounded by WAIT_S), then whatever
    more arrives within 1 s: the sleep only shows that no copy beyond ``count`` comes."""
    got: list[list[bytes]] = [[] for _ in clients]

    def take() -> int:
        for payloads, client in zip(got, clients, strict=True):
            while not client.messages.empty():
                payloads.append(client.messages.get_nowait().payload)
        return sum(map(len, got))

    assert wait_until(lambda: take() >= count, WAIT_S), f"{take()} of {count} messages came"
    time.sleep(1.0)  # a duplicate would come within this second
    take()
    return got


def unsubscribe(client: V5Client, topic_filter: str) -> None:
    """UNSUBSCRIBE ``topic_filter`` and wait for the UNSUBACK."""
    done = threading.Event()
    client._c.on_unsubscribe = lambda *_args: done.set()
    client._c.unsubscribe(topic_filter)
    assert done.wait(WAIT_S), f"no UNSUBACK for {topic_filter!r}"


def test_each_message_goes_to_one_member_in_turn_and_every_other_subscriber_gets_it(broker, v5):
    members = [v5(broker.port, f"worker{n}") for n in range(3)]
    assert all(getattr(m.connack[1], "SharedSubscriptionAvailable", 1) == 1 for m in members)
    assert [m.subscribe(GROUP_FILTER) for m in members] == [[1]] * 3
    auditor = v5(broker.port, "auditor")  # the only member of another group
    watcher = v5(broker.port, "watcher")
    assert auditor.subscribe("$share/audit/jobs/+") == [1] and watcher.subscribe("jobs/#") == [1]
    producer = v5(broker.port, "producer")
    payloads = [f"job{n}".encode() for n in range(30)]
    for n, payload in enumerate(payloads):
        assert producer.publish(f"jobs/{n}", payload) == (0, None)
    *by_member, audited, watched = received([*members, auditor, watcher], 3 * len(payloads))
    assert sorted(sum(by_member, [])) == sorted(payloads)  # each exactly once across the group
    assert [len(got) for got in by_member] == [10, 10, 10]  # round robin among connected members
    assert sorted(audited) == sorted(watched) == sorted(payloads)


def test_a_member_that_unsubscribes_or_leaves_stops_getting_shares(broker, v5):
    stays, unsubscribes, leaves = (v5(broker.port, name) for name in ("stays", "unsubscribes", "leaves"))
    assert [m.subscribe(GROUP_FILTER) for m in (stays, unsubscribes, leaves)] == [[1]] * 3
    unsubscribe(unsubscribes, GROUP_FILTER)
    leaves.close()
    producer = v5(broker.port, "producer")
    for n in range(9):
        assert producer.publish(f"jobs/{n}", f"job{n}") == (0, None)
    got_stays, got_unsubscribed = received([stays, unsubscribes], 9)
    assert sorted(got_stays) == sorted(f"job{n}".encode() for n in range(9)) and got_unsubscribed == []


def test_retained_messages_are_not_sent_on_a_shared_subscription(broker, v5):
    publisher = Client(broker.port, "retainer")
    try:
        publisher.publish("status/door", "open", retain=True)
    finally:
        publisher.close()
    member, plain = v5(broker.port, "member"), v5(broker.port, "plain")
    assert member.subscribe("$share/g/status/#") == [1] and plain.subscribe("status/#") == [1]
    assert [m.payload for m in plain.expect(1)] == [b"open"]  # the retained message is there
    v5(broker.port, "producer").publish("status/door", "closed")
    assert received([member, plain], 2) == [[b"closed"], [b"closed"]]


def test_a_persistent_offline_member_gets_shares_only_while_no_member_is_connected(broker, connect):
    persistent = connect(broker.port, "persistent", clean_session=False)  # a 3.1.1 member
    online = connect(broker.port, "online")
    assert persistent.subscribe(GROUP_FILTER) == 1 and online.subscribe(GROUP_FILTER) == 1
    persistent.close()
    producer = connect(broker.port, "producer")
    for n in range(4):
        producer.publish(f"jobs/{n}", f"online{n}")
    assert sorted(received([online], 4)[0]) == [f"online{n}".encode() for n in range(4)]
    online.close()
    for n in range(3):
        producer.publish(f"jobs/{n}", f"queued{n}")
    back = connect(broker.port, "persistent", clean_session=False)
    assert sorted(m.payload for m in back.expect(3)) == [f"queued{n}".encode() for n in range(3)]


def suback_code(port: int, client_id: str, topic_filter: str, level: int = 5) -> int:
    """The SUBACK code of a raw SUBSCRIBE to ``topic_filter`` at QoS 1 on an MQTT ``level`` (5 or 4 for 3.1.1)
    connection (paho and the codec refuse to send some malformed filters; MQTT 5.0 section 3.8)."""
    if level == 5:
        client = wire(port, client_id)
        body = (7).to_bytes(2, "big") + b"\x00" + len(topic_filter).to_bytes(2, "big") + topic_filter.encode() + b"\x01"
        client.send(fixed_header(SUBSCRIBE << 4 | 0x02, len(body)) + body)  # Property Length 0 after the packet id
    else:
        client, _ = WireClient.connected(port, client_id)
        client.send(subscribe_packet(7, (topic_filter, 1)))
    try:
        suback = client.next()
        assert suback is not None and suback.kind == SUBACK, suback
        return suback.body[-1]
    finally:
        client.close()


@pytest.mark.parametrize("topic_filter", ["$share//jobs", "$share/+/jobs", "$share/#/jobs", "$share/w+/jobs",
                                          "$share/workers", "$share/workers/"])
def test_a_malformed_share_name_is_refused(broker, topic_filter):
    assert suback_code(broker.port, "v5-client", topic_filter) == 0x8F
    assert suback_code(broker.port, "v311-client", topic_filter, level=4) == 0x80


def test_a_shared_subscription_to_an_ecq_queue_is_refused(broker):
    assert suback_code(broker.port, "reader", "$share/g/$ECQ/reader/#") == 0x9E
    assert suback_code(broker.port, "reader311", "$share/g/$ECQ/reader311/#", level=4) == 0x80


def test_the_acl_judges_the_filter_a_shared_subscription_reads(make_broker, connect, tmp_path):
    broker, _ = acl_broker(make_broker, tmp_path)  # denies subscribe sensors/# to guest-*
    guest = connect(broker.port, "guest-1")
    assert guest.subscribe("$share/g/sensors/#") == 0x80
    assert guest.subscribe("$share/g/other/#") == 1
