"""Queue deliveries as the consumer's connection sees them (issue 31), over TCP against real ``ecq broker`` processes,
read with raw sockets and paho: an entry above an MQTT 5 consumer's Maximum Packet Size is skipped for that
connection, counted, shown by the admin API, and delivered to a later connection that takes it (MQTT-3.1.2-24, on
both storage backends); the Subscription Identifier of ``$ECQ/<clientid>/#`` on each delivery (MQTT-3.3.4-3); the
entries left unacked when a persistent session's connection dropped come again with DUP=1 and their first packet
ids (MQTT-4.4.0-1), and with DUP=1 after a broker restart."""

from __future__ import annotations

import mqtt5

from tests.harness import wait_until
from tests.mqtt_wire import PUBACK, SUBACK, Packet, WireClient, puback_packet, publish_packet, subscribe_packet
from tests.test_mqtt5 import V5Client, v5_packet
from tests.test_mqtt5_sessions import connect5, subscribe
from tests.test_operations import scrape
from tests.test_rewind import queue as queue_info

WAIT_S = 10.0
SKIPPED = "ecq_deliveries_skipped_total{reason=packet_too_large}"


def write(port: int, clientid: str, *entries: tuple[str, bytes]) -> None:
    """Store ``entries`` (key, payload) in the queue of ``clientid`` through a 3.1.1 producer, each PUBACKed."""
    producer, _present = WireClient.connected(port, f"producer-{clientid}")
    for packet_id, (key, payload) in enumerate(entries, 1):
        producer.send(publish_packet(f"$ECQ/w/{clientid}/{key}", payload, qos=1, packet_id=packet_id))
        assert producer.next().kind == PUBACK
    producer.close()


def wire_size(packet: Packet) -> int:
    """The bytes ``packet`` took on the wire: first byte, Remaining Length (1 to 3 bytes here), body."""
    length = len(packet.body)
    return 1 + (1 if length < 128 else 2 if length < 16384 else 3) + length


def deliveries5(client: WireClient, count: int) -> list[tuple[mqtt5.PublishPacket, int]]:
    """The next ``count`` packets, each a v5 PUBLISH: (decoded, its size on the wire in bytes)."""
    packets = [client.next(WAIT_S) for _ in range(count)]
    decoded = [v5_packet(p) for p in packets]
    assert all(isinstance(p, mqtt5.PublishPacket) for p in decoded), decoded
    return [(p, wire_size(raw)) for p, raw in zip(decoded, packets)]


def seqno(publish: mqtt5.PublishPacket) -> int:
    return int(dict(publish.user_properties)["ecq-seqno"])


def test_an_entry_above_the_maximum_packet_size_is_skipped_counted_and_kept_for_a_connection_that_takes_it(
        backend_broker):
    broker = backend_broker()
    write(broker.port, "small", ("k1", b"a"), ("big", b"x" * 600), ("k3", b"c"))
    consumer, _connack = connect5(broker.port, "small", max_packet_size=200)
    subscribe(consumer, "$ECQ/small/#")
    sent = deliveries5(consumer, 2)
    assert [(p.topic, seqno(p)) for p, _size in sent] == [("$ECQ/small/k1", 1), ("$ECQ/small/k3", 3)]
    assert all(size <= 200 for _p, size in sent), sent
    consumer.send(*(mqtt5.PubAckPacket(p.packet_id).write() for p, _size in sent))
    assert wait_until(lambda: queue_info(broker, "small")["skipped_too_large"] == 1, WAIT_S)
    assert wait_until(lambda: queue_info(broker, "small")["pending"] == 1, WAIT_S)  # k1 and k3 acked, big kept
    assert scrape(broker).get(SKIPPED) == 1
    consumer.close()

    again, _connack = connect5(broker.port, "small", max_packet_size=200)  # acked entries do not come again
    subscribe(again, "$ECQ/small/#")
    assert wait_until(lambda: scrape(broker).get(SKIPPED) == 2, WAIT_S)
    assert again.available(0.5) == []
    again.close()

    larger, _connack = connect5(broker.port, "small")
    subscribe(larger, "$ECQ/small/#")
    [(big, size)] = deliveries5(larger, 1)
    assert (big.topic, big.payload, seqno(big)) == ("$ECQ/small/big", b"x" * 600, 2) and size > 600
    larger.send(mqtt5.PubAckPacket(big.packet_id).write())
    assert wait_until(lambda: queue_info(broker, "small")["acked"] == 3, WAIT_S)
    assert queue_info(broker, "small")["pending"] == 0


def test_a_skipped_entry_replaced_by_a_newer_value_of_its_key_holds_the_acked_position_back_no_more(backend_broker):
    broker = backend_broker()
    consumer, _connack = connect5(broker.port, "gap", max_packet_size=200)
    subscribe(consumer, "$ECQ/gap/#")
    write(broker.port, "gap", ("k", b"x" * 600))
    assert wait_until(lambda: scrape(broker).get(SKIPPED) == 1, WAIT_S)
    write(broker.port, "gap", ("k", b"small"))  # compaction deletes the skipped entry
    [(newer, _size)] = deliveries5(consumer, 1)
    assert (newer.payload, seqno(newer)) == (b"small", 2)
    consumer.send(mqtt5.PubAckPacket(newer.packet_id).write())
    assert wait_until(lambda: queue_info(broker, "gap")["acked"] == 2, WAIT_S), queue_info(broker, "gap")
    assert queue_info(broker, "gap")["skipped_too_large"] == 0


def test_deliveries_carry_the_subscription_identifier_of_the_queue_subscription(broker):
    write(broker.port, "sid", ("k1", b"1"))
    consumer = V5Client(broker.port, "sid")
    try:
        assert consumer.subscribe("$ECQ/sid/#", subscription_id=7) == [1]
        [first] = consumer.expect(1)
        assert (first.topic, first.properties.SubscriptionIdentifier) == ("$ECQ/sid/k1", [7])
        assert consumer.subscribe("$ECQ/sid/#", subscription_id=9) == [1]  # a new SUBSCRIBE replaces the identifier
        write(broker.port, "sid", ("k2", b"2"))
        [second] = consumer.expect(1)
        assert (second.topic, second.properties.SubscriptionIdentifier) == ("$ECQ/sid/k2", [9])
    finally:
        consumer.close()


def test_a_persistent_3_1_1_session_gets_its_unacked_entries_again_with_dup_and_their_packet_ids(broker):
    write(broker.port, "p311", ("k1", b"1"), ("k2", b"2"))
    consumer, _present = WireClient.connected(broker.port, "p311", clean_session=False)
    consumer.send(subscribe_packet(1, ("$ECQ/p311/#", 1)))
    assert consumer.next().kind == SUBACK
    first = [consumer.next().publish() for _ in range(2)]
    assert [(p.topic, p.dup) for p in first] == [("$ECQ/p311/k1", False), ("$ECQ/p311/k2", False)]
    consumer.close()  # without the PUBACKs

    again, present = WireClient.connected(broker.port, "p311", clean_session=False)
    assert present
    resent = [again.next().publish() for _ in range(2)]
    assert [(p.topic, p.dup, p.packet_id) for p in resent] == [(p.topic, True, p.packet_id) for p in first]
    again.send(*(puback_packet(p.packet_id) for p in resent))
    write(broker.port, "p311", ("k3", b"3"))
    newer = again.next().publish()
    assert (newer.topic, newer.dup) == ("$ECQ/p311/k3", False)


def test_a_persistent_v5_session_gets_its_unacked_entries_again_with_dup_and_their_packet_ids(broker):
    write(broker.port, "p5", ("k1", b"1"), ("k2", b"2"))
    consumer, _connack = connect5(broker.port, "p5", clean_start=False, session_expiry_interval=600)
    subscribe(consumer, "$ECQ/p5/#")
    first = [p for p, _size in deliveries5(consumer, 2)]
    assert [(p.topic, p.duplicate) for p in first] == [("$ECQ/p5/k1", False), ("$ECQ/p5/k2", False)]
    consumer.close()

    again, connack = connect5(broker.port, "p5", clean_start=False, session_expiry_interval=600)
    assert connack.session_present
    resent = [p for p, _size in deliveries5(again, 2)]
    assert [(p.topic, p.duplicate, p.packet_id) for p in resent] == [(p.topic, True, p.packet_id) for p in first]
    again.send(*(mqtt5.PubAckPacket(p.packet_id).write() for p in resent))
    write(broker.port, "p5", ("k3", b"3"))
    [(newer, _size)] = deliveries5(again, 1)
    assert (newer.topic, newer.duplicate) == ("$ECQ/p5/k3", False)


def test_an_entry_unacked_when_the_broker_stopped_comes_again_with_dup(broker):
    write(broker.port, "restart", ("k1", b"1"))
    consumer, _present = WireClient.connected(broker.port, "restart")
    consumer.send(subscribe_packet(1, ("$ECQ/restart/#", 1)))
    assert consumer.next().kind == SUBACK
    assert consumer.next().publish().dup is False
    broker.stop()
    consumer.close()
    broker.start()

    again, _present = WireClient.connected(broker.port, "restart")
    again.send(subscribe_packet(1, ("$ECQ/restart/#", 1)))
    assert again.next().kind == SUBACK
    resent = again.next().publish()
    assert (resent.topic, resent.dup) == ("$ECQ/restart/k1", True)  # a new packet id: the session did not survive
    again.send(puback_packet(resent.packet_id))
    write(broker.port, "restart", ("k2", b"2"))  # stored after the restart: never sent before
    assert again.next().publish().dup is False
