"""ecq.queue.engine.QueueEngine without any MQTT broker: a temp LevelDB, a fake connection, and the
engine's public calls (write, attach, detach, run_gc, snapshot, health)."""

from __future__ import annotations

import dataclasses

import pytest

import ecq.queue.rewind
from ecq.config import EcqSettings
from ecq.queue.clock import now_ms
from ecq.queue.engine import QueueEngine
from ecq.store.backends import open_store
from ecq.store.leveldb import LevelDbStore
from ecq.queue.snapshots import ConsumerSnapshot, Totals
from ecq.store.protocol import Append, Appended
from ecq.queue.topics import RewindPoint
from ecq.queue.writer import PoolClosed
from tests.fake_connection import FakeConnection, publish, settle

HOUR_MS = 3_600_000


class Noted:
    """A QueueObserver that notes what it is told."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def appended(self, op, result):
        self.events.append(("appended", op.clientid, op.key, result.seqno, result.replaced))

    def expired(self, clientid, rows, reason="retention"):
        self.events.append(("expired", clientid, tuple(row.seqno for row in rows)))

    def forgotten(self, clientid):
        self.events.append(("forgotten", clientid))

    def delivered(self, clientid, message, attempt):
        self.events.append(("delivered", clientid, message.seqno, attempt))

    def acked(self, clientid, message, sent_monotonic):
        self.events.append(("acked", clientid, message.seqno))

    def store_error(self, op, exc):
        self.events.append(("store_error", op))

    def gc_started(self):
        self.events.append(("gc_started",))

    def rewound(self, clientid, point, acked):
        self.events.append(("rewound", clientid, str(point), acked))


def settings(tmp_path) -> EcqSettings:
    return EcqSettings(data_dir=tmp_path / "db", admin_bind=None, events=False, writer_pool_size=2,
                       reader_batch_size=3, data_retention=HOUR_MS / 1000)


async def started_engine(tmp_path) -> tuple[QueueEngine, Noted]:
    """A started engine over ``tmp_path``'s store with a Noted observer (close it after use)."""
    queue_engine = QueueEngine(settings(tmp_path), open_store(settings(tmp_path)), publish)
    noted = Noted()
    queue_engine.observers.append(noted)
    await queue_engine.start()
    return queue_engine, noted


@pytest.fixture
async def engine(tmp_path):
    queue_engine, noted = await started_engine(tmp_path)
    yield queue_engine, noted
    await queue_engine.close()


async def test_write_deliver_ack_and_snapshot(engine):
    engine, noted = engine
    assert await engine.write("c1", "k", b"one") == Appended(1)
    assert await engine.write("c1", "k", b"two") == Appended(2, (1,), 3)
    connection = FakeConnection()
    await engine.attach("c1", connection)
    await settle(lambda: connection.sent)
    assert connection.sent == [("$ECQ/c1/k", b"two")]
    snapshot = engine.snapshot()
    assert snapshot.totals == Totals(queues=1, stored_entries=1, stored_bytes=3, inflight=1, online=1)
    assert snapshot.consumers["c1"] == ConsumerSnapshot("c1", 0, 0, frozenset(), 1, True)
    connection.ack()
    await settle(lambda: engine.snapshot().consumers["c1"].acked == 2)
    consumer = engine.snapshot().consumers["c1"]
    assert consumer.inflight == 0 and consumer.last_ack_ms > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        consumer.acked = 0
    assert noted.events == [("appended", "c1", "k", 1, ()), ("appended", "c1", "k", 2, (1,)),
                            ("delivered", "c1", 2, 1), ("acked", "c1", 2)]
    assert engine.health() == {"status": "ok"}


async def test_a_reattach_redelivers_only_what_was_not_acked(engine):
    engine, _noted = engine
    for key in ("a", "b", "c"):
        await engine.write("c2", key, key.encode())
    first = FakeConnection()
    await engine.attach("c2", first)
    await settle(lambda: len(first.sent) == 3)
    first.ack(2)
    await settle(lambda: engine.snapshot().consumers["c2"].acked == 2)
    engine.detach("c2")
    assert not engine.snapshot().consumers["c2"].online and engine.connection_of("c2") is None
    second = FakeConnection()
    await engine.attach("c2", second)
    await settle(lambda: second.sent)
    assert second.sent == [("$ECQ/c2/c", b"c")]
    await engine.write("c2", "d", b"d")
    await settle(lambda: len(second.sent) == 2)
    assert second.sent[1] == ("$ECQ/c2/d", b"d")


async def test_attach_is_skipped_when_the_connection_is_no_longer_current(engine):
    engine, _noted = engine
    await engine.write("c3", "k", b"v")
    await engine.attach("c3", FakeConnection(), still_current=lambda: False)
    assert engine.connection_of("c3") is None


async def test_gc_deletes_entries_older_than_retention_and_tells_observers(tmp_path):
    store = LevelDbStore(settings(tmp_path).queues_dir())
    old = now_ms() - 2 * HOUR_MS
    store.commit([Append("old", f"k{i}", b"xx", old + i) for i in range(5)] + [Append("new", "k", b"fresh", now_ms())])
    store.close()
    engine, noted = await started_engine(tmp_path)
    try:
        assert engine.totals().stored_entries == 6
        assert await engine.run_gc() == 5
        assert ("gc_started",) in noted.events and ("expired", "old", (1, 2, 3, 4, 5)) in noted.events
        assert engine.totals() == Totals(queues=2, stored_entries=1, stored_bytes=5, inflight=0, online=0)
        assert await engine.read(engine.store.queue_range, "old") is None
    finally:
        await engine.close()


async def test_a_closed_engine_refuses_writes(tmp_path):
    engine = QueueEngine(settings(tmp_path), open_store(settings(tmp_path)), publish)
    await engine.start()
    await engine.close()
    with pytest.raises(PoolClosed):
        engine.write("c", "k", b"v")


async def test_each_rewind_point_on_a_queue_with_a_gap_is_stored_and_tells_observers(tmp_path, monkeypatch):
    monkeypatch.setattr(ecq.queue.rewind, "PAGE", 1)  # since: reads page after page
    store = LevelDbStore(settings(tmp_path).queues_dir())
    t = now_ms() - 10_000
    store.commit([Append("r", "a", b"a1", t), Append("r", "b", b"b", t + 1000), Append("r", "a", b"a2", t + 2000),
                  Append("r", "c", b"c", t + 3000)])  # a1 (seqno 1) compacted away: stored 2 (b), 3 (a2), 4 (c)
    store.close()
    engine, noted = await started_engine(tmp_path)
    try:
        for point, acked in [(RewindPoint("latest"), 4), (RewindPoint("earliest"), 1), (RewindPoint("seqno", 3), 3),
                             (RewindPoint("since", t), 1), (RewindPoint("since", t + 2000), 2),
                             (RewindPoint("since", t + 3001), 4), (RewindPoint("since", t + 1500), 2)]:
            assert await engine.rewind("r", point) == acked, point
            assert (await engine.read(engine.store.ack_state, "r")).acked == acked
        assert ("rewound", "r", f"since:{t + 1500}", 2) == noted.events[-1]
        connection = FakeConnection()
        await engine.attach("r", connection)
        await settle(lambda: len(connection.sent) == 2)
        assert connection.sent == [("$ECQ/r/a", b"a2"), ("$ECQ/r/c", b"c")]
        assert await engine.rewind("empty", RewindPoint("earliest")) == 0
        assert await engine.rewind("empty", RewindPoint("since", t)) == 0
    finally:
        await engine.close()


async def test_a_rewind_of_an_online_consumer_restarts_its_delivery_at_once(engine):
    engine, _noted = engine
    for key in ("a", "b"):
        await engine.write("on", key, key.encode())
    connection = FakeConnection()
    await engine.attach("on", connection)
    await settle(lambda: len(connection.sent) == 2)
    connection.ack()
    await settle(lambda: engine.snapshot().consumers["on"].acked == 2)
    assert await engine.rewind("on", RewindPoint("earliest")) == 0
    await settle(lambda: len(connection.sent) == 4)
    assert connection.sent[2:] == [("$ECQ/on/a", b"a"), ("$ECQ/on/b", b"b")]


class CountedReads(LevelDbStore):
    """LevelDB that counts the queue reads delivery makes (``read_after``)."""

    reads = 0

    def read_after(self, *args, **kwargs):
        CountedReads.reads += 1
        return super().read_after(*args, **kwargs)


async def test_an_online_consumer_gets_this_brokers_writes_without_a_store_read(tmp_path):
    engine = QueueEngine(settings(tmp_path), CountedReads(tmp_path / "db"), publish)
    await engine.start()
    try:
        connection = FakeConnection()
        await engine.attach("c1", connection)
        await settle(lambda: CountedReads.reads == 1 and not engine.consumers["c1"].behind)  # the attach's read
        for n in range(10):
            await engine.write("c1", f"k{n}", b"v")
            await settle(lambda: len(connection.sent) == n + 1)
            connection.ack()
        assert [topic for topic, _payload in connection.sent] == [f"$ECQ/c1/k{n}" for n in range(10)]
        assert CountedReads.reads == 1
    finally:
        await engine.close()
