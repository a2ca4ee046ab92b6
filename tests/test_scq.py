"""SCQ, the shared compacted queue (issue 33, points 1, 2 and 4): writes to ``$SCQ/w/<queue>/<key>`` stored once
per queue, read by every client subscribed to ``$SCQ/<queue>/#``, each from its own position; over TCP with
paho (3.1.1 and MQTT 5) and mosquitto clients against a real broker process, on both storage backends."""

from __future__ import annotations

import queue
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.harness import metrics_text, topics_payloads, wait_until, write
from tests.test_operations import scrape
from tests.test_rewind import admin_post

Q = "fleet"
FILTER = f"$SCQ/{Q}/#"


def scq_write(client, key: str, payload: bytes | str, qos: int = 1, queue_name: str = Q) -> None:
    client.publish(f"$SCQ/w/{queue_name}/{key}", payload, qos)


def delivered(key: str, payload: bytes, queue_name: str = Q) -> tuple[str, bytes]:
    return f"$SCQ/{queue_name}/{key}", payload


def read_all(connect, port: int, clientid: str, count: int, **options) -> list[tuple[str, bytes]]:
    """Connect as ``clientid``, subscribe to the SCQ, return exactly the next ``count`` deliveries (acked); nothing
    more may come within a second; then disconnect."""
    reader = connect(port, clientid, **options)
    assert reader.subscribe(FILTER) == 1
    messages = topics_payloads(reader.expect(count))
    assert topics_payloads(reader.quiet(1.0)) == []
    reader.close()
    return messages


def stored_entries(broker, queue_id: str) -> int:
    """Entries the stopped broker's store holds for ``queue_id``."""
    store = broker.open_store()
    try:
        return sum(1 for row in store.stored_entries() if row[0] == queue_id)
    finally:
        store.close()


def test_fan_out_to_several_readers_after_compaction(backend_broker, connect):
    """Written before anyone reads, compacted: each reader's first subscribe gets the newest value of every key, in
    seqno order; a write then reaches every online reader in real time."""
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    for key, payload in (("a", b"1"), ("b", b"2"), ("a", b"3"), ("c", b"4")):
        scq_write(producer, key, payload)
    first = [delivered("b", b"2"), delivered("a", b"3"), delivered("c", b"4")]
    readers = [connect(broker.port, f"car-{i}") for i in range(3)]
    for reader in readers:
        assert reader.subscribe(FILTER) == 1
        assert topics_payloads(reader.expect(3)) == first
    scq_write(producer, "d", b"5")
    for reader in readers:
        assert topics_payloads(reader.expect(1)) == [delivered("d", b"5")]
        assert reader.quiet(0.5) == []


def test_one_write_is_stored_once_however_many_read_it(backend_broker, connect):
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    readers = [connect(broker.port, f"car-{i}") for i in range(5)]
    for reader in readers:
        assert reader.subscribe(FILTER) == 1
    scq_write(producer, "config", b"v1")
    for reader in readers:
        assert topics_payloads(reader.expect(1)) == [delivered("config", b"v1")]
    for client in (producer, *readers):
        client.close()
    assert broker.stop() == 0
    assert stored_entries(broker, f"$SCQ/{Q}") == 1
    assert stored_entries(broker, "car-0") == 0


def test_positions_are_independent(backend_broker, connect):
    """One reader acks everything, another acks nothing and reconnects: it gets its unacked entries again, the
    first one nothing."""
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    for key in ("a", "b"):
        scq_write(producer, key, key.encode())
    acking = connect(broker.port, "acking", clean_session=False)
    assert acking.subscribe(FILTER) == 1
    assert len(acking.expect(2)) == 2
    holding = connect(broker.port, "holding", clean_session=False, manual_ack=True)
    assert holding.subscribe(FILTER) == 1
    got = holding.expect(2)
    holding.ack(got[0])
    wait_until(lambda: False, 0.5)  # nothing to wait on: the ack of "a" goes out with the close below
    holding.close()
    acking.close()
    again = connect(broker.port, "holding", clean_session=False)
    assert topics_payloads(again.expect(1)) == [delivered("b", b"b")]
    back = connect(broker.port, "acking", clean_session=False)
    assert back.quiet(1.0) == []


def test_reconnect_with_a_clean_session_resumes_from_the_stored_position(broker, connect):
    """The position belongs to the client id, not to its session: a clean session subscribing again resumes after
    what it acked (as an ECQ consumer does)."""
    producer = connect(broker.port, "producer")
    scq_write(producer, "a", b"1")
    assert read_all(connect, broker.port, "car", 1) == [delivered("a", b"1")]
    scq_write(producer, "b", b"2")
    assert read_all(connect, broker.port, "car", 1) == [delivered("b", b"2")]


def test_persistent_session_resumes_without_subscribing_again(backend_broker, connect):
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    reader = connect(broker.port, "car", clean_session=False)
    assert reader.subscribe(FILTER) == 1
    scq_write(producer, "a", b"1")
    assert topics_payloads(reader.expect(1)) == [delivered("a", b"1")]
    reader.close()
    scq_write(producer, "b", b"2")
    resumed = connect(broker.port, "car", clean_session=False)
    assert resumed.session_present
    assert topics_payloads(resumed.expect(1)) == [delivered("b", b"2")]
    scq_write(producer, "c", b"3")
    assert topics_payloads(resumed.expect(1)) == [delivered("c", b"3")]


@pytest.mark.parametrize("stop", ["sigterm", "kill"])
def test_restart_loses_nothing_acknowledged(backend_broker, connect, stop):
    """SIGTERM and kill -9: every PUBACKed write is delivered after the restart, nothing acked is delivered again."""
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    scq_write(producer, "a", b"1")
    assert read_all(connect, broker.port, "car", 1) == [delivered("a", b"1")]
    persistent = connect(broker.port, "kept-car", clean_session=False)
    assert persistent.subscribe(FILTER) == 1
    assert topics_payloads(persistent.expect(1)) == [delivered("a", b"1")]
    persistent.close()
    scq_write(producer, "b", b"2")
    scq_write(producer, "c", b"3")
    producer.close()
    if stop == "sigterm":
        assert broker.stop() == 0
    else:
        broker.kill()
    broker.start()
    assert read_all(connect, broker.port, "car", 2) == [delivered("b", b"2"), delivered("c", b"3")]
    resumed = connect(broker.port, "kept-car", clean_session=False)  # no SUBSCRIBE: the stored session holds it
    assert topics_payloads(resumed.expect(2)) == [delivered("b", b"2"), delivered("c", b"3")]
    assert resumed.quiet(0.5) == []
    assert read_all(connect, broker.port, "new-car", 3) == [delivered(k, v) for k, v in
                                                           (("a", b"1"), ("b", b"2"), ("c", b"3"))]


def test_tombstone_deletes_the_key_for_later_readers(broker, connect):
    """An empty payload is a tombstone, delivered to the readers online. A reader that comes later never gets the
    value it deleted: it gets the tombstone while a reader sent it holds it back unacked, nothing of the key once
    every such reader acked it (tests/test_scq_tombstones.py)."""
    producer = connect(broker.port, "producer")
    early = connect(broker.port, "early")
    holding = connect(broker.port, "holding", manual_ack=True)
    for reader in (early, holding):
        assert reader.subscribe(FILTER) == 1
    scq_write(producer, "a", b"1")
    assert topics_payloads(early.expect(1)) == [delivered("a", b"1")]  # attached (the SUBACK comes before that)
    scq_write(producer, "b", b"2")
    scq_write(producer, "a", b"")
    assert topics_payloads(early.expect(2)) == [delivered("b", b"2"), delivered("a", b"")]
    held = holding.expect(3)
    assert read_all(connect, broker.port, "late", 2) == [delivered("b", b"2"), delivered("a", b"")]
    for message in held:
        holding.ack(message)
    assert wait_until(lambda: scrape(broker).get("ecq_tombstones_removed_total{reason=tombstone_acked}", 0) == 1)
    assert read_all(connect, broker.port, "later", 1) == [delivered("b", b"2")]


def test_subscribe_refusals(broker, connect):
    reader = connect(broker.port, "car")
    assert reader.subscribe(FILTER, qos=0) == 0x80
    assert reader.subscribe(FILTER, qos=2) == 1
    for bad in ("$SCQ/w/#", "$SCQ/ctl/#", "$SCQ/+/#", "$SCQ/fleet/a", "$SCQ/fleet/+", "$SCQ/#"):
        assert reader.subscribe(bad) == 0x80, bad
    assert reader.subscribe("$share/g/$SCQ/+/#") == 0x80  # a group reads one SCQ (tests/test_scq_groups.py)


def _refusals(broker, reason: str) -> float:
    for line in metrics_text(broker).splitlines():
        if line.startswith("ecq_writes_refused_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_write_refusals_are_counted_and_store_nothing(broker, connect):
    producer = connect(broker.port, "producer")
    reader = connect(broker.port, "car")
    assert reader.subscribe(FILTER) == 1
    refused = {"$SCQ/fleet/a": "not_a_write", "$SCQ/w/w/k": "bad_clientid", "$SCQ/w/ctl/k": "bad_clientid",
               "$SCQ/w//k": "empty_clientid", "$SCQ/w/fleet/": "empty_key", "$SCQ/ctl/fleet/other": "not_a_write"}
    for topic in refused:
        producer.publish(topic, b"x", 1)
    for reason in set(refused.values()):
        assert wait_until(lambda: _refusals(broker, reason) >= list(refused.values()).count(reason)), reason
    assert reader.quiet(0.5) == []
    assert "SCQ writes go to $SCQ/w/<queue>/<key>" in broker.log()


def test_mqtt5_reader_gets_seqno_and_ts_and_reason_codes(broker, connect):
    """An MQTT 5 reader's deliveries carry ecq-seqno, ecq-ts and the Subscription Identifier of its ``$SCQ/<queue>/#``;
    a refused MQTT 5 write gets its reason code; a write's Message Expiry Interval is kept with the entry."""
    producer = connect(broker.port, "producer")
    before_ms = int(time.time() * 1000)
    scq_write(producer, "a", b"1")
    got: queue.Queue = queue.Queue()
    v5 = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="v5car", protocol=mqtt.MQTTv5)
    v5.on_message = lambda _c, _u, m: got.put(m)
    acks: queue.Queue = queue.Queue()
    v5.on_publish = lambda _c, _u, mid, reason, _p: acks.put(reason.value)
    subacks: queue.Queue = queue.Queue()
    v5.on_subscribe = lambda _c, _u, _mid, codes, _p: subacks.put([c.value for c in codes])
    v5.connect("127.0.0.1", broker.port)
    v5.loop_start()
    try:
        v5.subscribe(FILTER, qos=0)
        assert subacks.get(timeout=10) == [0x80]
        identified = Properties(PacketTypes.SUBSCRIBE)
        identified.SubscriptionIdentifier = 7
        v5.subscribe(FILTER, qos=1, properties=identified)
        assert subacks.get(timeout=10) == [1]
        message = got.get(timeout=10)
        assert (message.topic, message.payload) == delivered("a", b"1")
        assert message.properties.SubscriptionIdentifier == [7]
        properties = dict(message.properties.UserProperty)
        assert properties["ecq-seqno"] == "1" and int(properties["ecq-ts"]) >= before_ms
        v5.publish("$SCQ/fleet/a", b"x", 1)
        assert acks.get(timeout=10) == 0x90
        expiring = Properties(PacketTypes.PUBLISH)
        expiring.MessageExpiryInterval = 1
        v5.publish("$SCQ/w/fleet/short", b"gone", 1, properties=expiring)
        assert acks.get(timeout=10) == 0
        assert got.get(timeout=10).topic == "$SCQ/fleet/short"
    finally:
        v5.disconnect()
        v5.loop_stop()
    time.sleep(1.1)  # the entry's own 1 s expiry must pass: a later reader does not get it
    assert read_all(connect, broker.port, "late", 1) == [delivered("a", b"1")]


@pytest.mark.skipif(shutil.which("mosquitto_sub") is None, reason="mosquitto clients not installed")
def test_mosquitto_clients(broker):
    """mosquitto_pub writes at QoS 0, 1 and 2; two mosquitto_sub readers each get every value."""
    for qos, key in ((0, "a"), (1, "b"), (2, "c")):
        subprocess.run(["mosquitto_pub", "-p", str(broker.port), "-i", f"pub{qos}", "-q", str(qos),
                        "-t", f"$SCQ/w/{Q}/{key}", "-m", key * 2], check=True, timeout=10)
    for reader in ("sub-1", "sub-2"):
        out = subprocess.run(["mosquitto_sub", "-p", str(broker.port), "-i", reader, "-q", "1", "-t", FILTER,
                              "-v", "-C", "3", "-W", "10"], capture_output=True, text=True, timeout=15)
        assert out.stdout.splitlines() == [f"$SCQ/{Q}/a aa", f"$SCQ/{Q}/b bb", f"$SCQ/{Q}/c cc"], out


def test_reader_on_the_same_connection_as_its_own_ecq_queue(broker, connect):
    """A client reading its own ECQ queue and an SCQ gets both, even where seqnos coincide: the packet ids a session
    remembers for its resends are kept per queue, so the second first send is no resend (DUP=0, its own id)."""
    producer = connect(broker.port, "producer")
    producer.publish("$ECQ/w/car/own", b"mine", 1)
    scq_write(producer, "shared", b"ours")
    reader = connect(broker.port, "car", clean_session=False, manual_ack=True)
    assert reader.subscribe("$ECQ/car/#") == 1
    assert reader.subscribe(FILTER) == 1
    got = reader.expect(2)
    assert sorted(topics_payloads(got)) == [("$ECQ/car/own", b"mine"), delivered("shared", b"ours")]
    assert len({m.mid for m in got}) == 2
    assert not any(m.dup for m in got)  # neither was sent before (seqno 1 in both queues)


REPO = Path(__file__).resolve().parent.parent


def test_acl_decides_who_writes_and_who_reads(make_broker, connect):
    """The fleet example: only the backend writes, only cars read; a refused write is counted, stores nothing."""
    broker = make_broker(acl_file=str(REPO / "acl" / "acl-fleet.example.conf"))
    car = connect(broker.port, "c1", username="car-1")
    assert car.subscribe("$SCQ/fleet-config/#") == 1
    stranger = connect(broker.port, "s1", username="stranger")
    assert stranger.subscribe("$SCQ/fleet-config/#") == 0x80
    stranger.publish("$SCQ/w/fleet-config/k", b"forged", 1)
    assert wait_until(lambda: _refusals(broker, "acl_denied") >= 1)
    connect(broker.port, "backend-1", username="backend").publish("$SCQ/w/fleet-config/k", b"real", 1)
    assert topics_payloads(car.expect(1)) == [("$SCQ/fleet-config/k", b"real")]
    assert car.quiet(0.5) == []


def test_shipped_acl_grants_scq_reads_to_nobody(make_broker, connect):
    broker = make_broker(acl_file=str(REPO / "acl" / "acl.conf"))
    client = connect(broker.port, "anyone")
    assert client.subscribe(FILTER) == 0x80
    assert client.subscribe("$ECQ/anyone/#") == 1


def test_resumed_session_is_granted_its_scq_reads_again(make_broker, connect, tmp_path):
    """A persistent session that subscribed while the ACL allowed it resumes without that SCQ once a reload denies
    it to its username: the filter is judged again for whoever resumes the session."""
    acl = tmp_path / "acl.conf"
    acl.write_text('{allow, {username, "car-1"}, subscribe, ["eq $SCQ/fleet/#"]}.\n'
                   '{deny, all, subscribe, ["$SCQ/#"]}.\n{allow, all}.\n')
    broker = make_broker(acl_file=str(acl))
    reader = connect(broker.port, "car", clean_session=False, username="car-1")
    assert reader.subscribe(FILTER) == 1
    reader.close()
    producer = connect(broker.port, "producer")
    scq_write(producer, "a", b"1")
    resumed = connect(broker.port, "car", clean_session=False, username="car-1")
    assert topics_payloads(resumed.expect(1)) == [delivered("a", b"1")]
    resumed.close()
    acl.write_text('{deny, all, subscribe, ["$SCQ/#"]}.\n{allow, all}.\n')
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{broker.admin_port}/api/v1/acl/reload",
                                                  method="POST"), timeout=10).read()
    scq_write(producer, "b", b"2")
    denied = connect(broker.port, "car", clean_session=False, username="car-1")
    assert denied.quiet(1.5) == []
    assert "no longer granted" in broker.log()


def test_a_readers_stored_position_is_small(broker, connect):
    """Per-reader stored state (issue 33: <= 64 bytes): the LevelDB row of a reader's position, key and value, for
    a 12-character queue name and a 10-character client id, measured in the store the broker wrote."""
    import plyvel
    producer = connect(broker.port, "producer")
    scq_write(producer, "k", b"v", queue_name="fleet-config")
    reader = connect(broker.port, "car-000123")
    assert reader.subscribe("$SCQ/fleet-config/#") == 1
    assert len(reader.expect(1)) == 1
    reader.close()
    producer.close()
    assert broker.stop() == 0
    db = plyvel.DB(str(broker.queues_dir))
    try:
        rows = {key: value for key, value in db.iterator(prefix=b"a")}
    finally:
        db.close()
    assert len(rows) == 1
    [(key, value)] = rows.items()
    assert key.endswith(b"$SCQ/fleet-config/car-000123")
    assert len(key) + len(value) == 47


def test_mqtt5_subscribe_codes(make_broker, tmp_path):
    """MQTT 5 SUBACK codes of SCQ filters: 0x87 where the ACL denies, 0x80 for QoS 0 or a malformed filter, 0x9E for
    a shared subscription on anything but ``$SCQ/<queue>/#``."""
    acl = tmp_path / "acl.conf"
    acl.write_text('{deny, all, subscribe, ["$SCQ/secret/#"]}.\n{allow, all}.\n')
    broker = make_broker(acl_file=str(acl))
    subacks: queue.Queue = queue.Queue()
    v5 = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="v5car", protocol=mqtt.MQTTv5)
    v5.on_subscribe = lambda _c, _u, _mid, codes, _p: subacks.put([c.value for c in codes])
    v5.connect("127.0.0.1", broker.port)
    v5.loop_start()
    try:
        for topic_filter, qos, code in (("$SCQ/secret/#", 1, 0x87), (FILTER, 0, 0x80), ("$SCQ/+/#", 1, 0x80),
                                        ("$share/g/$SCQ/+/#", 1, 0x9E), (FILTER, 2, 1)):
            v5.subscribe(topic_filter, qos=qos)
            assert subacks.get(timeout=10) == [code], topic_filter
    finally:
        v5.disconnect()
        v5.loop_stop()


def test_state_gc_keeps_an_scqs_seqno_counter(make_broker, connect):
    """An SCQ emptied by GC and idle past state_retention keeps its seqno counter (an ECQ queue's is forgotten in
    the same pass): a reader's stored position would otherwise pass the seqnos of the next writes, never delivered."""
    broker = make_broker(data_retention="1s", state_retention="1s", gc_interval="1h")
    producer = connect(broker.port, "producer")
    scq_write(producer, "a", b"1")
    scq_write(producer, "b", b"2")
    write(producer, "ecq-control", "k", b"v")
    assert read_all(connect, broker.port, "car", 2) == [delivered("a", b"1"), delivered("b", b"2")]
    idle_since = time.monotonic()
    assert wait_until(lambda: time.monotonic() - idle_since > 1.5, 5)

    def forgotten() -> bool:
        admin_post(broker, "/api/v1/gc")
        return scrape(broker).get("ecq_queues_forgotten_total", 0) >= 1
    assert wait_until(forgotten, 15, 0.3)
    admin_post(broker, "/api/v1/gc")
    assert scrape(broker).get("ecq_queues_forgotten_total") == 1  # the ECQ queue, not the SCQ
    scq_write(producer, "c", b"3")
    assert read_all(connect, broker.port, "car", 1) == [delivered("c", b"3")]


def test_readers_on_both_nodes_of_a_cluster(cluster_nodes, connect):
    """JetStream, two brokers: a write through one reaches readers on both in real time (a 30 s heartbeat: only the
    append notice brings it); a reader that acked on one node resumes after its position on the other."""
    node1, node2 = (node.start() for node in cluster_nodes(heartbeat_interval="30s"))
    producer = connect(node1.port, "producer")
    scq_write(producer, "a", b"1")
    near, far = connect(node1.port, "near"), connect(node2.port, "far")
    for reader in (near, far):
        assert reader.subscribe(FILTER) == 1
        assert topics_payloads(reader.expect(1)) == [delivered("a", b"1")]
    scq_write(producer, "b", b"2")
    for reader in (near, far):
        assert topics_payloads(reader.expect(1, timeout=5)) == [delivered("b", b"2")]
    far.close()
    scq_write(producer, "c", b"3")
    assert read_all(connect, node1.port, "far", 1) == [delivered("c", b"3")]


def test_unsubscribe_stops_delivery_and_resubscribe_resumes(broker, connect):
    producer = connect(broker.port, "producer")
    scq_write(producer, "first", b"0")
    reader = connect(broker.port, "car")
    assert reader.subscribe(FILTER) == 1
    assert len(reader.expect(1)) == 1  # the reader is attached: only the UNSUBSCRIBE can stop what follows
    unsubacked = threading.Event()
    reader._c.on_unsubscribe = lambda *_args: unsubacked.set()
    reader._c.unsubscribe(FILTER)
    assert unsubacked.wait(10)
    scq_write(producer, "k", b"v")
    assert reader.quiet(1.0) == []
    assert reader.subscribe(FILTER) == 1
    assert topics_payloads(reader.expect(1)) == [delivered("k", b"v")]
