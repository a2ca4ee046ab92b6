"""Operating a cluster (issue 24, point 8) on real processes: `ecq drain`, a rolling restart with paho
producers writing all along, and NATS authentication and TLS, with real nats-server and ECQ node processes on
loopback and MQTT clients over TCP."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from ecq.testing.nats import NatsPorts, NatsServer, auth_block, tls_block
from tests.harness import ECQ, BrokerProcess, RawClient, drain, fixed_header, port_open, wait_until, write
from tests.test_cluster_failures import collect_queue

NODE_EXIT_TIMEOUT_S = 30.0  # a node that cannot use NATS exits within CONNECT_TIMEOUT_S (10 s) and its shutdown


# --- NATS authentication and TLS: one server, JetStream R1 ------------------------------------------


def single_nats(base: Path, extra_config: str) -> NatsServer:
    """One nats-server with JetStream under ``base`` and ``extra_config`` (an auth or TLS block), started."""
    from ecq.testing import free_port
    ports = NatsPorts(free_port(), free_port(), free_port())
    return NatsServer("n1", ports, base / "nats-1", base / "run", clustered=False, extra_config=extra_config).start()


def r1_node(workdir: Path, url: str, **options) -> BrokerProcess:
    """An ECQ node (not started) on the one server at ``url``: 1 replica, 2 shards."""
    workdir.mkdir()
    return BrokerProcess(workdir, backend="jetstream", nats_servers=[url], jetstream_replicas=1,
                         jetstream_shards=2, node_name=workdir.name, **options)


def writes_and_delivers(node: BrokerProcess, connect) -> None:
    """A write PUBACKed by ``node`` comes back to its consumer: the node's store on NATS works."""
    write(connect(node.port, "producer"), "q1", "k1", b"v1")
    consumer = connect(node.port, "q1")
    assert consumer.subscribe("$ECQ/q1/#") == 1
    assert [(m.topic, m.payload) for m in consumer.expect(1)] == [("$ECQ/q1/k1", b"v1")]


def refused_start(node: BrokerProcess, reason: str) -> None:
    """``node`` exits 1 at start-up with one error line naming ``reason``, and never listened."""
    node.proc = subprocess.Popen([ECQ, "broker", "-c", str(node.config_path)], stdout=node.log_path.open("a"),
                                 stderr=subprocess.STDOUT, cwd=node.workdir)
    assert node.proc.wait(NODE_EXIT_TIMEOUT_S) == 1, node.log()
    errors = [line for line in node.log().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and reason in errors[0], node.log()


@pytest.fixture
def node_dirs(tmp_path):
    """Factory of ECQ nodes on one NATS server (r1_node's arguments); every node is killed at teardown."""
    made: list[BrokerProcess] = []

    def factory(name: str, url: str, **options) -> BrokerProcess:
        made.append(r1_node(tmp_path / name, url, **options))
        return made[-1]

    yield factory
    for node in made:
        node.kill()


@pytest.fixture
def auth_nats(tmp_path):
    """A nats-server requiring user ``ecq`` with password ``s3cret``; killed at teardown."""
    server = single_nats(tmp_path / "nats", auth_block(user="ecq", password="s3cret"))
    yield server
    server.kill()


@pytest.mark.timeout(90)
def test_nats_user_and_password_right_ones_work_wrong_ones_exit_with_one_clear_line(auth_nats, node_dirs,
                                                                                       connect):
    writes_and_delivers(node_dirs("right", auth_nats.url, nats_user="ecq", nats_password="s3cret").start(),
                        connect)
    refused_start(node_dirs("wrong", auth_nats.url, nats_user="ecq", nats_password="wrong"),
                  "refused ECQ's credentials")


@pytest.mark.timeout(90)
def test_a_nats_token_right_one_works_wrong_one_exits_with_one_clear_line(tmp_path, node_dirs, connect):
    server = single_nats(tmp_path / "nats", auth_block(token="t0ken"))
    try:
        writes_and_delivers(node_dirs("right", server.url, nats_token="t0ken").start(), connect)
        refused_start(node_dirs("wrong", server.url, nats_token="nope"), "refused ECQ's credentials")
    finally:
        server.kill()


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_certificates(directory: Path) -> dict[str, Path]:
    """A CA and a server certificate it signed for IP 127.0.0.1, made with the openssl CLI (EC P-256 keys)."""
    directory.mkdir()
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ecq test CA",
            cwd=directory)
    openssl("req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=directory)
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "2", "-extfile", "san.ext", cwd=directory)
    return {name: directory / f"{name}.pem" if name in ("ca", "server") else directory / "server.key"
            for name in ("ca", "server", "server_key")}


@pytest.mark.timeout(90)
def test_tls_to_nats_with_the_ca_works_and_without_it_exits_with_one_clear_line(tmp_path, node_dirs, connect):
    pems = make_certificates(tmp_path / "pki")
    server = single_nats(tmp_path / "nats", tls_block(pems["server"], pems["server_key"]))
    try:
        url = server.url.replace("nats://", "tls://")
        writes_and_delivers(node_dirs("with-ca", url, nats_tls_ca=str(pems["ca"])).start(), connect)
        refused_start(node_dirs("without-ca", url), "TLS to the server failed")
    finally:
        server.kill()


def test_a_tls_client_certificate_needs_its_key(tmp_path):
    (tmp_path / "client.pem").write_text("")
    node = r1_node(tmp_path / "node", "tls://127.0.0.1:4222", nats_tls_cert=str(tmp_path / "client.pem"))
    checked = subprocess.run([ECQ, "broker", "-c", str(node.config_path)], capture_output=True, text=True,
                             timeout=30, cwd=node.workdir)
    assert checked.returncode == 2 and "nats_tls_cert and nats_tls_key go together" in checked.stderr, checked.stderr


# --- ecq drain and a rolling restart: two ECQ nodes on the session's 3-server NATS cluster -----------


def ecq_drain(node: BrokerProcess) -> tuple[int, dict]:
    """``ecq drain --json`` against ``node``'s admin API: (exit code, the report)."""
    done = subprocess.run([ECQ, "drain", "--admin", f"127.0.0.1:{node.admin_port}", "--json"], capture_output=True,
                          text=True, timeout=60)
    return done.returncode, json.loads(done.stdout) if done.stdout.strip() else {"stderr": done.stderr}


def not_ready_because(node: BrokerProcess) -> str | None:
    """Why /api/v1/ready says the node is not ready (None while it is, or when the API does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.admin_port}/api/v1/ready", timeout=2):
            return None
    except urllib.error.HTTPError as exc:
        return json.load(exc).get("reason")
    except (OSError, ValueError):
        return None


def health(node: BrokerProcess) -> str | None:
    """The node's /api/v1/health status, None when its admin API does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.admin_port}/api/v1/health", timeout=2) as answer:
            return json.load(answer)["status"]
    except (OSError, ValueError):
        return None


@pytest.mark.timeout(90)
def test_drain_closes_listeners_and_clients_saves_acks_and_the_consumer_resumes_on_the_other_node(cluster_nodes,
                                                                                                   connect):
    node1, node2 = [node.start() for node in cluster_nodes()]
    producer = connect(node1.port, "dp")
    for i in range(5):
        write(producer, "dq", f"k{i}", f"v{i}")
    consumer = RawClient(node1.port, "dq")
    try:
        consumer.subscribe(b"$ECQ/dq/#")
        delivered = [consumer.receive_publish() for _ in range(5)]
        consumer.puback(*[packet_id for _topic, packet_id, _payload in delivered[:3]])
        code, report = ecq_drain(node1)
        assert code == 0 and report["drained"], report
        assert report["listeners_closed"] == 1 and report["connections_closed"] == 2, report
        assert consumer.read_until_closed(5.0) == [], "the consumer's connection stayed open"
    finally:
        consumer.close()
    assert producer.disconnected.wait(5), "the producer's connection stayed open"
    assert not port_open(node1.port), "node 1 still accepts MQTT connections after the drain"
    assert health(node1) is not None, "the drained node's admin API stopped answering"
    assert ecq_drain(node1)[0] == 0, "a second drain must answer the first one's report"
    # the acks the consumer sent before the drain were saved: node 2 delivers exactly the two unacked entries
    assert drain(connect, node2.port, "dq", 2) == [("$ECQ/dq/k3", b"v3"), ("$ECQ/dq/k4", b"v4")]
    assert node1.stop() == 0


def drain_with_writes_in_flight(node: BrokerProcess, nats_cluster, piled_up) -> tuple[int, dict]:
    """``ecq drain`` of ``node`` while its writes cannot commit: every NATS server is stopped (SIGSTOP) until
    ``piled_up()`` (writes wait unacknowledged) and the node says it drains, then continued (SIGCONT, within a few
    seconds: below JetStream's election timeout). Returns what :func:`ecq_drain` returns."""
    pids = [server.pid for server in nats_cluster.servers]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        assert wait_until(piled_up, 5, 0.01), "no write waited for NATS"
        draining = concurrent.futures.ThreadPoolExecutor(1).submit(ecq_drain, node)
        assert wait_until(lambda: not_ready_because(node) == "draining", 10, 0.02), "the drain did not begin"
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    return draining.result(60)


def qos1_write(queue: str, packet_id: int) -> bytes:
    """An encoded QoS 1 PUBLISH writing key ``k<packet_id>`` of ``queue`` (payload: the key)."""
    topic, key = f"$ECQ/w/{queue}/k{packet_id}".encode(), f"k{packet_id}".encode()
    body = struct.pack(">H", len(topic)) + topic + struct.pack(">H", packet_id) + key
    return fixed_header(0x32, len(body)) + body


@pytest.mark.timeout(90)
def test_a_drain_pubacks_every_write_it_stored_before_it_closes_the_connection(cluster_nodes, nats_cluster):
    """A write the draining node stored but did not PUBACK would be sent again to another node, after which the
    client may write a newer value of its key there, and the older one could land last: so every write read
    is PUBACKed before the close, and nothing is stored that was not PUBACKed."""
    node1, node2 = [node.start() for node in cluster_nodes()]
    client, window = RawClient(node1.port, "blaster"), 100
    answers: list[tuple[int, bytes]] = []
    client.sock.settimeout(30)

    def read_answers() -> None:
        try:
            while True:
                answers.append(client.receive())
        except OSError:  # closed by the drain (or 30 s without a packet: the assertions below tell)
            pass

    reader = threading.Thread(target=read_answers, daemon=True)
    reader.start()
    sent = 0

    def send_pipelined() -> None:  # up to ``window`` writes unacknowledged, as fast as the node takes them
        nonlocal sent
        try:
            while sent < 60000:
                if sent - len(answers) < window:
                    client.send_raw(b"".join(qos1_write("bq", pid) for pid in range(sent + 1, sent + 11)))
                    sent += 10
                else:
                    time.sleep(0.0005)
        except OSError:  # the drain closed the connection
            pass

    sender = threading.Thread(target=send_pipelined, daemon=True)
    sender.start()
    try:
        assert wait_until(lambda: len(answers) >= 1000, 20), f"only {len(answers)} PUBACKs"
        code, report = drain_with_writes_in_flight(node1, nats_cluster, lambda: sent - len(answers) >= window // 2)
        reader.join(10)
        sender.join(10)
    finally:
        client.close()
    assert code == 0 and report["drained"], report
    assert report["writes_in_flight"] > 0, f"no write was in flight when the drain began: nothing tested ({report})"
    assert {header for header, _body in answers} == {0x40}, "only PUBACKs were expected"
    acked = {f"k{struct.unpack('>H', body)[0]}" for _header, body in answers}
    stored = collect_queue(node2.port, "bq", len(acked), timeout=30)
    assert sorted(set(stored) - acked) == [], "stored, yet the drained node never PUBACKed them"
    assert sorted(acked - set(stored)) == [], "PUBACKed, yet not stored"
    print(f"drain with {report['writes_in_flight']} writes in flight: {len(acked)} PUBACKed of {sent} sent, "
          f"all stored, nothing else stored")


class FailoverProducer:
    """A paho QoS 1 producer writing ``rate`` unique keys per second to queue ``queue`` on its own thread, without
    waiting for PUBACKs (pipelined). When its connection closes it connects to the next of ``ports`` that accepts
    (paho sends its unacknowledged PUBLISHes again there, MQTT 3.1.1 section 4.4); paho's own reconnect would go
    back to the same port. :attr:`acked` are the keys PUBACKed."""

    def __init__(self, ports: list[int], first: int, clientid: str, queue: str, rate: float) -> None:
        self.ports, self.queue, self.rate = ports, queue, rate
        self._next = first
        self.sent: list[str] = []
        self._keys: dict[int, str] = {}     # packet id -> key (fewer than 65535 writes: ids are not reused)
        self._pubacked: set[int] = set()
        self.disconnects = 0
        self._stop, self._closed = threading.Event(), threading.Event()
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=clientid, protocol=mqtt.MQTTv311)
        self._client.max_inflight_messages_set(0)
        self._client.max_queued_messages_set(0)
        self._client.on_publish = lambda _c, _u, mid, _rc, _p: self._pubacked.add(mid)
        self._writer = threading.Thread(target=self._write, daemon=True)
        self._network = threading.Thread(target=self._serve_network, daemon=True)

    def start(self) -> FailoverProducer:
        self._client.connect("127.0.0.1", self.ports[self._next], keepalive=30)
        self._network.start()
        self._writer.start()
        return self

    @property
    def acked(self) -> set[str]:
        keys = dict(self._keys)
        return {keys[mid] for mid in list(self._pubacked) if mid in keys}

    def stop(self) -> None:
        """Stop writing; PUBACKs of the writes in flight still come."""
        self._stop.set()
        self._writer.join(5)

    def close(self) -> None:
        self.stop()
        self._closed.set()
        self._network.join(5)
        self._client.disconnect()

    def _write(self) -> None:
        started = time.monotonic()
        while not self._stop.is_set() and len(self.sent) < 60000:
            key = f"k{len(self.sent):06d}"
            self.sent.append(key)
            info = self._client.publish(f"$ECQ/w/{self.queue}/{key}", key.encode(), qos=1)
            self._keys[info.mid] = key
            time.sleep(max(0.0, started + len(self.sent) / self.rate - time.monotonic()))

    def _serve_network(self) -> None:
        while not self._closed.is_set():
            if self._client.loop(0.05) != mqtt.MQTT_ERR_SUCCESS:
                self.disconnects += 1
                self._connect_elsewhere()

    def _connect_elsewhere(self) -> None:
        while not self._closed.is_set():
            self._next = (self._next + 1) % len(self.ports)
            try:
                self._client.connect("127.0.0.1", self.ports[self._next], keepalive=30)
                return
            except OSError:  # refused: that node is drained or down
                time.sleep(0.1)


def restart_drained(node: BrokerProcess, producers: list[FailoverProducer]) -> dict:
    """Drain ``node`` with ``ecq drain`` (exit 0), stop it (exit 0), start it again and wait until it is healthy
    and every producer had 50 more writes PUBACKed (by the other node, or by this one again); the drain report."""
    code, report = ecq_drain(node)
    assert code == 0 and report["drained"], report
    assert node.stop() == 0, node.log()
    node.start()
    assert wait_until(lambda: health(node) == "ok", 20), f"node not healthy again:\n{node.log()}"
    marks = [len(p.acked) + 50 for p in producers]
    assert wait_until(lambda: all(len(p.acked) >= m for p, m in zip(producers, marks)), 30), \
        f"writes stalled: {[len(p.acked) for p in producers]} acked, wanted {marks}"
    return report


@pytest.mark.timeout(180)
def test_a_rolling_restart_with_writes_flowing_loses_no_pubacked_write(cluster_nodes):
    nodes = [node.start() for node in cluster_nodes(write_timeout="10s")]
    ports = [node.port for node in nodes]
    producers = [FailoverProducer(ports, i % 2, f"rp{i}", f"rq{i}", rate=150).start() for i in range(3)]
    try:
        assert wait_until(lambda: all(len(p.acked) >= 100 for p in producers), 20), "writes did not start"
        reports = [restart_drained(node, producers) for node in nodes]
    finally:
        for producer in producers:
            producer.stop()
    for producer in producers:
        assert wait_until(lambda: len(producer.acked) == len(producer.sent), 30), \
            f"{len(producer.sent) - len(producer.acked)} writes of {producer.queue} never PUBACKed"
        producer.close()
    for producer in producers:
        delivered = collect_queue(ports[0], producer.queue, len(producer.acked), timeout=30)
        missing = sorted(producer.acked - set(delivered))
        assert missing == [], f"{len(missing)} PUBACKed writes of {producer.queue} lost, e.g. {missing[:5]}"
        assert producer.disconnects >= 1, f"{producer.queue}'s producer never moved to the other node"
    print(f"rolling restart: {sum(len(p.acked) for p in producers)} writes PUBACKed, 0 lost; drains: {reports}")
