"""Two ECQ nodes on the session's 3-server NATS JetStream cluster, over TCP with paho and raw MQTT clients: the
issue's cluster points 2 (cross-node queues), 6 (ordinary MQTT across nodes; retained messages and sessions across
nodes are in test_cluster_state.py) and 7 (cluster-wide operations).
The destructive points (3, 4, 5) are in test_cluster_failures.py."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import ECQ, BrokerProcess, RawClient, drain, metrics_text, wait_until, write

REALTIME_BOUND_S = 1.0
TAKEOVER_BOUND_S = 2.0


def started(nodes: list[BrokerProcess]) -> list[BrokerProcess]:
    return [node.start() for node in nodes]


def receive(raw: RawClient, count: int) -> list[tuple[bytes, int, bytes]]:
    """The next ``count`` QoS 1 PUBLISHes on a raw client: (topic, packet id, payload) each."""
    return [raw.receive_publish() for _ in range(count)]


# --- point 2: queues across nodes ------------------------------------------------------------------


def test_a_write_on_one_node_reaches_its_consumer_on_the_other_in_realtime(cluster_nodes, connect):
    # a 30 s heartbeat: only the append notice through NATS can bring the write in time, not a re-poll
    node1, node2 = started(cluster_nodes(heartbeat_interval="30s"))
    consumer = connect(node2.port, "rt")
    assert consumer.subscribe("$ECQ/rt/#") == 1
    producer = connect(node1.port, "producer")
    latencies = []
    for i in range(5):
        sent = time.monotonic()
        write(producer, "rt", f"k{i}", f"v{i}")
        [message] = consumer.expect(1, timeout=5)
        latencies.append(time.monotonic() - sent)
        assert (message.topic, message.payload, message.qos) == (f"$ECQ/rt/k{i}", f"v{i}".encode(), 1)
    assert max(latencies) < REALTIME_BOUND_S, f"write-to-delivery latencies across nodes: {latencies}"


def hop_between_nodes(nodes: list[BrokerProcess], connect, clientid: str, rounds: int, takeover: bool) -> None:
    """A consumer that moves to the other node every round, acking all but the last message it got before it
    leaves: by closing its connection first, or (``takeover``) by connecting anew while the old connection is
    open, which the old node must then close within TAKEOVER_BOUND_S. Each round it must get exactly the one
    message it left unacked (never one it acked), then the round's two new writes (made through both nodes)."""
    producers = [connect(node.port, f"producer-{i}") for i, node in enumerate(nodes)]
    unacked: list[bytes] = []
    old: RawClient | None = None
    try:
        for round_ in range(rounds):
            arriving = time.monotonic()
            consumer = RawClient(nodes[round_ % 2].port, clientid)  # raw: paho would reconnect by itself
            if old is not None:
                old.read_until_closed(timeout=TAKEOVER_BOUND_S + 1)
                closed_after = time.monotonic() - arriving
                assert closed_after < TAKEOVER_BOUND_S, f"round {round_}: old connection closed after {closed_after:.2f} s"
                old.close()
            consumer.subscribe(f"$ECQ/{clientid}/#".encode())
            delivered = receive(consumer, len(unacked))
            keys = [f"r{round_}-a", f"r{round_}-b"]
            for producer, key in zip(producers, keys):
                write(producer, clientid, key, key)
            delivered += receive(consumer, 2)
            expected = unacked + [f"$ECQ/{clientid}/{key}".encode() for key in keys]
            assert [topic for topic, _id, _payload in delivered] == expected, f"round {round_}"
            consumer.puback(*[packet_id for _topic, packet_id, _payload in delivered[:-1]])
            unacked = [delivered[-1][0]]
            if takeover:
                old = consumer
            else:
                consumer.close()
    finally:
        if old is not None:
            old.close()
    last_key = unacked[0].decode().rsplit("/", 1)[1]
    assert drain(connect, nodes[rounds % 2].port, clientid, 1) == [(unacked[0].decode(), last_key.encode())]


def test_a_consumer_that_acked_on_one_node_resumes_after_its_acked_position_on_the_other(cluster_nodes, connect):
    hop_between_nodes(started(cluster_nodes()), connect, "hop", rounds=8, takeover=False)


def test_a_takeover_across_nodes_closes_the_old_connection_and_moves_delivery(cluster_nodes, connect):
    hop_between_nodes(started(cluster_nodes()), connect, "tk", rounds=8, takeover=True)


@pytest.mark.timeout(60)
def test_pubacks_the_old_node_had_not_read_yet_count_after_a_takeover_from_the_other(cluster_nodes, connect):
    """The consumer's PUBACKs reach node 1 while node 1 is stopped (SIGSTOP: they wait in its socket buffer);
    the consumer then connects to node 2, whose takeover request waits for node 1 too; node 1 continues. It must
    read the PUBACKs before it closes the old connection for the takeover: node 2 then delivers only the entry
    left unacked, never one the consumer acked."""
    node1, node2 = started(cluster_nodes())
    producer = connect(node2.port, "producer")
    for i in range(4):
        write(producer, "late", f"k{i}", f"v{i}")
    old = RawClient(node1.port, "late")
    new = None
    try:
        old.subscribe(b"$ECQ/late/#")
        delivered = receive(old, 4)
        os.kill(node1.proc.pid, signal.SIGSTOP)
        try:
            old.puback(*[packet_id for _topic, packet_id, _payload in delivered[:3]])
            connecting = concurrent.futures.ThreadPoolExecutor(1).submit(RawClient, node2.port, "late")
            time.sleep(0.3)  # node 2 read the CONNECT and asked node 1, which cannot answer yet
        finally:
            os.kill(node1.proc.pid, signal.SIGCONT)
        new = connecting.result(10)
        new.subscribe(b"$ECQ/late/#")
        assert [topic for topic, _id, _payload in receive(new, 1)] == [b"$ECQ/late/k3"]
        new.sock.settimeout(1.0)
        with pytest.raises(TimeoutError):  # nothing more: an entry acked on node 1 delivered again would come here
            new.receive()
    finally:
        old.close()
        if new is not None:
            new.close()


# --- point 6: ordinary MQTT across nodes -----------------------------------------------------------


@pytest.mark.parametrize("qos", [0, 1])
def test_a_plain_publish_reaches_every_subscriber_of_both_nodes_exactly_once(cluster_nodes, connect, qos):
    node1, node2 = started(cluster_nodes())
    subscribers = {"sub-1": connect(node1.port, "sub-1"), "sub-2": connect(node2.port, "sub-2")}
    for subscriber in subscribers.values():
        assert subscriber.subscribe("plain/#", qos) == qos
    connect(node1.port, "pub-1").publish("plain/from-1", b"one", qos=qos)
    connect(node2.port, "pub-2").publish("plain/from-2", b"two", qos=qos)
    for name, subscriber in subscribers.items():
        got = subscriber.expect(2)
        assert sorted((m.topic, m.payload, m.qos) for m in got) == [
            ("plain/from-1", b"one", qos), ("plain/from-2", b"two", qos)], name
    for name, subscriber in subscribers.items():  # no copy coming back through NATS, no loop
        assert subscriber.quiet(1.0) == [], name


# --- point 7: operations are cluster-wide ----------------------------------------------------------


def ecq_json(*args: str, admin: int) -> dict:
    result = subprocess.run([ECQ, *args, "--json", "--admin", f"127.0.0.1:{admin}"], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def queue_figures(node: BrokerProcess, clientids: list[str]) -> dict:
    """What `ecq status` and `ecq inspect` say of the queues on ``node``."""
    status = ecq_json("status", admin=node.admin_port)
    figures = {"status": (status["queues"], status["messages"], status["bytes"])}
    for clientid in clientids:
        info = ecq_json("inspect", clientid, admin=node.admin_port)
        figures[clientid] = (info["last_seqno"], info["stored"], info["pending"], info["acked"])
    return figures


def test_status_and_inspect_show_the_same_figures_on_either_node(cluster_nodes, connect):
    node1, node2 = started(cluster_nodes())
    producer1, producer2 = connect(node1.port, "producer-1"), connect(node2.port, "producer-2")
    for key in ("k0", "k1", "k0"):  # k0 twice: compacted to one entry
        write(producer1, "ops-a", key, "v1")
    write(producer2, "ops-a", "k2", "v2")
    write(producer2, "ops-b", "k0", "v2")
    consumer = connect(node2.port, "ops-a", manual_ack=True)
    consumer.subscribe("$ECQ/ops-a/#")
    first, _second, _third = consumer.expect(3)
    consumer.ack(first)
    seen: list[dict] = []

    def settled() -> bool:
        seen[:] = [queue_figures(node, ["ops-a", "ops-b"]) for node in (node1, node2)]
        one = seen[0]
        return seen[0] == seen[1] and one["status"][:2] == (2, 4) and one["ops-a"][1:3] == (3, 2) \
            and one["ops-a"][3] > 0 and one["ops-b"][1:] == (1, 1, 0)
    assert wait_until(settled, 15, 0.5), f"node 1 and node 2 report: {seen}"


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def test_metrics_show_the_nats_link_and_the_jetstream_publish_latency(cluster_nodes, connect):
    node1, node2 = started(cluster_nodes())
    producer = connect(node1.port, "producer")
    for i in range(3):
        write(producer, "met", f"k{i}", "v")
    texts = [metrics_text(node) for node in (node1, node2)]
    assert [metric(text, "ecq_nats_connected") for text in texts] == [1.0, 1.0]
    assert metric(texts[0], "ecq_jetstream_publish_seconds_count") >= 3


def lake_events(lake: Path) -> list[dict]:
    import pyarrow.dataset as ds
    return ds.dataset(lake, format="parquet", partitioning="hive").to_table(columns=["type", "clientid", "key"]) \
        .to_pylist()


def make_cluster_lake(cluster_nodes, connect, lake: Path) -> None:
    """Two nodes sharing ``lake``: 5 writes to queue ev through node 1, 4 through node 2, all delivered to and
    acked by its consumer on node 2; both nodes stopped (their final export flushes every event)."""
    node1, node2 = started(cluster_nodes(lake_dir=lake, export_interval="200ms", lake_file_age="200ms"))
    producer1, producer2 = connect(node1.port, "producer-1"), connect(node2.port, "producer-2")
    for i in range(5):
        write(producer1, "ev", f"n1-{i}", "v")
    for i in range(4):
        write(producer2, "ev", f"n2-{i}", "v")
    consumer = connect(node2.port, "ev")
    consumer.subscribe("$ECQ/ev/#")
    assert len(consumer.expect(9)) == 9
    assert wait_until(lambda: ecq_json("inspect", "ev", admin=node2.admin_port)["pending"] == 0, 10)
    for client in (consumer, producer1, producer2):
        client.close()
    assert [node.stop() for node in (node1, node2)] == [0, 0]


def test_the_queue_events_of_both_nodes_land_in_one_lake_counted_once(cluster_nodes, connect, tmp_path):
    lake = tmp_path / "lake"
    make_cluster_lake(cluster_nodes, connect, lake)
    events = [e for e in lake_events(lake) if e["clientid"] == "ev"]
    counts = {kind: sum(1 for e in events if e["type"] == kind) for kind in ("appended", "delivered", "acked")}
    assert counts == {"appended": 9, "delivered": 9, "acked": 9}
    assert sorted(e["key"] for e in events if e["type"] == "appended") == sorted(
        [f"n1-{i}" for i in range(5)] + [f"n2-{i}" for i in range(4)])


@pytest.mark.timeout(300)
def test_the_spark_report_counts_the_events_of_both_nodes_once(cluster_nodes, connect, tmp_path):
    # ~30 s alone (a local Spark JVM starts; shared with the pipeline tests when they run in the same session)
    from click.testing import CliRunner

    from ecq.pipeline.cli import pipeline
    from ecq.pipeline.report import read_table
    lake, out = tmp_path / "lake", tmp_path / "report"
    make_cluster_lake(cluster_nodes, connect, lake)
    result = CliRunner().invoke(pipeline, ["report", "--lake", str(lake), "--out", str(out), "--master", "local[2]"])
    assert result.exit_code == 0, result.output
    [row] = [r for r in read_table(out, "consumers").to_pylist() if r["clientid"] == "ev"]
    assert (row["appended"], row["delivered"], row["redeliveries"], row["acked"], row["backlog"]) == (9, 9, 0, 9, 0)
