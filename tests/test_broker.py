"""The queue behaviour end to end, over TCP against a real `ecq broker` process with paho-mqtt clients.

Test names carry the issue's point numbers (p1..p13).
"""

from __future__ import annotations

import re
import time

import pytest

from tests.harness import RawClient, drain, topics_payloads, wait_until, write



@pytest.fixture
def make_broker(backend_broker):
    """Every scenario here runs on each storage backend (LevelDB, JetStream)."""
    return backend_broker


def test_p1_realtime_delivery_exact_payload_at_qos1(broker, connect):
    consumer = connect(broker.port, "rt1")
    assert consumer.subscribe("$ECQ/rt1/#", 1) == 1
    producer = connect(broker.port, "producer")
    payload = bytes(range(256)) * 4
    write(producer, "rt1", "cfg/apn", payload)
    [message] = consumer.expect(1)
    assert (message.topic, message.payload, message.qos) == ("$ECQ/rt1/cfg/apn", payload, 1)


def test_p2_reactive_delivery_of_writes_made_while_offline(broker, connect):
    producer = connect(broker.port, "producer")
    for i in range(3):
        write(producer, "re1", f"k{i}", f"v{i}")
    assert drain(connect, broker.port, "re1", 3) == [(f"$ECQ/re1/k{i}", f"v{i}".encode()) for i in range(3)]


def test_p3_compaction_keeps_newest_value_per_key_in_seqno_order(broker, connect):
    producer = connect(broker.port, "producer")
    write(producer, "cp1", "a", "a1")
    write(producer, "cp1", "cfg/net/apn", "apn1")
    write(producer, "cp1", "a", "a2")
    write(producer, "cp1", "b", "b1")
    write(producer, "cp1", "cfg/net/apn", "apn2")
    write(producer, "cp1", "a", "a3")
    # newest values only, ordered by the seqno of their last write: b1 (4), apn2 (5), a3 (6)
    assert drain(connect, broker.port, "cp1", 3) == [
        ("$ECQ/cp1/b", b"b1"), ("$ECQ/cp1/cfg/net/apn", b"apn2"), ("$ECQ/cp1/a", b"a3")]


def test_p4_acked_messages_are_not_delivered_again_and_new_ones_are(broker, connect):
    producer = connect(broker.port, "producer")
    for i in range(4):
        write(producer, "ak1", f"k{i}", f"v{i}")
    consumer = connect(broker.port, "ak1", manual_ack=True)  # so that each PUBACK is sent before the DISCONNECT
    consumer.subscribe("$ECQ/ak1/#")
    for message in consumer.expect(4):
        consumer.ack(message)
    consumer.close()  # the last PUBACK and the DISCONNECT leave at once: the PUBACK must still count
    again = connect(broker.port, "ak1")
    again.subscribe("$ECQ/ak1/#")
    assert again.quiet(1.5) == []
    write(producer, "ak1", "k9", "new")
    assert topics_payloads(again.expect(1)) == [("$ECQ/ak1/k9", b"new")]


def test_p5_unacked_message_is_delivered_again_after_reconnect(broker, connect):
    producer = connect(broker.port, "producer")
    write(producer, "un1", "k1", "v1")
    write(producer, "un1", "k2", "v2")
    consumer = connect(broker.port, "un1", manual_ack=True)
    consumer.subscribe("$ECQ/un1/#")
    first, second = consumer.expect(2)
    consumer.ack(first)  # k1 acked, k2 never
    consumer.close()
    assert drain(connect, broker.port, "un1", 1) == [("$ECQ/un1/k2", b"v2")]


def test_p5_out_of_order_ack_is_remembered_across_reconnect(broker, connect):
    producer = connect(broker.port, "producer")
    for i in range(3):
        write(producer, "oo1", f"k{i}", f"v{i}")
    consumer = connect(broker.port, "oo1", manual_ack=True)
    consumer.subscribe("$ECQ/oo1/#")
    messages = consumer.expect(3)
    consumer.ack(messages[2])  # acks k2 but not k0, k1
    consumer.close()
    assert drain(connect, broker.port, "oo1", 2) == [("$ECQ/oo1/k0", b"v0"), ("$ECQ/oo1/k1", b"v1")]


def test_p5_inflight_window_holds_at_most_reader_batch_size_unacked(make_broker, connect):
    broker = make_broker(reader_batch_size=3)
    producer = connect(broker.port, "producer")
    for i in range(10):
        write(producer, "win1", f"k{i}", f"v{i}")
    consumer = connect(broker.port, "win1", manual_ack=True)
    consumer.subscribe("$ECQ/win1/#")
    first = consumer.expect(3)
    assert consumer.quiet(1.0) == []  # window full: nothing more until an ack
    consumer.ack(first[0])
    [fourth] = consumer.expect(1)
    assert fourth.topic == "$ECQ/win1/k3"


def test_p3_a_value_superseded_while_read_ahead_is_not_delivered(make_broker, connect):
    broker = make_broker(reader_batch_size=3)
    producer = connect(broker.port, "producer")
    for i in range(6):
        write(producer, "ra1", f"k{i}", f"v{i}")
    consumer = connect(broker.port, "ra1", manual_ack=True)
    consumer.subscribe("$ECQ/ra1/#")
    first = consumer.expect(3)  # the window is full; k3..k5 are read ahead and wait
    assert consumer.quiet(0.5) == []
    write(producer, "ra1", "k4", "v4-new")  # compaction deletes the read-ahead k4=v4
    for message in first:
        consumer.ack(message)
    rest = topics_payloads(consumer.expect(3))
    assert consumer.quiet(1.0) == []
    assert rest == [("$ECQ/ra1/k3", b"v3"), ("$ECQ/ra1/k5", b"v5"), ("$ECQ/ra1/k4", b"v4-new")]


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_p6_restart_keeps_queues_and_acked_positions(make_broker, connect, how):
    broker = make_broker(reader_batch_size=1)
    producer = connect(broker.port, "producer")
    for i in range(5):
        write(producer, "rs1", f"k{i}", f"v{i}")
    write(producer, "rs1", "k9", "after-acks")
    consumer = connect(broker.port, "rs1", manual_ack=True)
    consumer.subscribe("$ECQ/rs1/#")
    for i in range(3):
        [message] = consumer.expect(1)
        assert message.topic == f"$ECQ/rs1/k{i}"
        consumer.ack(message)
    # k3 is sent only once the ack of k2 is stored (an ack is stored before the next delivery)
    assert consumer.expect(1)[0].topic == "$ECQ/rs1/k3"
    if how == "sigterm":
        assert broker.stop() == 0
        assert "store closed" in broker.log()
    else:
        broker.kill()
    broker.start()
    assert drain(connect, broker.port, "rs1", 3) == [
        ("$ECQ/rs1/k3", b"v3"), ("$ECQ/rs1/k4", b"v4"), ("$ECQ/rs1/k9", b"after-acks")]


def test_p6_every_write_that_got_a_puback_survives_kill9(make_broker, connect):
    # fsync'd commits of 16 KiB writes keep a real window between receiving a write and committing it;
    # SIGKILL straight from paho's PUBACK callback lands inside that window. A PUBACK sent before the
    # commit (stock amqtt) shows up here as an acknowledged write missing after the crash.
    broker = make_broker(sync_writes=True)
    producer = connect(broker.port, "producer")
    total, kill_after = 600, 200
    acked_mids: list[int] = []

    def on_publish(_client, _userdata, mid, _rc, _props):
        acked_mids.append(mid)
        if len(acked_mids) == kill_after:
            broker.kill()

    producer._c.on_publish = on_publish
    payload = b"p" * 16384
    mids = {producer._c.publish(f"$ECQ/w/kl1/k{i}", payload, 1).mid: i for i in range(total)}
    assert wait_until(lambda: broker.proc.poll() is not None, 30)
    acked_keys = {f"k{mids[mid]}" for mid in list(acked_mids)}
    store = broker.open_store()
    try:
        stored = {m.key for m in store.read_after("kl1", 0, total + 1)}
    finally:
        store.close()
    assert len(acked_keys) >= kill_after
    assert acked_keys <= stored, f"{len(acked_keys - stored)} acknowledged writes were lost"


def test_p7_publish_without_w_is_refused_and_publisher_stays_connected(broker, connect):
    consumer = connect(broker.port, "nw1")
    consumer.subscribe("$ECQ/nw1/#")
    listener = connect(broker.port, "listener")
    listener.subscribe("plain/after")
    publisher = connect(broker.port, "pubnw")
    publisher.publish("$ECQ/nw1/k", "sneaky")
    publisher.publish("plain/after", "routed")
    assert topics_payloads(listener.expect(1)) == [("plain/after", b"routed")]
    assert consumer.quiet(1.0) == []
    assert not publisher.disconnected.is_set()
    assert "use $ECQ/w/" in broker.log() or "$ECQ/w/<clientid>/<key>" in broker.log()
    broker.stop()
    store = broker.open_store()
    try:
        assert store.count_queues() == 0
    finally:
        store.close()


def test_p8_only_the_owner_may_subscribe_and_only_at_qos1(broker, connect):
    producer = connect(broker.port, "producer")
    write(producer, "ownerA", "k", "secret")
    intruder = connect(broker.port, "clientB")
    assert intruder.subscribe("$ECQ/ownerA/#", 1) == 0x80
    assert intruder.subscribe("$ECQ/+/#", 1) == 0x80
    assert intruder.subscribe("$ECQ/w/ownerA/#", 1) == 0x80
    owner_qos0 = connect(broker.port, "ownerA")
    assert owner_qos0.subscribe("$ECQ/ownerA/#", 0) == 0x80
    assert intruder.quiet(1.0) == [] and owner_qos0.quiet(0.1) == []
    owner_qos0.close()
    owner = connect(broker.port, "ownerA")
    assert owner.subscribe("$ECQ/ownerA/#", 2) == 1  # QoS 2 asked, QoS 1 granted
    assert topics_payloads(owner.expect(1)) == [("$ECQ/ownerA/k", b"secret")]


def test_p9_persistent_session_gets_pending_without_subscribing_again(broker, connect):
    consumer = connect(broker.port, "ps1", clean_session=False)
    consumer.subscribe("$ECQ/ps1/#")
    consumer.close()
    producer = connect(broker.port, "producer")
    write(producer, "ps1", "k1", "while-away")
    time.sleep(2.5)  # amqtt's session monitor (1 s period) drops disconnected anonymous sessions meanwhile
    again = connect(broker.port, "ps1", clean_session=False)
    assert topics_payloads(again.expect(1)) == [("$ECQ/ps1/k1", b"while-away")]
    write(producer, "ps1", "k2", "live")
    assert topics_payloads(again.expect(1)) == [("$ECQ/ps1/k2", b"live")]


def test_p9_clean_session_forgets_the_persistent_subscription(broker, connect):
    consumer = connect(broker.port, "ps2", clean_session=False)
    consumer.subscribe("$ECQ/ps2/#")
    consumer.close()
    connect(broker.port, "ps2", clean_session=True).close()  # MQTT 3.1.2.4: discards the session
    write(connect(broker.port, "producer"), "ps2", "k", "v")
    again = connect(broker.port, "ps2", clean_session=False)
    assert again.quiet(1.5) == []


@pytest.mark.parametrize("clean_session", [True, False])
def test_p10_takeover_delivers_to_the_live_connection_and_loses_nothing(broker, connect, clean_session):
    producer = connect(broker.port, "producer")
    first = connect(broker.port, "tk1", clean_session=clean_session, manual_ack=True)
    first.subscribe("$ECQ/tk1/#")
    for i in range(3):
        write(producer, "tk1", f"k{i}", f"v{i}")
    assert len(first.expect(3)) == 3  # delivered, never acked
    second = connect(broker.port, "tk1", clean_session=clean_session)
    if clean_session:
        second.subscribe("$ECQ/tk1/#")
    assert first.disconnected.wait(5), "the older connection must be closed on takeover"
    for i in range(3, 6):
        write(producer, "tk1", f"k{i}", f"v{i}")
    got = topics_payloads(second.expect(6))
    assert got == [(f"$ECQ/tk1/k{i}", f"v{i}".encode()) for i in range(6)]
    assert second.quiet(1.0) == []


def test_p11_ordinary_pubsub_works_as_stock_amqtt(broker, connect):
    subscriber = connect(broker.port, "plain-sub")
    assert subscriber.subscribe("sensors/+/temp", 1) == 1
    publisher = connect(broker.port, "plain-pub")
    publisher.publish("sensors/room1/temp", "21.5", qos=1)
    publisher.publish("sensors/room2/temp", "19.0", qos=0)
    publisher.publish("sensors/room1/humidity", "40", qos=1)
    got = sorted(topics_payloads(subscriber.expect(2)))
    assert got == [("sensors/room1/temp", b"21.5"), ("sensors/room2/temp", b"19.0")]
    assert subscriber.quiet(0.5) == []


@pytest.mark.parametrize("topic, reason", [
    (b"$ECQ/w//k", "empty_clientid"),
    (b"$ECQ/w/bw1/", "empty_key"),
    (b"$ECQ/w/bw1", "empty_key"),
    (b"$ECQ/w/b+w/k", "bad_clientid"),
    (b"$ECQ/w/bw1/k/#", "bad_key"),
    (b"$ECQ/w/bw1/a+b", "bad_key"),
])  # U+0000 in a topic closes the connection (MQTT-1.5.3-2): test_bad_clients' protocol violations
def test_p12_bad_write_topics_are_refused_and_connection_kept(broker, connect, topic, reason):
    raw = RawClient(broker.port)
    try:
        assert raw.publish_qos1(topic, b"x", 7) == (0x40, b"\x00\x07")  # PUBACK, publisher kept
        assert raw.ping()
    finally:
        raw.close()
    assert wait_until(lambda: f"reason {reason}" in broker.log(), 5), broker.log()
    consumer = connect(broker.port, "bw1")
    consumer.subscribe("$ECQ/bw1/#")
    assert consumer.quiet(1.0) == []


def test_p12_oversized_payload_is_refused_and_connection_kept(make_broker, connect):
    broker = make_broker(max_payload_bytes=1024)
    producer = connect(broker.port, "producer")
    write(producer, "big1", "k", b"x" * 1025)
    write(producer, "big1", "ok", b"y" * 1024)
    assert not producer.disconnected.is_set()
    assert "reason payload_too_large" in broker.log()
    assert drain(connect, broker.port, "big1", 1) == [("$ECQ/big1/ok", b"y" * 1024)]


def gc_deleted(broker) -> int:
    """Entries the broker's GC passes deleted so far, from their log lines."""
    return sum(int(n) for n in re.findall(r"ECQ GC deleted (\d+) entries", broker.log()))


def test_p13_gc_deletes_expired_entries_and_keeps_fresh_ones(make_broker, connect):
    broker = make_broker(data_retention="2s", gc_interval="500ms")
    producer = connect(broker.port, "producer")
    write(producer, "gc1", "old", "stale")
    write(producer, "gc2", "old", "stale")
    time.sleep(2.5)
    write(producer, "gc1", "new", "fresh")
    # one pass, or two when a pass fell between the two stale writes (their queues may sit on different shards)
    assert wait_until(lambda: gc_deleted(broker) == 2, 5), broker.log()
    assert drain(connect, broker.port, "gc1", 1) == [("$ECQ/gc1/new", b"fresh")]
    broker.stop()
    store = broker.open_store()
    try:
        assert [m.key for m in store.read_after("gc1", 0, 10)] == ["new"]
        assert store.queue_range("gc2") is None
    finally:
        store.close()


def test_p13_expired_entries_are_never_delivered_even_before_gc_runs(make_broker, connect):
    broker = make_broker(data_retention="1s", gc_interval="1h")
    producer = connect(broker.port, "producer")
    write(producer, "gc3", "old", "stale")
    time.sleep(1.5)
    consumer = connect(broker.port, "gc3")
    consumer.subscribe("$ECQ/gc3/#")
    assert consumer.quiet(1.0) == []


def test_qos0_and_qos2_writes_are_stored(broker, connect):
    producer = connect(broker.port, "producer")
    write(producer, "q1", "zero", "z", qos=0)
    write(producer, "q1", "two", "t", qos=2)
    consumer = connect(broker.port, "q1")
    consumer.subscribe("$ECQ/q1/#")
    assert sorted(topics_payloads(consumer.expect(2))) == [("$ECQ/q1/two", b"t"), ("$ECQ/q1/zero", b"z")]


def test_unsubscribe_stops_delivery_and_resubscribe_resumes(broker, connect):
    consumer = connect(broker.port, "us1")
    consumer.subscribe("$ECQ/us1/#")
    consumer._c.unsubscribe("$ECQ/us1/#")
    time.sleep(0.3)
    producer = connect(broker.port, "producer")
    write(producer, "us1", "k", "v")
    assert consumer.quiet(1.0) == []
    consumer.subscribe("$ECQ/us1/#")
    assert topics_payloads(consumer.expect(1)) == [("$ECQ/us1/k", b"v")]


def test_a_late_puback_still_counts_and_delivery_goes_on(make_broker, connect):
    # amqtt's own publish gives up on a PUBACK after 5 s and forgets its packet id; ECQ waits for it as
    # long as the connection lives (MQTT 3.1.1 section 4.4: resend only on reconnect), so a consumer
    # that acks late gets no duplicate and its next message follows the late PUBACK.
    broker = make_broker(reader_batch_size=1)
    producer = connect(broker.port, "producer")
    write(producer, "slow1", "k1", "v1")
    write(producer, "slow1", "k2", "v2")
    consumer = connect(broker.port, "slow1", manual_ack=True)
    consumer.subscribe("$ECQ/slow1/#")
    [first] = consumer.expect(1)
    assert first.topic == "$ECQ/slow1/k1"
    assert consumer.quiet(6.5) == []  # past amqtt's 5 s: no resend, and k2 waits for the window
    consumer.ack(first)
    [second] = consumer.expect(1, timeout=10)
    assert second.topic == "$ECQ/slow1/k2"
    consumer.ack(second)
    time.sleep(0.5)
    assert "unknown pending message" not in broker.log()


def test_p10_persistent_takeover_keeps_the_newest_connection_up(broker, connect):
    # raw clients: paho would reconnect the old connection by itself and take the session back
    producer = connect(broker.port, "producer")
    write(producer, "tk9", "k0", "v0")
    first = RawClient(broker.port, "tk9", clean_session=False)
    assert first.subscribe(b"$ECQ/tk9/#") == (0x90, b"\x00\x01\x01")
    assert first.receive_publish()[0] == b"$ECQ/tk9/k0"  # never acked
    second = RawClient(broker.port, "tk9", clean_session=False)
    try:
        with pytest.raises(ConnectionError):
            first.ping()  # closed by the takeover
        topic, packet_id, payload = second.receive_publish()
        assert (topic, payload) == (b"$ECQ/tk9/k0", b"v0")
        second.send_raw(bytes([0x40, 0x02]) + packet_id.to_bytes(2, "big"))
        time.sleep(2.5)  # two rounds of amqtt's session monitor, which closed the new connection too
        assert second.ping(), "the newest connection was closed"
        write(producer, "tk9", "k1", "v1")
        assert second.receive_publish()[0] == b"$ECQ/tk9/k1"
    finally:
        first.close()
        second.close()
