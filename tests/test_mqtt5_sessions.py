"""The life of an MQTT 5.0 session on ECQ (``ecq.broker.amqtt_hooks.mqtt5_sessions``), over TCP with raw v5 packets
(``mqtt5`` codec) against real ``ecq broker`` processes: Session Expiry Interval per session and from DISCONNECT,
Clean Start, messages queued for an offline session, the Will Delay Interval, Server Keep Alive, and the server
DISCONNECT reason codes (takeover, keepalive timeout, shutdown). Expiry and delays are 1-4 s to keep tests short;
a sleep shows only that something has NOT happened (yet)."""

from __future__ import annotations

import time

import mqtt5
import pytest

from tests.harness import topics_payloads
from tests.mqtt_wire import DISCONNECT, WireClient
from tests.test_cluster_operations import ecq_drain
from tests.test_mqtt5 import v5_packet

QOS_1 = mqtt5.QoS.AT_LEAST_ONCE


def connect5(port: int, client_id: str, clean_start: bool = True, **options) -> tuple[WireClient, object]:
    """A raw v5 connection that sent CONNECT (``options``: mqtt5.ConnectPacket keywords) and read a CONNACK
    accepting it: (client, the decoded CONNACK)."""
    client = WireClient(port)
    client.send(mqtt5.ConnectPacket(client_id, clean_start=clean_start, **options).write())
    connack = v5_packet(client.next())
    assert isinstance(connack, mqtt5.ConnAckPacket) and connack.reason_code == 0, connack
    return client, connack


def subscribe(client: WireClient, topic_filter: str) -> None:
    client.send(mqtt5.SubscribePacket(1, [mqtt5.TopicFilter(topic_filter, max_qos=QOS_1,
                                                                     retain_as_published=False)]).write())
    assert v5_packet(client.next()).reason_codes == [1]


def disconnect(client: WireClient, **options) -> None:
    """A normal DISCONNECT (``options``: mqtt5.DisconnectPacket keywords), then wait for the broker's close."""
    client.send(mqtt5.DisconnectPacket(**options).write())
    assert client.until_closed() == []


def present(port: int, client_id: str, **options) -> bool:
    """Session Present of a Clean Start 0 CONNECT of ``client_id``, which then disconnects normally."""
    client, connack = connect5(port, client_id, clean_start=False, **options)
    disconnect(client)
    return connack.session_present


def server_disconnect(client: WireClient) -> list[int]:
    """The reason codes of the DISCONNECTs the broker sent before it closed ``client``'s connection."""
    return [v5_packet(p).reason_code for p in client.until_closed() if p.kind == DISCONNECT]


def test_each_session_lives_for_its_own_expiry_interval(broker):
    client, connack = connect5(broker.port, "s0", session_expiry_interval=0)
    subscribe(client, "s0/#")
    disconnect(client)
    assert not present(broker.port, "s0")  # 0: the session ended with its connection

    client, connack = connect5(broker.port, "s3", session_expiry_interval=3)
    assert connack.session_expiry_interval is None  # applied as asked
    subscribe(client, "s3/#")
    disconnect(client)
    time.sleep(1)  # within the interval: the session is still there
    assert present(broker.port, "s3", session_expiry_interval=3)
    time.sleep(5)  # past the interval, counted from that last disconnect (2 s of margin for a loaded machine)
    assert not present(broker.port, "s3")


def test_a_clean_start_0_resumes_a_session_even_with_expiry_0_which_then_ends_with_it(broker):
    client, _ = connect5(broker.port, "resume0", session_expiry_interval=60)
    subscribe(client, "r/#")
    disconnect(client)
    client, connack = connect5(broker.port, "resume0", clean_start=False, session_expiry_interval=0)
    assert connack.session_present
    disconnect(client)
    assert not present(broker.port, "resume0")


def test_disconnect_changes_the_session_expiry_interval(broker):
    client, _ = connect5(broker.port, "d1", session_expiry_interval=1)
    subscribe(client, "d1/#")
    disconnect(client, session_expiry_interval=4)
    time.sleep(2)  # past the CONNECT's 1 s, within the DISCONNECT's 4 s
    client, connack = connect5(broker.port, "d1", clean_start=False, session_expiry_interval=1)
    assert connack.session_present
    disconnect(client, session_expiry_interval=0)
    assert not present(broker.port, "d1")


def test_a_disconnect_expiry_after_a_connect_without_one_is_a_protocol_error(broker):
    client, _ = connect5(broker.port, "d0")
    client.send(mqtt5.DisconnectPacket(session_expiry_interval=5).write())
    assert server_disconnect(client) == [0x82]
    assert not present(broker.port, "d0")


def test_a_clean_start_1_session_with_an_expiry_keeps_offline_messages_capped_at_session_expiry(make_broker,
                                                                                               connect):
    broker = make_broker(session_expiry="60s")
    client, connack = connect5(broker.port, "offline5", session_expiry_interval=99999)
    assert connack.session_expiry_interval == 60  # capped at session_expiry, told in CONNACK
    subscribe(client, "off/#")
    disconnect(client)
    publisher = connect(broker.port, "pub")
    for n in range(2):
        publisher.publish(f"off/{n}", f"m{n}", qos=1)
    client, connack = connect5(broker.port, "offline5", clean_start=False, session_expiry_interval=99999)
    assert connack.session_present
    deliveries = [v5_packet(client.next()) for _ in range(2)]
    assert [(p.topic, p.payload) for p in deliveries] == [("off/0", b"m0"), ("off/1", b"m1")]


def will_watcher(connect, port: int):
    watcher = connect(port, "watcher")
    assert watcher.subscribe("wills/#") == 1
    return watcher


def test_the_will_waits_for_its_delay(broker, connect):
    watcher = will_watcher(connect, broker.port)
    client, _ = connect5(broker.port, "late", session_expiry_interval=30,
                         will=mqtt5.Will("wills/late", payload=b"gone", will_delay_interval=2))
    client.transport.close()
    closed = time.monotonic()
    assert watcher.quiet(1.0) == []  # within the delay
    assert topics_payloads(watcher.expect(1)) == [("wills/late", b"gone")]
    assert time.monotonic() - closed >= 2.0


def test_the_will_goes_when_the_session_ends_before_its_delay(broker, connect):
    watcher = will_watcher(connect, broker.port)
    client, _ = connect5(broker.port, "short", session_expiry_interval=1,
                         will=mqtt5.Will("wills/short", payload=b"gone", will_delay_interval=60))
    client.transport.close()
    closed = time.monotonic()
    assert topics_payloads(watcher.expect(1)) == [("wills/short", b"gone")]
    assert 0.9 <= time.monotonic() - closed < 5
    assert not present(broker.port, "short")


def test_a_reconnect_within_the_delay_cancels_the_will(broker, connect):
    watcher = will_watcher(connect, broker.port)
    will = mqtt5.Will("wills/back", payload=b"gone", will_delay_interval=2)
    client, _ = connect5(broker.port, "back", session_expiry_interval=30, will=will)
    client.transport.close()
    client, connack = connect5(broker.port, "back", clean_start=False, session_expiry_interval=30)
    assert connack.session_present
    assert watcher.quiet(3.0) == []  # past the delay: no Will


def test_a_takeover_within_the_delay_gets_0x8e_and_no_will(broker, connect):
    watcher = will_watcher(connect, broker.port)
    will = mqtt5.Will("wills/taken", payload=b"gone", will_delay_interval=2)
    old, _ = connect5(broker.port, "taken", session_expiry_interval=30, will=will)
    new, connack = connect5(broker.port, "taken", clean_start=False, session_expiry_interval=30)
    assert connack.session_present
    assert server_disconnect(old) == [0x8E]
    assert watcher.quiet(3.0) == []  # past the delay: no Will


def test_a_clean_start_takeover_gets_0x8e_and_ends_the_session_with_its_will(broker, connect):
    watcher = will_watcher(connect, broker.port)
    will = mqtt5.Will("wills/cs", payload=b"gone", will_delay_interval=60)
    old, _ = connect5(broker.port, "cs", session_expiry_interval=30, will=will)
    new, connack = connect5(broker.port, "cs", clean_start=True)
    assert not connack.session_present
    assert server_disconnect(old) == [0x8E]
    assert topics_payloads(watcher.expect(1)) == [("wills/cs", b"gone")]


def test_a_clean_start_publishes_the_pending_will_of_the_session_it_discards(broker, connect):
    watcher = will_watcher(connect, broker.port)
    client, _ = connect5(broker.port, "fresh", session_expiry_interval=30,
                         will=mqtt5.Will("wills/fresh", payload=b"gone", will_delay_interval=60))
    client.transport.close()
    assert watcher.quiet(0.5) == []  # the delay has not passed
    connect5(broker.port, "fresh", clean_start=True)
    assert topics_payloads(watcher.expect(1)) == [("wills/fresh", b"gone")]


@pytest.mark.parametrize(("asked", "told"), [(120, 1), (0, 1), (1, None)])
def test_max_keepalive_is_told_in_connack_and_enforced_with_0x8d(make_broker, asked, told):
    broker = make_broker(max_keepalive=1)
    client, connack = connect5(broker.port, "silent", keep_alive=asked)
    assert connack.server_keep_alive == told  # none when the client's own is within max_keepalive
    started = time.monotonic()
    assert server_disconnect(client) == [0x8D]
    assert time.monotonic() - started < 5


def test_a_stopping_broker_tells_v5_clients_0x8b(make_broker):
    broker = make_broker()
    client, _ = connect5(broker.port, "stay")
    assert broker.stop() == 0
    assert server_disconnect(client) == [0x8B]


def test_a_drain_tells_v5_clients_0x8b_and_3_1_1_clients_nothing(make_broker, connect):
    broker = make_broker()
    client, _ = connect5(broker.port, "drained")
    old, _present = WireClient.connected(broker.port, "drained-311")
    code, report = ecq_drain(broker)
    assert code == 0 and report["connections_closed"] == 2, report
    assert server_disconnect(client) == [0x8B]
    assert old.until_closed() == []  # MQTT 3.1.1 has no server DISCONNECT


def test_a_takeover_leaves_the_resumed_session_to_the_new_connection(broker, connect):
    old, _ = connect5(broker.port, "kept", session_expiry_interval=1)
    subscribe(old, "kept/#")
    new, connack = connect5(broker.port, "kept", clean_start=False, session_expiry_interval=1)
    assert connack.session_present
    assert server_disconnect(old) == [0x8E]
    time.sleep(2)  # past the old connection's expiry: the session, connected again, must not expire
    connect(broker.port, "pub").publish("kept/1", "still", qos=1)
    assert (v5_packet(new.next()).topic, new.ended) == ("kept/1", False)
