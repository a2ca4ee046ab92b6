"""Two ECQ nodes on the session's NATS cluster, over TCP: what the shard streams' notices keep current on every
node (issue 24, points 1 and 3). A write is counted where it was taken, a consumer on the other node takes it
from its notice without a store read, the lag index of every node follows every node's writes and acks, and an
idle node asks NATS for nothing but its shard checks; an append whose notice was lost (dropped here on purpose, as
a reconnect would) reaches the consumer and the lag index once the shard check finds it. How the store finds lost
notices is tested in tests/test_jetstream_store.py."""

from __future__ import annotations

import json
import re
import time
import urllib.request

from ecq.config import EcqSettings
from ecq.queue.clock import now_ms
from ecq.queue.engine import QueueEngine
from ecq.store.backends import open_store
from ecq.store.jetstream import JetStreamStore
from ecq.store.jetstream_health import POLL_INTERVAL_S
from ecq.store.protocol import Append
from ecq.testing.nats import monitor_json
from tests.fake_connection import FakeConnection, publish, settle
from tests.harness import metrics_text, wait_until, write
from tests.test_jetstream_store import notices_dropped


def started(nodes):
    return [node.start() for node in nodes]


def requests_sent(nats_cluster, node_name: str) -> int:
    """Messages the ECQ node ``node_name`` sent to NATS so far (publishes and requests, any server it is on):
    each store read is at least one JetStream request."""
    total = 0
    for server in nats_cluster.servers:
        answer = monitor_json(server.ports.http, "/connz?limit=1024") or {}
        total += sum(c.get("in_msgs", 0) for c in answer.get("connections") or []
                     if c.get("name") == f"ecq {node_name}")
    return total


def counter(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:_total)? (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def top(node) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.admin_port}/api/v1/top?n=1000", timeout=10) as answer:
        return json.load(answer)


def test_a_compaction_is_counted_once_on_the_node_that_took_the_write(cluster_nodes, connect):
    node1, node2 = started(cluster_nodes())
    producer1, producer2 = connect(node1.port, "producer-1"), connect(node2.port, "producer-2")
    write(producer2, "cq", "k", "first")   # stored through node 2
    write(producer1, "cq", "k", "second")  # replaces it through node 1
    assert wait_until(lambda: counter(metrics_text(node1), "ecq_compactions") == 1, 10)
    time.sleep(0.5)  # a second count, on node 2, would come with the same notice
    assert counter(metrics_text(node2), "ecq_compactions") == 0
    assert counter(metrics_text(node1), "ecq_compactions") == 1


def test_a_caught_up_consumer_on_one_node_takes_the_other_nodes_appends_without_a_store_read(
        cluster_nodes, connect, nats_cluster):
    # no PUBACK (and a window of 31 to hold them all): no ack save either, only reads would send to NATS
    node1, node2 = started(cluster_nodes(heartbeat_interval="30s", reader_batch_size=31))
    consumer = connect(node2.port, "rt", manual_ack=True)
    assert consumer.subscribe("$ECQ/rt/#") == 1
    producer = connect(node1.port, "producer")
    write(producer, "rt", "k-first", "v")
    consumer.expect(1, timeout=5)
    before = requests_sent(nats_cluster, "node-2")
    for i in range(20):
        write(producer, "rt", f"k{i}", f"v{i}")
        [message] = consumer.expect(1, timeout=5)
        assert message.payload == f"v{i}".encode()
    sent = requests_sent(nats_cluster, "node-2") - before
    assert sent < 10, f"node 2 sent {sent} NATS requests while 20 appends of node 1 were delivered on it"


def test_the_lag_index_of_each_node_follows_the_writes_and_acks_of_the_other(cluster_nodes, connect):
    node1, node2 = started(cluster_nodes(heartbeat_interval="30s"))
    producer = connect(node1.port, "producer")
    for i in range(6):
        write(producer, "lag", f"k{i}", "x" * (i + 1))
    write(producer, "lag", "k0", "yy")  # compacts k0
    seen: list[dict] = []

    def same(pending: int) -> bool:
        seen[:] = [top(node) for node in (node1, node2)]
        rows = [[(r["clientid"], r["pending"], r["pending_bytes"]) for r in t["queues"]] for t in seen]
        return rows[0] == rows[1] and seen[0]["pending"] == pending
    assert wait_until(lambda: same(6), 10, 0.3), f"node 1 and node 2: {seen}"
    consumer = connect(node1.port, "lag", manual_ack=True)
    consumer.subscribe("$ECQ/lag/#")
    messages = consumer.expect(5)  # the inflight window (reader_batch_size 5)
    for message in messages[:4]:
        consumer.ack(message)
    assert wait_until(lambda: same(2), 10, 0.3), f"node 1 and node 2 after 4 acks on node 1: {seen}"


def test_idle_nodes_with_online_consumers_ask_nats_only_for_health_and_shard_checks(
        cluster_nodes, connect, nats_cluster):
    _node1, node2 = started(cluster_nodes(heartbeat_interval="1s"))
    producer = connect(node2.port, "producer")
    consumers = []
    for i in range(20):
        write(producer, f"idle{i}", "k", "v")
        consumer = connect(node2.port, f"idle{i}")
        consumer.subscribe(f"$ECQ/idle{i}/#")
        consumer.expect(1, timeout=5)
        consumers.append(consumer)
    time.sleep(1.0)  # the last ack saves are sent
    before = requests_sent(nats_cluster, "node-2")
    time.sleep(6.0)  # six heartbeats, at least one shard check (every 5 s: one stream info per shard, 2 shards)
    sent = requests_sent(nats_cluster, "node-2") - before
    # the stream health monitor asks each of the 3 streams for its info every 0.5 s (ecq.store.jetstream_health):
    # 36 in 6 s; polling the 20 idle consumers each heartbeat, as before, would add 2 requests per consumer per s
    health_polls = 3 * int(6.0 / POLL_INTERVAL_S)
    assert sent <= health_polls + 4 + 10, f"idle node sent {sent} NATS requests in 6 s ({health_polls} health polls)"


async def test_an_append_whose_notice_was_lost_reaches_the_consumer_and_the_lag_index_after_the_shard_check(
        jetstream_options):
    settings = EcqSettings(admin_bind=None, events=False, writer_pool_size=2, reader_batch_size=3,
                           heartbeat_interval="30s", **jetstream_options)
    store = open_store(settings.model_copy(update={"node_name": "engine"}))
    engine = QueueEngine(settings, store, publish)
    other = JetStreamStore(settings.model_copy(update={"node_name": "other"}))  # another broker's writes
    await engine.start()
    try:
        connection = FakeConnection()
        await engine.attach("lossy", connection)
        await engine.write("lossy", "first", b"1")
        await settle(lambda: connection.sent == [("$ECQ/lossy/first", b"1")])
        with notices_dropped(store):
            other.commit([Append("lossy", "k", b"v", now_ms())])
        assert (await engine.lag.report(10))["pending"] == 1  # only the first, sent and not acked
        check = store._watch.check  # noqa: SLF001 - the periodic shard check, run now rather than in 5 s
        store._call(check(), 5)  # noqa: SLF001 - once: a notice may still be on its way
        store._call(check(), 5)  # noqa: SLF001 - twice: the shard is read again
        await settle(lambda: len(connection.sent) == 2)
        assert connection.sent[1] == ("$ECQ/lossy/k", b"v")
        await settle(lambda: engine.lag.queues["lossy"].pending == 2)
    finally:
        other.close()
        await engine.close()
