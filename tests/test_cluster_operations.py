"""Operating a cluster (issue 24, point 8) on real processes: `ecq drain`, a rolling restart with paho
producers writing all along, and NATS authentication and TLS, with real nats-server and ECQ node processes on
loopback and MQTT clients over TCP."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ecq.testing.nats import NatsPorts, NatsServer, auth_block, tls_block
from tests.harness import ECQ, BrokerProcess, write

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
