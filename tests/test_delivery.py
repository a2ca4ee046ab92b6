"""ecq.queue.delivery.Consumer on a real LevelDB store and writer pool: order, the inflight window, acks
saved, redelivery of only the unacked after a reattach, compaction of a read-ahead message."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from ecq.queue.deadlines import SharedDeadline
from ecq.queue import oversize
from ecq.queue.delivery import Consumer
from ecq.store.leveldb import LevelDbStore
from ecq.queue.readers import BatchedReader
from ecq.store.protocol import Append, AckState, Message, SaveAck
from ecq.queue.clock import now_ms
from ecq.queue.writer import WriterPool
from tests.fake_connection import FakeConnection, publish, settle


class Seen:
    """A delivery observer that notes every send (seqno, attempt) and every PUBACK (seqno)."""

    def __init__(self) -> None:
        self.sends: list[tuple[int, int]] = []
        self.acks: list[int] = []
        self.skips: list[tuple[int, str]] = []
        self.reads = 0  # store reads the consumer made

    def delivered(self, clientid: str, message: Message, attempt: int) -> None:
        self.sends.append((message.seqno, attempt))

    def acked(self, clientid: str, message: Message, sent_monotonic: float) -> None:
        self.acks.append(message.seqno)

    def skipped(self, clientid: str, message: Message, reason: str) -> None:
        self.skips.append((message.seqno, reason))


def tell_appends(consumers: list[Consumer], with_message: bool):
    """A writer pool's on_commit that tells each consumer of its queue's appends, like the engine: with the
    committed message (an embedded store's own commits) or without it (a shared store's watch)."""
    def on_commit(ops, results) -> None:
        for op, result in zip(ops, results):
            for consumer in (c for c in consumers if isinstance(op, Append) and op.clientid == c.clientid):
                message = Message(result.seqno, op.key, op.payload, op.ts_ms) if with_message else None
                consumer.appended(result.seqno, op.key, message)
    return on_commit


@pytest.fixture(params=["read", "from_commit"])
async def parts(tmp_path, request):
    """Store, pool, reader, consumers; every test runs twice: appends told without their message (each is read
    from the store) and with it (a caught-up consumer takes it from the commit)."""
    store = LevelDbStore(tmp_path / "db")
    consumers: list[Consumer] = []
    pool = WriterPool(store, 2, tell_appends(consumers, with_message=request.param == "from_commit"))
    pool.start()
    reader = BatchedReader(threads=2)
    yield store, pool, reader, consumers
    for consumer in consumers:
        consumer.detach()
    await pool.close()
    reader.shutdown()
    store.close()


def make_consumer(parts, window: int = 2, state: AckState | None = None) -> tuple[Consumer, Seen]:
    store, pool, reader, consumers = parts
    seen = Seen()

    def read(func, *args):
        seen.reads += 1
        return reader.read(store.run, func, *args)

    consumer = Consumer("q", state or AckState(), store=store, pool=pool, publish=publish, observer=seen,
                        read=read,
                        read_deadline=SharedDeadline(5.0, "test read"), window=window, retention_s=3600)
    consumers.append(consumer)
    return consumer, seen


async def write(parts, *keys: str) -> None:
    _store, pool, _reader, _consumers = parts
    for key in keys:
        await pool.submit("q", Append("q", key, key.encode(), now_ms()))


async def test_delivers_in_seqno_order_with_at_most_window_in_flight(parts):
    await write(parts, "a", "b", "c", "d", "e")
    consumer, seen = make_consumer(parts, window=2)
    connection = FakeConnection()
    consumer.attach(connection)
    await settle(lambda: len(connection.sent) == 2)
    assert connection.sent == [("$ECQ/q/a", b"a"), ("$ECQ/q/b", b"b")] and len(consumer.inflight) == 2
    while len(seen.acks) < 5:
        connection.ack()
        await settle(lambda: connection.unacked or len(seen.acks) == 5)
        assert connection.unacked <= 2
    assert [payload for _topic, payload in connection.sent] == [b"a", b"b", b"c", b"d", b"e"]
    assert seen.sends == [(n, 1) for n in range(1, 6)] and seen.acks == [1, 2, 3, 4, 5]


async def test_acks_are_saved_and_a_reattach_redelivers_only_the_unacked(parts):
    store = parts[0]
    await write(parts, "a", "b", "c")
    consumer, seen = make_consumer(parts, window=3)
    first = FakeConnection()
    consumer.attach(first)
    await settle(lambda: len(first.sent) == 3)
    first.ack(1)
    await settle(lambda: store.ack_state("q").acked == 1)
    first.drop()
    await settle(lambda: not consumer.online)
    second = FakeConnection()
    consumer.attach(second)
    await settle(lambda: len(second.sent) == 2)
    assert second.sent == [("$ECQ/q/b", b"b"), ("$ECQ/q/c", b"c")]
    assert seen.sends[-2:] == [(2, 2), (3, 2)]  # second attempts
    second.ack()
    await settle(lambda: store.ack_state("q").acked == 3)


async def test_appends_while_attached_are_delivered_and_compaction_drops_a_superseded_value(parts):
    consumer, _seen = make_consumer(parts, window=1)
    connection = FakeConnection()
    consumer.attach(connection)
    await write(parts, "k", "other")
    await settle(lambda: len(connection.sent) == 1)
    await write(parts, "other")  # replaces the first "other" before it was sent
    connection.ack()
    await settle(lambda: len(connection.sent) == 2)
    connection.ack()
    await settle(lambda: consumer.state.acked == 3)
    assert [topic for topic, _payload in connection.sent] == ["$ECQ/q/k", "$ECQ/q/other"]
    assert parts[0].queue_range("q") == (1, 3, 2)


async def test_a_caught_up_consumer_takes_each_append_from_its_commit_without_a_store_read(parts, request):
    consumer, seen = make_consumer(parts, window=4)
    connection = FakeConnection()
    consumer.attach(connection)
    await settle(lambda: seen.reads == 1 and not consumer.behind)  # the attach's read: the queue is empty
    for n in range(20):
        await write(parts, f"k{n}")
        await settle(lambda: len(connection.sent) == n + 1)
        connection.ack()
        await settle(lambda: consumer.state.acked == n + 1)
    assert [payload for _topic, payload in connection.sent] == [f"k{n}".encode() for n in range(20)]
    assert seen.reads == (1 if request.node.callspec.params["parts"] == "from_commit" else 21)


async def test_appends_racing_reads_and_acks_are_each_delivered_once_and_in_order(parts):
    # Bursts larger than the window make the consumer fall behind and read while more appends commit; the
    # entries taken from commits and those read must join without a gap or a repeat.
    rng = random.Random(7)
    consumer, seen = make_consumer(parts, window=3)
    connection = FakeConnection()
    consumer.attach(connection)
    written = 0
    for _round in range(40):
        burst = rng.choice([1, 1, 2, 5, 9])
        await write(parts, *(f"k{written + i}" for i in range(burst)))
        written += burst
        for _ in range(rng.randint(0, 3)):
            connection.ack(rng.randint(1, 3))
            await asyncio.sleep(0)
    while consumer.state.acked < written:
        connection.ack()
        await settle(lambda: connection.unacked or consumer.state.acked == written)
    assert [payload for _topic, payload in connection.sent] == [f"k{n}".encode() for n in range(written)]
    assert seen.sends == [(n, 1) for n in range(1, written + 1)]


class SlowAckSaves(LevelDbStore):
    """LevelDB whose ack-state commits take ``delay_s`` (a slow disk or a remote store), in a writer thread."""

    delay_s = 0.2

    def commits_without_waiting(self) -> bool:
        return False

    def commit(self, ops):
        if any(isinstance(op, SaveAck) for op in ops):
            time.sleep(self.delay_s)
        return super().commit(ops)


async def test_a_window_emptied_by_compaction_reads_on_when_the_acks_came_during_a_slow_save(tmp_path):
    # The window is full (k0..k2 sent), k3..k5 read ahead; rewriting k4 drops it from the read-ahead. When all three
    # PUBACKs arrive while one save is in flight, the pump hands out k3 and k5 and must read on for k4's new value:
    # it once stopped there until the next PUBACK, which never came (found running the broker tests on JetStream).
    store = SlowAckSaves(tmp_path / "db")
    consumers: list[Consumer] = []
    pool = WriterPool(store, 1, tell_appends(consumers, with_message=False))
    pool.start()
    reader = BatchedReader(threads=1)
    parts = (store, pool, reader, consumers)
    try:
        await write(parts, *(f"k{i}" for i in range(6)))
        consumer, _seen = make_consumer(parts, window=3)
        connection = FakeConnection()
        consumer.attach(connection)
        await settle(lambda: len(connection.sent) == 3)
        await write(parts, "k4")
        connection.ack()
        await settle(lambda: len(connection.sent) == 6)
        assert [topic for topic, _payload in connection.sent[3:]] == ["$ECQ/q/k3", "$ECQ/q/k5", "$ECQ/q/k4"]
    finally:
        for consumer in consumers:
            consumer.detach()
        await pool.close()
        reader.shutdown()
        store.close()


async def test_after_stop_sending_the_inflight_acks_count_and_nothing_new_is_sent(parts):
    # An unsubscribe (MQTT 3.1.1 section 3.10.4): a and b in flight complete, c is not sent; the consumer
    # detaches once b's PUBACK came, and the next attach starts at c.
    store = parts[0]
    await write(parts, "a", "b", "c")
    consumer, seen = make_consumer(parts, window=2)
    connection = FakeConnection()
    consumer.attach(connection)
    await settle(lambda: len(connection.sent) == 2)
    consumer.stop_sending()
    connection.ack(1)
    await settle(lambda: store.ack_state("q").acked == 1)
    assert consumer.online and len(connection.sent) == 2
    connection.ack()
    await settle(lambda: store.ack_state("q").acked == 2 and not consumer.online)
    assert len(connection.sent) == 2 and seen.acks == [1, 2]
    consumer.attach(connection)
    await settle(lambda: len(connection.sent) == 3)
    assert connection.sent[2] == ("$ECQ/q/c", b"c")


async def test_a_rewind_after_stop_sending_detaches(parts):
    await write(parts, "a", "b")
    consumer, _seen = make_consumer(parts, window=2)
    connection = FakeConnection()
    consumer.attach(connection)
    await settle(lambda: len(connection.sent) == 2)
    consumer.stop_sending()
    await consumer.rewind(0)
    assert not consumer.online and not consumer.inflight and len(connection.sent) == 2


async def test_a_rewind_while_online_forgets_the_inflight_and_redelivers_from_the_rewind_point(parts):
    store = parts[0]
    await write(parts, "a", "b", "c")
    consumer, seen = make_consumer(parts, window=2)
    connection = FakeConnection()
    consumer.attach(connection)
    await settle(lambda: len(connection.sent) == 2)
    connection.ack(1)
    await settle(lambda: store.ack_state("q").acked == 1 and len(connection.sent) == 3)
    await consumer.rewind(0)  # b and c are in flight: forgotten, not waited for
    assert store.ack_state("q").acked == 0 and not consumer.resends.attempts
    await settle(lambda: len(connection.sent) == 5)
    assert [payload for _topic, payload in connection.sent] == [b"a", b"b", b"c", b"a", b"b"]
    assert connection.unacked == 2 and seen.acks == [1]  # the forgotten sends of b and c are not awaited
    connection.ack()
    await settle(lambda: len(connection.sent) == 6)
    connection.ack()
    await settle(lambda: store.ack_state("q").acked == 3)
    assert [payload for _topic, payload in connection.sent[5:]] == [b"c"]
    assert seen.sends[-3:] == [(1, 1), (2, 1), (3, 1)]  # a rewind starts counting sends afresh


async def test_a_rewind_clears_the_seqnos_acked_out_of_order(parts):
    store = parts[0]
    await write(parts, "a", "b", "c", "d")
    consumer, _seen = make_consumer(parts, window=2, state=AckState(acked=1, above={3}))
    await consumer.rewind(1)
    assert store.ack_state("q").above == set()
    connection = FakeConnection()
    consumer.attach(connection)
    await settle(lambda: len(connection.sent) == 2)
    assert [payload for _topic, payload in connection.sent] == [b"b", b"c"]  # c, acked out of order, comes again


async def test_a_rewind_while_offline_is_saved_and_the_next_attach_resumes_there(parts):
    store = parts[0]
    await write(parts, "a", "b", "c", "d")
    consumer, _seen = make_consumer(parts, window=3)
    await consumer.rewind(2)
    assert store.ack_state("q").acked == 2 and not consumer.online
    connection = FakeConnection()
    consumer.attach(connection)
    await settle(lambda: len(connection.sent) == 2)
    assert [payload for _topic, payload in connection.sent] == [b"c", b"d"]


class FirstAckSaveSlow(LevelDbStore):
    """LevelDB whose first ack-state commit takes ``delay_s`` and the others none, in writer threads: a save
    that overtook the slow one would commit first and be overwritten by it."""

    delay_s = 0.3
    slowed = False

    def commits_without_waiting(self) -> bool:
        return False

    def commit(self, ops):
        if any(isinstance(op, SaveAck) for op in ops) and not self.slowed:
            self.slowed = True
            time.sleep(self.delay_s)
        return super().commit(ops)


async def test_a_late_ack_save_cannot_overwrite_a_rewind(tmp_path):
    store = FirstAckSaveSlow(tmp_path / "db")
    pool = WriterPool(store, 2, lambda ops, results: None)
    pool.start()
    reader = BatchedReader(threads=1)
    parts = (store, pool, reader, [])
    try:
        await write(parts, "a", "b")
        consumer, _seen = make_consumer(parts, window=2)
        connection = FakeConnection()
        consumer.attach(connection)
        await settle(lambda: len(connection.sent) == 2)
        connection.ack(1)
        await settle(lambda: consumer.saves_pending == 1)  # the save of acked=1 is in flight, slowly
        await consumer.rewind(0)
        await settle(lambda: not consumer.saving)
        assert store.ack_state("q").acked == 0
    finally:
        consumer.detach()
        await pool.close()
        reader.shutdown()
        store.close()


class SlowReads(LevelDbStore):
    """LevelDB whose reads of a queue take ``delay_s`` (in the reader threads)."""

    delay_s = 0.3
    reads_begun = 0

    def read_after(self, *args, **kwargs):
        self.reads_begun += 1
        time.sleep(self.delay_s)
        return super().read_after(*args, **kwargs)


async def sent_after_a_slow_read(tmp_path, meanwhile) -> list[bytes]:
    """Write a, b, c, d, attach a consumer (window 2) and run ``meanwhile(consumer)`` (a coroutine function) while its
    first read, of seqnos 1-4, takes SlowReads.delay_s; the payloads of its first two sends."""
    store = SlowReads(tmp_path / "db")
    pool = WriterPool(store, 1, lambda ops, results: None)
    pool.start()
    reader = BatchedReader(threads=1)
    parts = (store, pool, reader, [])
    try:
        await write(parts, "a", "b", "c", "d")
        consumer, _seen = make_consumer(parts, window=2)
        connection = FakeConnection()
        consumer.attach(connection)
        await settle(lambda: store.reads_begun == 1)
        await meanwhile(consumer)
        await settle(lambda: len(connection.sent) == 2)
        return [payload for _topic, payload in connection.sent]
    finally:
        consumer.detach()
        await pool.close()
        reader.shutdown()
        store.close()


async def test_a_read_in_progress_when_a_rewind_comes_does_not_deliver_from_the_old_position(tmp_path):
    async def rewind(consumer: Consumer) -> None:
        await consumer.rewind(2)
    assert await sent_after_a_slow_read(tmp_path, rewind) == [b"c", b"d"]


async def test_entries_deleted_while_a_read_of_them_is_in_flight_are_not_sent(tmp_path):
    """A quota eviction, GC or purge that commits while a read-ahead is in the reader thread: the read may return the
    deleted entries (it began before the delete), and they must not be sent (tests/test_quotas.py saw one under load)."""
    async def evict(consumer: Consumer) -> None:
        consumer.forget({1, 2})  # as QueueEngine.deleted does once the eviction of a and b committed
    assert await sent_after_a_slow_read(tmp_path, evict) == [b"c", b"d"]


async def test_a_skipped_entry_is_dropped_once_too_many_later_entries_were_acked_past_it(parts, monkeypatch):
    """The ack state holds every seqno acked past a skipped entry; past the bound the entry is given up, so an
    ack save stays small (here a bound of 3 instead of 1,024)."""
    monkeypatch.setattr(oversize, "MAX_ACKED_PAST_A_GAP", 3)
    store = parts[0]
    await write(parts, "big", "a", "b", "c", "d", "e")
    consumer, seen = make_consumer(parts, window=2)
    connection = FakeConnection()
    consumer.attach(connection, fits=lambda _topic, message: message.key != "big")
    await settle(lambda: connection.ack() or len(seen.acks) == 5)  # PUBACK each send as it comes
    assert seen.skips == [(1, oversize.SKIPPED_TOO_LARGE), (1, oversize.DROPPED_TOO_LARGE)]
    await settle(lambda: store.ack_state("q").acked == 6)
    assert store.ack_state("q").above == set() and not consumer.skipped
