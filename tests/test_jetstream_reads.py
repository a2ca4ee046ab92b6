"""Reads of the JetStream store on the session's real 3-server NATS cluster: what a read costs in NATS requests
(counted on the store's own connection, every request passing through to the servers), and delivery order
with nothing skipped while appends race the consumer's reads, over MQTT on one node and across two."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest

from ecq.config import JETSTREAM_WINDOW, LEVELDB_WINDOW, EcqSettings
from ecq.queue.clock import now_ms
from ecq.queue.deadlines import SharedDeadline
from ecq.queue.delivery import Consumer
from ecq.queue.writer import WriterPool
from ecq.store.jetstream import JetStreamStore
from ecq.store.protocol import AckState, Append, AppendNotice, Message
from tests.fake_connection import FakeConnection, publish, settle
from tests.harness import BrokerProcess

READS = 60
DIRECT, LEADER = "$JS.API.DIRECT.GET.", "$JS.API.STREAM.MSG.GET."


def count_requests(store: JetStreamStore) -> Counter:
    """A Counter of the queue reads ``store`` sends from now on by kind (``direct``: direct gets, ``leader``:
    STREAM.MSG.GET of a queue stream), counted as they leave its NATS client (nats-py's publish, which its
    request calls too, called through). The writes' lookups of a key's last value are not reads: not counted."""
    counts: Counter = Counter()
    client = store._link.nc

    def counting(publish):
        async def counted(subject, payload=b"", *args, **kwargs):
            a_write_lookup = b"last_by_subj" in payload and b".>" not in payload
            if subject.startswith(DIRECT) and not a_write_lookup:
                counts["direct"] += 1
            elif subject.startswith(LEADER) and "_ACKS" not in subject and not a_write_lookup:
                counts["leader"] += 1
            return await publish(subject, payload, *args, **kwargs)
        return counted

    client.publish = counting(client.publish)
    return counts


def server_url(nats_cluster, store: JetStreamStore, clientid: str, leader: bool) -> str:
    """The client URL of the NATS server leading the stream of ``clientid`` (``leader``), or of a follower.
    Direct gets are answered by the replica on the server a client is connected to."""
    info = store._call(store._link.nc.jetstream().stream_info(store.stream(store.shard(clientid))), 10.0)
    return next(server.url for server in nats_cluster.servers if (server.name == info.cluster.leader) == leader)


def open_store(jetstream_options: dict, **options) -> JetStreamStore:
    return JetStreamStore(EcqSettings(admin_bind=None, **{**jetstream_options, **options}))


def test_a_caught_up_reader_on_a_follower_costs_one_direct_get_per_read_and_no_retry(nats_cluster,
                                                                                      jetstream_options):
    """The realtime case: an entry is read right after the writer's ack told its seqno (an append notice), by a
    node connected to a follower of the stream, which may not hold it yet. Each read is one direct get; only
    the entries the follower lacked are asked of the leader, one request each; never a direct get again."""
    writer = open_store(jetstream_options)
    try:
        reader = open_store(jetstream_options, nats_servers=[server_url(nats_cluster, writer, "rt", leader=False)])
        try:
            counts, cursor = count_requests(reader), 0
            for i in range(READS):
                [appended] = writer.commit([Append("rt", f"k{i}", f"v{i}".encode(), 1000 + i)])
                before = counts.copy()
                got = reader.read_after("rt", cursor, 10, 0, appended.seqno)
                assert [(m.seqno, m.payload) for m in got] == [(appended.seqno, f"v{i}".encode())]
                assert counts["direct"] - before["direct"] == 1
                assert counts["leader"] - before["leader"] <= 1
                cursor = appended.seqno
            assert counts["direct"] == READS and counts["leader"] <= READS
        finally:
            reader.close()
    finally:
        writer.close()


def test_draining_a_stored_queue_costs_one_direct_get_per_read_and_one_leader_check_at_its_end(nats_cluster,
                                                                                                jetstream_options):
    """A stored queue read window by window without knowing its end (after an attach), by a node whose replica
    holds it all (connected to the stream leader's server): one direct get per window, and the stream leader
    is asked once, when an answer comes back short."""
    writer = open_store(jetstream_options)
    try:
        seqnos = [r.seqno for r in writer.commit([Append("d", f"k{i}", b"v", 1000) for i in range(95)])]
        reader = open_store(jetstream_options, nats_servers=[server_url(nats_cluster, writer, "d", leader=True)])
        try:
            counts, cursor, read = count_requests(reader), 0, []
            while page := reader.read_after("d", cursor, 10):
                read += [m.seqno for m in page]
                cursor = page[-1].seqno
                if len(page) < 10:
                    break
            assert read == seqnos
            assert counts == Counter(direct=10, leader=1)
        finally:
            reader.close()
    finally:
        writer.close()


def test_a_read_goes_on_past_expired_entries_so_a_short_answer_means_the_end(jetstream_options):
    """Expired entries not yet collected are skipped without making the answer short: a consumer takes a short
    answer for the end of its queue (as on LevelDB, whose read skips them within its scan)."""
    store = open_store(jetstream_options)
    try:
        store.commit([Append("e", key, b"v", ts) for key, ts in (("old1", 100), ("old2", 100), ("old3", 100),
                                                                 ("new1", 5000), ("new2", 5000))])
        assert [m.key for m in store.read_after("e", 0, 2, min_ts_ms=1000)] == ["new1", "new2"]
        assert [m.key for m in store.read_after("e", 0, 10, min_ts_ms=1000)] == ["new1", "new2"]
    finally:
        store.close()


def test_the_default_window_is_wider_on_jetstream_and_a_configured_one_is_kept(jetstream_options):
    """An ack is stored before the next delivery, on JetStream a quorum round trip: the default window there is
    JETSTREAM_WINDOW (one queue delivers about a window per save); LevelDB keeps LEVELDB_WINDOW."""
    assert EcqSettings(**jetstream_options).reader_batch_size == JETSTREAM_WINDOW == 16
    assert EcqSettings(**jetstream_options, reader_batch_size=3).reader_batch_size == 3
    assert EcqSettings().reader_batch_size == LEVELDB_WINDOW == 5


class Observer:
    def delivered(self, clientid: str, message: Message, attempt: int) -> None:
        pass

    def acked(self, clientid: str, message: Message, sent_monotonic: float) -> None:
        pass


STORED = 12               # entries stored before the consumer attaches: two and a half windows
REALTIME_WRITES = 100
WRITE_PAUSE_S = 0.002
ACK_PAUSE_S = 0.005       # the consumer PUBACKs what it got (but the newest) every ACK_PAUSE_S


class TellConsumer:
    """A StoreListener that tells ``consumer`` of each append by seqno and key only (no message: the test counts
    the reads that need), on ``loop``, as the engine hands notices over to its loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, consumer: Consumer) -> None:
        self._loop, self._consumer = loop, consumer

    def appended(self, notices: list[AppendNotice]) -> None:
        for notice in notices:
            self._loop.call_soon_threadsafe(self._consumer.appended, notice.result.seqno, notice.op.key)

    def deleted(self, clientid: str, rows: tuple, reason: str) -> None:
        """Not used here."""

    def ack_saved(self, clientid: str, state: AckState) -> None:
        """Not used here."""

    def resynced(self, clientids: set[str]) -> None:
        """Not used here."""


async def test_a_consumer_whose_acks_overlap_its_reads_reads_appends_without_asking_the_leader(nats_cluster,
                                                                                              jetstream_options):
    """A consumer on a real JetStream store and writer pool, told of appends by the store's notices (as the
    engine does), while a producer appends every WRITE_PAUSE_S and a PUBACK comes during each of its reads:
    the attach's reads ask the leader where the queue ends once; from then on the appends' notices
    say where it ends and no read asks the leader (with the end still unknown, every short read would). The
    store is connected to the stream leader's server, whose replica is never behind."""
    locator = open_store(jetstream_options)
    try:
        store = open_store(jetstream_options, nats_servers=[server_url(nats_cluster, locator, "rt", leader=True)])
    finally:
        locator.close()
    loop = asyncio.get_running_loop()
    pool = WriterPool(store, 2, lambda _ops, _results: None)
    pool.start()
    connection = FakeConnection()

    def read_while_a_puback_comes(func, *args):
        connection.ack(1)
        return store.read_async(func, *args)

    consumer = Consumer("rt", AckState(), store=store, pool=pool, publish=publish, observer=Observer(),
                        read=read_while_a_puback_comes, read_deadline=SharedDeadline(5.0, "test read"), window=5,
                        retention_s=3600)
    store.watch(TellConsumer(loop, consumer))

    async def ack_all_but_the_newest() -> None:  # so that a PUBACK is due whenever a read starts
        while True:
            connection.ack(max(0, connection.unacked - 1))
            await asyncio.sleep(ACK_PAUSE_S)

    async def append(i: int) -> None:
        await pool.submit("rt", Append("rt", f"k{i:03d}", b"v", now_ms()))

    acker = asyncio.create_task(ack_all_but_the_newest())
    try:
        for i in range(STORED):
            await append(i)
        consumer.attach(connection)  # its first reads do not know where the queue ends: the leader tells
        await settle(lambda: len(connection.sent) == STORED)
        counts = count_requests(store)
        appends = []
        for i in range(STORED, REALTIME_WRITES):
            appends.append(asyncio.create_task(append(i)))
            await asyncio.sleep(WRITE_PAUSE_S)
        await asyncio.gather(*appends)
        await settle(lambda: len(connection.sent) == REALTIME_WRITES, timeout_s=20)
        assert [topic for topic, _ in connection.sent] == [f"$ECQ/rt/k{i:03d}" for i in range(REALTIME_WRITES)]
        assert counts["leader"] <= 1, f"{counts} for {REALTIME_WRITES - STORED} appends"
        assert counts["direct"] <= REALTIME_WRITES - STORED
    finally:
        acker.cancel()
        consumer.detach()
        await pool.close()
        store.close()


async def test_a_poll_during_a_read_makes_the_consumer_read_again_to_the_end(jetstream_options):
    """A heartbeat poll says appends may have been stored without a notice (lost on the network). A read that
    was already in flight, begun before such an append, comes back short: the consumer must not take it for
    the end of its queue, but read again and deliver the entry no notice told."""
    store = open_store(jetstream_options)
    pool = WriterPool(store, 2, lambda _ops, _results: None)
    pool.start()
    connection, held = FakeConnection(), asyncio.Event()
    held.set()

    async def read_then_wait(func, *args):
        result = await store.read_async(func, *args)
        await held.wait()  # the read's answer is in, the consumer does not have it yet
        return result

    consumer = Consumer("p", AckState(), store=store, pool=pool, publish=publish, observer=Observer(),
                        read=lambda func, *args: asyncio.ensure_future(read_then_wait(func, *args)),
                        read_deadline=SharedDeadline(5.0, "test read"), window=5, retention_s=3600)

    async def append(key: str) -> int:
        return (await pool.submit("p", Append("p", key, b"v", now_ms()))).seqno

    try:
        await append("a")
        consumer.attach(connection)
        await settle(lambda: len(connection.sent) == 1)
        connection.ack()
        held.clear()
        consumer.appended(await append("b"), "b")
        await asyncio.sleep(0.2)  # the read of b is answered and held
        await append("c")  # its notice is lost
        consumer.poll()
        held.set()
        await settle(lambda: len(connection.sent) == 3, timeout_s=3)
        assert [topic for topic, _ in connection.sent] == ["$ECQ/p/a", "$ECQ/p/b", "$ECQ/p/c"]
    finally:
        consumer.detach()
        await pool.close()
        store.close()


# --- order and no skip, over MQTT ---------------------------------------------------------------------------

ENTRIES = 400


@pytest.mark.parametrize("nodes", [1, 2])
def test_appends_racing_the_consumer_are_delivered_in_order_and_none_is_skipped(cluster_nodes, connect, nodes):
    """One producer pipelines ENTRIES writes (distinct keys) to a queue whose consumer is online, on the same
    node or on the other: the consumer gets every entry once, in write order, while its reads race the appends."""
    started = [node.start() for node in cluster_nodes(nodes)]
    producer_node: BrokerProcess = started[0]
    consumer_node: BrokerProcess = started[-1]
    consumer = connect(consumer_node.port, "race")
    assert consumer.subscribe("$ECQ/race/#") == 1
    producer = connect(producer_node.port, "producer")
    writes = [(f"$ECQ/w/race/k{i:04d}", f"v{i}".encode()) for i in range(ENTRIES)]
    sending = threading.Thread(target=lambda: producer.publish_many(writes[:ENTRIES // 2]))
    sending.start()
    first = consumer.expect(10, timeout=20)  # the consumer is reading while the rest arrives
    sending.join(30)
    producer.publish_many(writes[ENTRIES // 2:])
    rest = consumer.expect(ENTRIES - 10, timeout=60)
    got = [m.topic.rsplit("/", 1)[1] for m in first + rest]
    assert got == [f"k{i:04d}" for i in range(ENTRIES)]
    assert consumer.quiet(1.0) == []
