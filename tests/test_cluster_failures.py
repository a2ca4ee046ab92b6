"""Failures of a cluster (issue 12, points 3, 4 and 5) on real processes: a 3-server NATS JetStream cluster of
the test's own (these tests kill its servers) and ECQ nodes on loopback, paho and raw MQTT clients over TCP."""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass, field

import paho.mqtt.client as mqtt
import pytest

from ecq.queue.writer import FAILURE_LOG_INTERVAL_S
from ecq.store.jsapi import REQUEST_TIMEOUT_S
from ecq.store.link import OUTAGE_LOG_INTERVAL_S
from ecq.testing.nats import LocalNatsCluster
from tests.harness import RawClient, drain, lines_let_through, topics_payloads, wait_until, write

NAMESPACE = "ECQT"  # the namespace cluster_nodes gives nodes on a cluster of the test's own
SHARDS = 2
# From the kill to the first PUBACK of a new write. The issue asks for 10 s, and runs here took 5.1-9.3 s, but most
# of it is NATS: a Raft follower waits a random 4-9 s without the leader's heartbeat before it stands for election
# (nats-server raft.go, not configurable). So the hard bounds are NATS' 9 s plus ECQ's own 3 s, and ECQ's 3 s alone.
RESUME_BOUND_S = 12.0
ECQ_RESUME_BOUND_S = 3.0   # from the new leader's election to the first PUBACK: ECQ's own part


@pytest.fixture
def own_nats(tmp_path):
    """A 3-server NATS JetStream cluster under tmp_path/nats, killed at teardown."""
    cluster = LocalNatsCluster(tmp_path / "nats").start()
    yield cluster
    cluster.kill_all()


def shard_stream(clientid: str) -> str:
    return f"{NAMESPACE}_Q_{zlib.crc32(clientid.encode()) % SHARDS}"


# --- point 3: a PUBACK means stored on a quorum, also across a leader kill ------------------------


@dataclass
class PacedProducer:
    """A paho QoS 1 producer writing ``rate`` unique keys per second to one queue on its own thread; paho
    reconnects by itself when the broker closes the connection (a write not committed within write_timeout)
    and sends its unacknowledged PUBLISHes again, under the same packet id. ``sent`` maps each key written to
    time.monotonic(); :meth:`acked` gives the PUBACKed ones."""

    port: int
    clientid: str
    rate: float
    sent: dict[str, float] = field(default_factory=dict)
    disconnects: int = 0

    def __post_init__(self) -> None:
        self._keys: dict[int, str] = {}        # packet id -> key (at most 65535 writes: ids are not reused)
        self._pubacks: dict[int, float] = {}   # packet id -> time of its PUBACK (no lock: paho holds its own
        self._stop = threading.Event()         # while calling on_publish, and publish() takes it too)
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="paced-producer",
                                   protocol=mqtt.MQTTv311)
        self._client.max_inflight_messages_set(0)  # unlimited: a stall must not hold writes back in paho
        self._client.max_queued_messages_set(0)
        self._client.reconnect_delay_set(0.1, 0.5)
        self._client.on_publish = lambda _c, _u, mid, _rc, _p: self._pubacks.setdefault(mid, time.monotonic())
        self._client.on_disconnect = self._on_disconnect
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> PacedProducer:
        self._client.connect("127.0.0.1", self.port, keepalive=30)
        self._client.loop_start()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop writing (PUBACKs of writes in flight still count)."""
        self._stop.set()
        self._thread.join(5)

    def close(self) -> None:
        self.stop()
        self._client.disconnect()
        self._client.loop_stop()

    @property
    def acked(self) -> dict[str, float]:
        """{key: time.monotonic() of its PUBACK} of every PUBACKed write."""
        keys, pubacks = self._keys.copy(), self._pubacks.copy()  # dict.copy is atomic: paho's thread adds to them
        return {keys[mid]: t for mid, t in pubacks.items() if mid in keys}

    def unacked(self) -> int:
        return len(self.sent) - len(self.acked)

    def _run(self) -> None:
        started, i = time.monotonic(), 0
        while not self._stop.is_set() and i < 65000:
            key = f"k{i:06d}"
            self.sent[key] = time.monotonic()  # first: its PUBACK may come before publish() returns
            info = self._client.publish(f"$ECQ/w/{self.clientid}/{key}", key.encode(), qos=1)
            self._keys[info.mid] = key
            i += 1
            time.sleep(max(0.0, started + i / self.rate - time.monotonic()))

    def _on_disconnect(self, *_args) -> None:
        self.disconnects += 1


def collect_queue(port: int, clientid: str, at_least: int, timeout: float) -> dict[str, bytes]:
    """Connect as ``clientid`` and gather its queue as {key: payload} until ``at_least`` keys came and then
    nothing for a second (raises AssertionError if ``at_least`` do not come within ``timeout``)."""
    from tests.harness import Client
    consumer = Client(port, clientid)
    try:
        assert consumer.subscribe(f"$ECQ/{clientid}/#") == 1
        got: dict[str, bytes] = {}
        deadline = time.monotonic() + timeout
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            try:
                message = consumer.messages.get(timeout=0.1)
            except Exception:  # queue.Empty
                if len(got) >= at_least and time.monotonic() - quiet_since > 1.0:
                    return got
                continue
            got[message.topic.rsplit("/", 1)[1]] = message.payload
            quiet_since = time.monotonic()
        raise AssertionError(f"only {len(got)} of at least {at_least} messages came within {timeout} s")
    finally:
        consumer.close()


@pytest.mark.timeout(90)
def test_every_pubacked_write_survives_a_kill9_of_the_shard_leader(own_nats, cluster_nodes):
    writer_node, reader_node = [node.start() for node in cluster_nodes(nats=own_nats)]
    stream = shard_stream("lk")
    producer = PacedProducer(writer_node.port, "lk", rate=300).start()
    try:
        assert wait_until(lambda: len(producer.acked) >= 600, 15), f"only {len(producer.acked)} writes acked"
        leader = own_nats.stream_leader(stream)
        assert leader is not None, f"no leader known for {stream}"
        killed_at = time.monotonic()
        own_nats.server(leader).kill()
        elected = watch_new_leader(own_nats, stream, leader)

        def resumed() -> bool:
            return any(producer.sent[k] > killed_at for k in producer.acked)
        assert wait_until(resumed, RESUME_BOUND_S + 5, 0.05), "no write made after the kill was acked"
        first_after = min(t for k, t in producer.acked.items() if producer.sent[k] > killed_at)
        wait_until(lambda: time.monotonic() > first_after + 2, 3)  # writes keep flowing on the new leader
    finally:
        producer.stop()
    assert wait_until(lambda: producer.unacked() == 0, 15), f"{producer.unacked()} writes never acked"
    producer.close()
    acked = producer.acked
    resumed_after = first_after - killed_at
    election = f"{elected[0] - killed_at:.1f} s" if elected else "not seen"
    assert resumed_after < RESUME_BOUND_S, f"writes resumed {resumed_after:.1f} s after the kill (new leader: {election})"
    assert not elected or first_after - elected[0] < ECQ_RESUME_BOUND_S, \
        f"writes resumed {first_after - elected[0]:.1f} s after the new leader was seen"
    delivered = collect_queue(reader_node.port, "lk", len(acked), timeout=30)
    missing = sorted(set(acked) - set(delivered))
    assert missing == [], f"{len(missing)} PUBACKed writes lost, e.g. {missing[:5]}"
    assert all(payload == key.encode() for key, payload in delivered.items())
    assert set(delivered) <= set(producer.sent)
    print(f"leader {leader} killed; {len(acked)} writes acked, new leader after {election}, writes "
          f"resumed after {resumed_after:.2f} s, {producer.disconnects} producer disconnects")


def watch_new_leader(cluster: LocalNatsCluster, stream: str, old: str) -> list[float]:
    """A list that gets the time.monotonic() at which a leader other than ``old`` leads ``stream`` (polled
    every 0.1 s for at most 20 s, on a daemon thread): NATS followers wait 4-9 s for a lost leader before
    they campaign (nats-server raft.go), which is most of the writes' resumption time."""
    seen: list[float] = []

    def watch() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if cluster.stream_leader(stream) not in (None, old):
                seen.append(time.monotonic())
                return
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()
    return seen


# --- point 4: ECQ node kill and full-cluster restart -----------------------------------------------


def test_a_consumer_of_a_killed_node_resumes_on_the_other_without_acked_redelivery(own_nats, cluster_nodes,
                                                                                     connect):
    node1, node2 = [node.start() for node in cluster_nodes(nats=own_nats)]
    producer = connect(node2.port, "producer")
    for i in range(5):
        write(producer, "nk", f"k{i}", f"v{i}")
    consumer = RawClient(node1.port, "nk")
    try:
        consumer.subscribe(b"$ECQ/nk/#")
        delivered = [consumer.receive_publish() for _ in range(5)]
        consumer.puback(*[packet_id for _topic, packet_id, _payload in delivered[:3]])
        assert wait_until(lambda: _pending(node2, "nk") == 2, 10), "the acks were not saved"
        node1.kill()
    finally:
        consumer.close()
    again = connect(node2.port, "nk")
    assert again.subscribe("$ECQ/nk/#") == 1
    write(producer, "nk", "k5", "v5")
    assert topics_payloads(again.expect(3)) == [("$ECQ/nk/k3", b"v3"), ("$ECQ/nk/k4", b"v4"), ("$ECQ/nk/k5", b"v5")]
    assert again.quiet(1.0) == []


def _pending(node, clientid: str) -> int | None:
    from tests.test_cluster import ecq_json
    return ecq_json("inspect", clientid, admin=node.admin_port)["pending"]


@pytest.mark.timeout(90)
def test_a_full_cluster_restart_keeps_every_queue_and_acked_position(own_nats, cluster_nodes, connect):
    node1, node2 = nodes = [node.start() for node in cluster_nodes(nats=own_nats)]
    producer1, producer2 = connect(node1.port, "producer-1"), connect(node2.port, "producer-2")
    for i in range(4):
        write(producer1, "fa", f"k{i}", f"v{i}")
        write(producer2, "fb", f"k{i}", f"v{i}")
    consumer = connect(node1.port, "fa", manual_ack=True)
    consumer.subscribe("$ECQ/fa/#")
    for message in consumer.expect(4)[:2]:
        consumer.ack(message)
    assert wait_until(lambda: _pending(node2, "fa") == 2, 10), "the acks were not saved"
    for client in (consumer, producer1, producer2):
        client.close()
    for node in nodes:
        node.kill()
    own_nats.kill_all()
    own_nats.start()
    for node in nodes:
        node.start()
    assert drain(connect, node2.port, "fa", 2) == [("$ECQ/fa/k2", b"v2"), ("$ECQ/fa/k3", b"v3")]
    assert drain(connect, node1.port, "fb", 4) == [(f"$ECQ/fb/k{i}", f"v{i}".encode()) for i in range(4)]


# --- point 5: NATS unreachable --------------------------------------------------------------------

WRITE_TIMEOUT_S = 2.0
WRITER_AGENTS = 2  # each writer agent throttles its own failure lines
PUBACK = 0x40


def refused_write(port: int, clientid: str, key: str) -> tuple[list[tuple[int, bytes]], float]:
    """A QoS 1 write on a fresh raw connection: what the broker sent until it closed the connection, and when
    (seconds after the PUBLISH). Raises TimeoutError when the connection stays open WRITE_TIMEOUT_S + 3 s."""
    raw = RawClient(port, f"w-{key}")
    try:
        topic = f"$ECQ/w/{clientid}/{key}".encode()
        sent = time.monotonic()
        raw.send(0x32, len(topic).to_bytes(2, "big") + topic + (1).to_bytes(2, "big") + b"v")
        packets = raw.read_until_closed(WRITE_TIMEOUT_S + 3)
        return packets, time.monotonic() - sent
    finally:
        raw.close()


@pytest.mark.timeout(90)
def test_without_nats_writes_get_no_puback_the_node_serves_mqtt_and_recovers(own_nats, cluster_nodes, connect):
    [node] = [n.start() for n in cluster_nodes(1, nats=own_nats, write_timeout=f"{WRITE_TIMEOUT_S}s",
                                               writer_pool_size=WRITER_AGENTS)]
    write(connect(node.port, "before"), "out", "before", "b")
    persistent = connect(node.port, "plain-persistent", clean_session=False)  # its sends are stored in JetStream
    assert persistent.subscribe("plain/#", 1) == 1
    outage_started = time.monotonic()
    own_nats.kill_all()

    results: list[tuple[list, float]] = []
    for wave in range(3):  # one after another: at least 3 failed commits, whatever the batching
        threads = [threading.Thread(target=lambda i=i: results.append(refused_write(node.port, "out", f"k{wave}{i}")))
                   for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WRITE_TIMEOUT_S + 10)
    assert len(results) == 12, "a write's connection was not closed"
    for packets, closed_after in results:
        assert not any(header >> 4 == PUBACK >> 4 for header, _body in packets), f"PUBACK without NATS: {packets}"
        assert WRITE_TIMEOUT_S - 0.5 < closed_after < WRITE_TIMEOUT_S + 2.5, f"closed after {closed_after:.1f} s"

    assert node.proc.poll() is None, "the node went down with NATS"
    subscriber = connect(node.port, "plain-sub")
    assert subscriber.subscribe("plain/#", 1) == 1
    publisher = connect(node.port, "plain-pub")
    publishing = time.monotonic()
    publisher.publish("plain/x", b"still here", qos=1)
    assert time.monotonic() - publishing < REQUEST_TIMEOUT_S, "the PUBACK waited for the persistent session's store"
    assert topics_payloads(subscriber.expect(1)) == [("plain/x", b"still here")]
    assert topics_payloads(persistent.expect(1)) == [("plain/x", b"still here")]  # sent unstored
    log = node.log()
    outage_s = time.monotonic() - outage_started
    assert 1 <= log.count("NATS unreachable") <= 2 * lines_let_through(outage_s, OUTAGE_LOG_INTERVAL_S), log
    assert 1 <= log.count("ECQ commit of") <= WRITER_AGENTS * lines_let_through(outage_s, FAILURE_LOG_INTERVAL_S), log

    restarted = time.monotonic()
    own_nats.start()
    recovered = _first_accepted_write(node.port, "out", deadline=restarted + 30)
    recovery_s = time.monotonic() - restarted
    assert recovered is not None, "no write accepted within 30 s of NATS being back"
    assert wait_until(lambda: "NATS connection back" in node.log(), 5)
    got = dict(topics_payloads(_drain_at_least(connect, node.port, "out", 2)))
    assert got["$ECQ/out/before"] == b"b" and got[f"$ECQ/out/{recovered}"] == recovered.encode()
    print(f"writes accepted again {recovery_s:.1f} s after the NATS servers were started again")


def _first_accepted_write(port: int, clientid: str, deadline: float) -> str | None:
    """Try one write a second on fresh connections until one is PUBACKed; its key, or None at ``deadline``."""
    attempt = 0
    while time.monotonic() < deadline:
        key = f"after-{attempt}"
        attempt += 1
        try:
            raw = RawClient(port, f"w-{key}")
        except OSError:
            time.sleep(0.5)
            continue
        try:
            topic = f"$ECQ/w/{clientid}/{key}".encode()
            raw.sock.settimeout(WRITE_TIMEOUT_S + 3)
            if raw.publish_qos1(topic, key.encode(), 1)[0] == PUBACK:
                return key
        except OSError:  # closed after write_timeout: NATS not ready yet
            pass
        finally:
            raw.close()
    return None


def _drain_at_least(connect, port: int, clientid: str, count: int):
    consumer = connect(port, clientid)
    assert consumer.subscribe(f"$ECQ/{clientid}/#") == 1
    return consumer.expect(count) + consumer.quiet(1.0)
