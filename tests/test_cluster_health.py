"""Health is readiness, leaders spread, failover in bounded time (issue 24, points 4, 5 and 6), on real processes:
a 3-server NATS JetStream cluster of the test's own (these tests kill its servers), ECQ nodes on loopback, the
admin API over HTTP, `ecq` on the command line and raw MQTT clients over TCP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from ecq.testing.failover import ROLES, PacedWriter, holds_connection, move_leader, time_to_first_puback, victim
from ecq.testing.nats import LocalNatsCluster, monitor_json
from tests.harness import RawClient, metrics_text, wait_until
from tests.test_cluster import ECQ, ecq_json
from tests.test_cluster_failures import shard_stream

DEGRADED_WITHIN_S = 2.0   # issue 24 point 4
JETSTREAM_ELECTION_MAX_S = 12.0  # a Raft follower campaigns 4-9 s after its leader's last heartbeat (not tunable);
                                 # 12.1 s was seen once when the killed server also led the meta group
ECQ_PART_S = 1.0
PUBACK = 0x40
STREAMS = ("ECQT_Q_0", "ECQT_Q_1", "ECQT_ACKS")  # 2 shards in namespace ECQT (see cluster_nodes)


@pytest.fixture
def own_nats(tmp_path):
    """A 3-server NATS JetStream cluster under tmp_path/nats, killed at teardown."""
    cluster = LocalNatsCluster(tmp_path / "nats").start()
    yield cluster
    cluster.kill_all()


def admin_get(node, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.admin_port}{path}", timeout=5) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def time_until(condition, timeout: float, interval: float = 0.05) -> float | None:
    """Seconds until ``condition()`` is true (polled), None if it is not within ``timeout``."""
    started = time.monotonic()
    if wait_until(condition, timeout, interval):
        return time.monotonic() - started
    return None


def write_acked(port: int, key: str, timeout: float = 3.0) -> bool:
    """One QoS 1 write on a fresh raw connection; True when it is PUBACKed within ``timeout``."""
    try:
        raw = RawClient(port, f"w-{key}")
    except OSError:
        return False
    try:
        raw.sock.settimeout(timeout)
        return raw.publish_qos1(f"$ECQ/w/hq/{key}".encode(), key.encode(), 1)[0] == PUBACK
    except OSError:
        return False
    finally:
        raw.close()


def healthy(node) -> bool:
    return admin_get(node, "/api/v1/health") == (200, {"status": "ok"})


# --- point 4: health is readiness ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_health_and_ready_follow_the_loss_of_every_nats_server(own_nats, cluster_nodes):
    [node] = [n.start() for n in cluster_nodes(1, nats=own_nats, write_timeout="2s")]
    assert wait_until(lambda: healthy(node), 15), admin_get(node, "/api/v1/health")
    assert admin_get(node, "/api/v1/ready") == (200, {"ready": True})
    metrics = metrics_text(node)
    for stream in STREAMS:
        assert f'ecq_stream_replicas{{stream="{stream}"}} 3.0' in metrics, metrics
        assert f'ecq_stream_replicas_current{{stream="{stream}"}} 3.0' in metrics, metrics
        assert metrics.count(f'ecq_stream_leader{{server="') >= 3 * len(STREAMS)
    assert "ecq_cluster_ready 1.0" in metrics

    own_nats.kill_all()
    degraded_after = time_until(lambda: admin_get(node, "/api/v1/health")[0] == 503, 10)
    assert degraded_after is not None and degraded_after <= DEGRADED_WITHIN_S, \
        f"health degraded {degraded_after} s after every NATS server was killed"
    status, body = admin_get(node, "/api/v1/health")
    assert body["status"] == "degraded" and "NATS unreachable" in body["reason"], body
    status, ready = admin_get(node, "/api/v1/ready")
    assert status == 503 and ready["ready"] is False and "NATS unreachable" in ready["reason"], ready
    assert "ecq_cluster_ready 0.0" in metrics_text(node)

    own_nats.start()
    assert wait_until(lambda: admin_get(node, "/api/v1/ready")[0] == 200, 30), admin_get(node, "/api/v1/ready")
    assert write_acked(node.port, "right-after-ready", timeout=2.0), "ready, but a write was not PUBACKed in 2 s"
    assert wait_until(lambda: healthy(node), 10), admin_get(node, "/api/v1/health")


@pytest.mark.timeout(120)
def test_a_dead_replica_server_degrades_health_naming_it_and_the_streams(own_nats, cluster_nodes):
    [node] = [n.start() for n in cluster_nodes(1, nats=own_nats)]
    assert wait_until(lambda: healthy(node), 15), admin_get(node, "/api/v1/health")
    assert wait_until(lambda: sorted(leader_counts(own_nats, list(STREAMS)).values()) == [1, 1, 1], 10), \
        f"leaders not spread at start: {leader_counts(own_nats, list(STREAMS))}"
    victim = own_nats.servers[2]
    led = [stream for stream in STREAMS if own_nats.stream_leader(stream) == victim.name]
    assert led, f"{victim.name} leads none of {STREAMS} although leaders are spread"
    killed = time.monotonic()
    victim.kill()
    degraded_after = time_until(lambda: admin_get(node, "/api/v1/health")[0] == 503, 10)
    assert degraded_after is not None and degraded_after <= DEGRADED_WITHIN_S, \
        f"health degraded {degraded_after} s after {victim.name} was killed"

    def leaderless() -> bool:
        problems = admin_get(node, "/api/v1/health")[1].get("problems", [])
        return all(f"stream {stream} has no leader" in problems for stream in led)
    assert wait_until(leaderless, max(0.0, killed + DEGRADED_WITHIN_S - time.monotonic()), 0.05), \
        f"{led} not reported leaderless within {DEGRADED_WITHIN_S} s: {admin_get(node, '/api/v1/health')}"
    print(f"{led} reported leaderless {time.monotonic() - killed:.2f} s after the kill")

    def every_stream_short_of(server: str) -> bool:
        problems = admin_get(node, "/api/v1/health")[1].get("problems", [])
        return all(any(f"stream {s} runs on 2 of 3 replicas (not current: {server})" in p for p in problems)
                   for s in STREAMS)
    assert wait_until(lambda: every_stream_short_of(victim.name), 20), admin_get(node, "/api/v1/health")
    assert admin_get(node, "/api/v1/ready") == (200, {"ready": True}), "2 of 3 replicas are a quorum"
    assert write_acked(node.port, "on-two-replicas")
    assert f'ecq_stream_replicas_current{{stream="ECQT_Q_0"}} 2.0' in metrics_text(node)

    victim.start()
    assert wait_until(lambda: healthy(node), 30), admin_get(node, "/api/v1/health")


def test_ready_on_leveldb_is_the_store_taking_writes(broker):
    assert admin_get(broker, "/api/v1/ready") == (200, {"ready": True})
    assert admin_get(broker, "/api/v1/health") == (200, {"status": "ok"})
    assert "ecq_cluster_ready" not in metrics_text(broker)


# --- point 6: leaders spread ------------------------------------------------------------------------


def leader_counts(cluster: LocalNatsCluster, streams: list[str]) -> dict[str, int]:
    counts = {server.name: 0 for server in cluster.servers}
    for stream in streams:
        leader = cluster.stream_leader(stream)
        counts[leader] = counts.get(leader, 0) + 1
    return counts


@pytest.mark.timeout(120)
def test_ecq_cluster_rebalance_spreads_the_leaders_and_status_shows_them(own_nats, cluster_nodes):
    [node] = [n.start() for n in cluster_nodes(1, nats=own_nats)]
    streams = list(STREAMS)
    assert wait_until(lambda: healthy(node), 15), admin_get(node, "/api/v1/health")
    assert wait_until(lambda: sorted(leader_counts(own_nats, streams).values()) == [1, 1, 1], 10), \
        f"leaders not spread at start: {leader_counts(own_nats, streams)}"
    for stream in streams:
        move_leader(own_nats, stream, "n1")
    assert wait_until(lambda: leader_counts(own_nats, streams)["n1"] == len(streams), 15), \
        leader_counts(own_nats, streams)

    answer = ecq_json("cluster", "rebalance", admin=node.admin_port)
    assert len(answer["moved"]) == 2, answer   # 3 leaders: 1 per server
    assert wait_until(lambda: sorted(leader_counts(own_nats, streams).values()) == [1, 1, 1], 10), \
        leader_counts(own_nats, streams)
    assert ecq_json("cluster", "rebalance", admin=node.admin_port)["moved"] == []

    status = ecq_json("status", admin=node.admin_port)["cluster"]
    assert {server: len(names) for server, names in status["leaders"].items()} == {"n1": 1, "n2": 1, "n3": 1}
    assert all(s["replicas_current"] == s["replicas"] == 3 for s in status["streams"].values())
    text = subprocess.run([ECQ, "status", "--admin", f"127.0.0.1:{node.admin_port}"], capture_output=True,
                          text=True, timeout=30).stdout
    assert "leaders per server: n1 1, n2 1, n3 1" in text, text
    assert "ECQT_Q_0" in text and "replicas 3/3" in text, text


# --- point 5: failover in bounded time ---------------------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.parametrize("role", ROLES)
def test_puback_resumes_within_5_s_of_a_kill9_of_a_nats_server(own_nats, cluster_nodes, role):
    """A kill that leaves the written stream its leader (a follower, the meta leader) costs ECQ's part only, within
    1 s (a request in flight to the killed server is sent again as soon as the node's connection drops, or after
    0.5 s for a direct get a replica never answers, not after the 2 s request timeout); a kill of the written stream's leader costs JetStream's own election (its followers wait a
    random 4-9 s for the lost leader, nats-server raft.go, not tunable) plus ECQ's 1 s."""
    [node] = [n.start() for n in cluster_nodes(1, nats=own_nats)]
    assert wait_until(lambda: healthy(node), 15), admin_get(node, "/api/v1/health")
    writer = PacedWriter(node.port, "fo", rate=200).start()
    try:
        server, kind = victim(own_nats, shard_stream("fo"), role, "node-1")
        held = holds_connection(server, "ecq node-1")
        resumed = time_to_first_puback(writer, server)
        print(f"kill -9 of {server.name} ({kind}, node connected to it: {held}): first PUBACK after {resumed} s")
        bound = ECQ_PART_S if kind != "stream leader" else JETSTREAM_ELECTION_MAX_S + ECQ_PART_S
        assert resumed is not None and resumed <= bound, \
            f"PUBACKs resumed {resumed} s after kill -9 of {server.name} ({kind})"
    finally:
        writer.close()


@pytest.mark.timeout(90)
def test_a_nats_server_that_stops_answering_is_left_within_seconds(own_nats, cluster_nodes):
    """A hung server (SIGSTOP: the TCP connection stays open, nothing is answered) is noticed by the link's pings
    (ecq.store.link.PING_INTERVAL_S x MAX_OUTSTANDING_PINGS) and the node reconnects to another server; with
    nats-py's default, 2 pings 2 minutes apart, the store's link stayed on the hung server for minutes."""
    [node] = [n.start() for n in cluster_nodes(1, nats=own_nats, write_timeout="2s")]
    assert wait_until(lambda: healthy(node), 15), admin_get(node, "/api/v1/health")
    held = [server for server in own_nats.servers if holds_connection(server, "ecq node-1")]
    assert held, "the node's connections were not found"
    hung = held[0]

    def links_on(server) -> int:
        connections = (monitor_json(server.ports.http, "/connz", 1.0) or {}).get("connections") or []
        return sum(c.get("name") == "ecq node-1" for c in connections)

    others = [server for server in own_nats.servers if server is not hung]
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        moved = time_until(lambda: sum(links_on(s) for s in others) >= 2, 20, 0.2)  # the store's link and the bus's
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    assert moved is not None and moved <= 10, f"the node's links left the hung server after {moved} s"
