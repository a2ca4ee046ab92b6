"""A fleet's sessions at a cost per client (issue 32, ``amqtt_hooks.fleet_scale``): a session's deletion takes its
own subscriptions only, offline sessions expire at their deadlines, and a SUBSCRIBE tests no retained topic its filter
cannot match. Against a real `ecq broker` process over TCP,
MQTT 3.1.1. That connects and a stop do not slow down with the number of sessions held is a matter of speed, measured
by `scripts/bench --scenario fleet` (the flatness rows and the SIGTERM times), not by a timed test."""

from __future__ import annotations

import json
import time

import pytest
from amqtt.broker import Broker
from amqtt.session import Session

from ecq.broker.amqtt_hooks import persistent_session
from ecq.broker.amqtt_hooks.fleet_scale import _add_subscription, note_subscription
from tests.census_plugin import ANSWER as CENSUS_ANSWER, ASK as CENSUS_ASK, PLUGIN_PATH as CENSUS
from tests.census_plugin import RETAINED_DOLLAR_TOPIC
from tests.test_mqtt_conformance import PINGRESP, PUBACK, Mqtt, census


def test_a_deleted_session_takes_only_its_own_subscriptions(make_broker):
    """A Clean Session CONNECT deletes the client's old session (MQTT 3.1.1 section 3.1.2.4) and with it exactly that
    session's subscriptions: the other sessions on the same filters, online or offline, keep theirs."""
    broker = make_broker()
    subscribers = {name: Mqtt(broker.port, name, clean=False) for name in ("gone", "online", "offline")}
    for name, client in subscribers.items():
        assert client.subscribe("news/#", 1) == 1
        assert client.subscribe(f"own/{name}", 1, packet_id=2) == 1
    subscribers["gone"].disconnect()
    subscribers["offline"].disconnect()
    gone = Mqtt(broker.port, "gone", clean=True)
    assert not gone.session_present

    sender = Mqtt(broker.port, "sender")
    for packet_id, topic in enumerate(("news/1", "own/gone", "own/online", "own/offline"), 1):
        sender.publish(topic, topic.encode(), qos=1, packet_id=packet_id)
    assert sorted(subscribers["online"].next_publish().topic for _ in range(2)) == ["news/1", "own/online"]
    offline = Mqtt(broker.port, "offline", clean=False)
    assert offline.session_present
    assert sorted(offline.next_publish().topic for _ in range(2)) == ["news/1", "own/offline"]
    assert gone.nothing_within(0.5)
    assert subscribers["online"].nothing_within(0.1) and offline.nothing_within(0.1)


def test_offline_sessions_expire_on_time_from_their_last_disconnect(make_broker):
    """``session_expiry`` counts from a session's last disconnect: a session is forgotten within 1 s after it runs out
    (amqtt's monitor, once a second, took up to 2 s; a session amqtt keeps is forgotten in whole seconds as amqtt
    does, one kept in the store, as these, on time), and one that came back and left again runs from then."""
    expiry_s = 3
    broker = make_broker(session_expiry=f"{expiry_s}s")
    for name in ("leaves", "returns"):
        assert Mqtt(broker.port, name, clean=False).subscribe("a/b", 1) == 1  # closed without DISCONNECT: offline
    left = time.monotonic()
    time.sleep(1.5)
    returning = Mqtt(broker.port, "returns", clean=False)
    assert returning.session_present
    returning.disconnect()
    returned = time.monotonic()

    time.sleep(max(0.0, left + expiry_s + 1.0 - time.monotonic()))
    assert time.monotonic() < returned + expiry_s, "too slow to tell the two deadlines apart"
    assert not Mqtt(broker.port, "leaves", clean=False).session_present
    returning = Mqtt(broker.port, "returns", clean=False)
    assert returning.session_present
    returning.disconnect()
    returned = time.monotonic()
    time.sleep(expiry_s + 1.5)
    assert not Mqtt(broker.port, "returns", clean=False).session_present


@pytest.mark.parametrize(("first_qos", "second_qos"), [(0, 1), (1, 0)])
def test_a_subscribe_to_a_filter_held_replaces_its_qos(make_broker, first_qos, second_qos):
    """MQTT 3.1.1 section 3.8.4: a SUBSCRIBE to a filter the client holds replaces that subscription, its maximum QoS
    included; amqtt 0.12.1 granted the new QoS in the SUBACK and kept delivering at the old one. A persistent session
    keeps the new QoS across its reconnect too."""
    broker = make_broker()
    reader = Mqtt(broker.port, "reader", clean=False)
    assert reader.subscribe("meters/+/reading", first_qos) == first_qos
    assert reader.subscribe("meters/+/reading", second_qos, packet_id=2) == second_qos
    sender = Mqtt(broker.port, "sender")
    sender.publish("meters/7/reading", b"41", qos=1)
    first = reader.next_publish()
    assert first.qos == second_qos
    if first.qos:
        reader.ack(PUBACK, first.packet_id)  # PUBACK, so that it is not sent again after the reconnect
    reader.disconnect()

    sender.publish("meters/7/reading", b"42", qos=1, packet_id=2)
    back = Mqtt(broker.port, "reader", clean=False)
    assert back.session_present
    queued_while_away = [b"42"] if second_qos else []  # a QoS 0 subscription queues nothing offline
    sender.publish("meters/7/reading", b"43", qos=1, packet_id=3)
    received = [back.next_publish() for _ in range(len(queued_while_away) + 1)]
    assert [(p.payload, p.qos) for p in received] == [(payload, second_qos) for payload in [*queued_while_away, b"43"]]


class _CountedWalks(list):
    """amqtt's list of a filter's (session, QoS) subscribers, counting the walks through it."""

    walks = 0

    def __iter__(self):
        _CountedWalks.walks += 1
        return super().__iter__()


def _persistent(clientid: str) -> Session:
    session = Session()
    session.client_id, session.clean_session = clientid, False
    return session


@pytest.mark.timeout(30)
async def test_a_clients_subscriptions_are_read_from_its_own_filters():
    """What the session store keeps of one client (``persistent_session``: its filters and their granted QoS) comes
    from the client's own index entries, not from a walk of each filter's subscribers: with 1,000 devices on
    ``fleet/#`` it would read all of theirs. A real amqtt Broker's maps, filled as the cluster's hand-over fills
    them."""
    broker = Broker({"listeners": {"default": {"type": "tcp", "bind": "127.0.0.1:0"}}})
    device = _persistent("device")
    crowd = [(_persistent(f"other-{n}"), 1) for n in range(1000)]
    broker._sessions["device"] = (device, None)
    broker._subscriptions["fleet/#"] = _CountedWalks([*crowd, (device, 1)])
    broker._subscriptions["own/device"] = _CountedWalks([(device, 0)])
    note_subscription(broker, "device", "fleet/#", 1)
    note_subscription(broker, "device", "own/device", 0)

    held = persistent_session(broker.plugins_manager.context, "device")
    assert held is not None and held.subscriptions == [("fleet/#", 1, None), ("own/device", 0, None)]
    assert _CountedWalks.walks == 0


@pytest.mark.timeout(30)
async def test_a_subscribe_to_a_shared_filter_walks_its_subscribers_only_to_replace_a_qos():
    """A SUBSCRIBE to a filter 1,000 devices hold already costs the client's own index entry, not a walk of the 1,000
    (amqtt's test of whether the client held it); only a SUBSCRIBE replacing the client's own subscription walks them,
    to change its QoS (MQTT 3.1.1 section 3.8.4). A real amqtt Broker's maps, through the correction itself."""
    broker = Broker({"listeners": {"default": {"type": "tcp", "bind": "127.0.0.1:0"}}})
    device = _persistent("device")
    broker._subscriptions["fleet/#"] = _CountedWalks([(_persistent(f"other-{n}"), 1) for n in range(1000)])
    _CountedWalks.walks = 0

    assert await _add_subscription(broker, ("fleet/#", 1), device) == 1
    assert _CountedWalks.walks == 0
    assert await _add_subscription(broker, ("fleet/#", 0), device) == 0
    assert _CountedWalks.walks == 1
    assert [qos for session, qos in broker._subscriptions["fleet/#"] if session is device] == [0]
    assert len(broker._subscriptions["fleet/#"]) == 1001
    assert await _add_subscription(broker, ("fleet/#/bad", 1), device) == 0x80


def _retained_for(port: int, topic_filter: str, expected: int) -> dict[str, bytes]:
    """``{topic: payload}`` of the ``expected`` retained messages a new subscription to ``topic_filter`` gets (each
    RETAIN=1), checking that no other follows within 0.3 s."""
    client = Mqtt(port, "retained-reader")
    assert client.subscribe(topic_filter, 1) == 1
    got = [client.next_publish() for _ in range(expected)]
    assert all(publish.retain for publish in got) and client.nothing_within(0.3), topic_filter
    client.disconnect()
    return {publish.topic: publish.payload for publish in got}


def test_a_subscribe_gets_the_retained_messages_its_filter_matches(broker_with_plugin):
    """MQTT 3.1.1 sections 3.3.1.3 and 4.7, read from the tree of retained topics: ``+`` one level, ``#`` its parent
    level and all below (section 4.7.1.2), a ``$`` topic (the census plugin's, no client may publish one) matched by
    no wildcard at the first level but by its own name (section 4.7.2); a replaced message is sent as replaced and one
    cleared by an empty retained payload not at all."""
    broker = broker_with_plugin(CENSUS)
    setter = Mqtt(broker.port, "setter")
    for packet_id, topic in enumerate(("a", "a/b", "a/c", "a/b/c", "/a", "b/x"), 1):
        setter.publish(topic, topic.encode(), qos=1, retain=True, packet_id=packet_id)
    assert setter.ping()  # answered once the PUBLISHes before it were routed, so retained

    assert _retained_for(broker.port, "a/+", 2) == {"a/b": b"a/b", "a/c": b"a/c"}
    assert set(_retained_for(broker.port, "a/#", 4)) == {"a", "a/b", "a/c", "a/b/c"}
    assert set(_retained_for(broker.port, "#", 6)) == {"a", "a/b", "a/c", "a/b/c", "/a", "b/x"}
    assert set(_retained_for(broker.port, "+", 1)) == {"a"}
    assert set(_retained_for(broker.port, "+/+", 4)) == {"a/b", "a/c", "/a", "b/x"}
    assert set(_retained_for(broker.port, "+/b/#", 2)) == {"a/b", "a/b/c"}
    assert _retained_for(broker.port, "+/retained", 0) == {}
    assert _retained_for(broker.port, RETAINED_DOLLAR_TOPIC, 1) == {RETAINED_DOLLAR_TOPIC: b"$"}
    assert _retained_for(broker.port, "$census/#", 1) == {RETAINED_DOLLAR_TOPIC: b"$"}

    setter.publish("a/b", b"replaced", qos=1, retain=True, packet_id=7)
    setter.publish("a/c", b"", qos=1, retain=True, packet_id=8)
    assert setter.ping()
    assert _retained_for(broker.port, "a/+", 1) == {"a/b": b"replaced"}
    assert set(_retained_for(broker.port, "#", 5)) == {"a", "a/b", "a/b/c", "/a", "b/x"}


def _matches_so_far(asker: Mqtt) -> int:
    """How many topic-against-filter tests amqtt's ``Broker._matches`` made in the broker so far (the census plugin's
    count, its own ask's fan-out included)."""
    asker.publish(CENSUS_ASK, b"")
    answer = asker.next_publish()
    asker.ack(PUBACK, answer.packet_id)
    return json.loads(answer.payload)["matches"]


@pytest.mark.timeout(120)
def test_a_subscribe_tests_no_retained_topic_its_filter_cannot_match(broker_with_plugin):
    """amqtt 0.12.1 sent a new subscription its retained messages by testing every retained topic against the filter
    (``_publish_retained_messages_for_subscription``, and ECQ's SUBSCRIBE handling after it): with 20,000 retained
    topics, 20 SUBSCRIBEs made 400,000 tests. From the tree of retained topics, each SUBSCRIBE follows its filter's
    levels: amqtt's matcher runs only for the fan-out of the census plugin's own ask (a few filters)."""
    retained_topics, subscribes = 20_000, 20
    broker = broker_with_plugin(CENSUS)
    setter = Mqtt(broker.port, "setter")
    for n in range(retained_topics):
        setter.publish(f"fleet/{n}/state", str(n).encode(), retain=True)
    setter.send(0xC0, b"")  # PINGREQ, answered once the PUBLISHes before it were routed (a busy machine: seconds)
    assert setter.expect(PINGRESP, timeout=60) == b""
    asker = Mqtt(broker.port, "asker")
    assert asker.subscribe(CENSUS_ANSWER, 1) == 1
    before = _matches_so_far(asker)

    reader = Mqtt(broker.port, "reader")
    wanted = {f"fleet/{n * 997}/state" for n in range(subscribes)}
    for packet_id, topic in enumerate(sorted(wanted), 1):
        assert reader.subscribe(topic.replace("/state", "/#"), 1, packet_id=packet_id) == 1
    assert {reader.next_publish().topic for _ in range(subscribes)} == wanted

    assert _matches_so_far(asker) - before < 10 * (subscribes + 1)


def test_a_connection_holds_one_timer_its_keepalive(broker_with_plugin, connect):
    """Issue 32 point 5: no per-connection timer beyond what the keepalive needs. amqtt 0.12.1 armed one more per
    connection, re-armed on every packet it sent, whose callback does nothing in a broker
    (``fleet_scale.no_write_timer_per_connection``)."""
    connections = 20
    broker = broker_with_plugin(CENSUS)
    asker = connect(broker.port, "asker")
    assert asker.subscribe(CENSUS_ANSWER) == 1
    before = census(asker, 1)["timers"]
    clients = [Mqtt(broker.port, f"timed-{n}") for n in range(connections)]
    for n, client in enumerate(clients):
        assert client.subscribe(f"fleet/{n}/#", 1) == 1  # a SUBACK: a packet amqtt sends
    after = census(asker, 1 + connections)["timers"]
    grown = {name: count - before.get(name, 0) for name, count in after.items()}
    per_connection = {name: count for name, count in grown.items() if count >= connections}
    assert per_connection == {"Framer._keepalive_due": connections}, after  # other timers come and go, a few
    for client in clients:
        client.disconnect()
