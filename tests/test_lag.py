"""The lag index (ecq.queue.lag) against a real LevelDbStore: after any history of writes, compactions, sends,
acks (in and out of order, of deleted entries too), deletions and rewinds, each queue's pending count, pending
bytes and oldest pending entry equal what the store holds; a fresh scan equals the kept index; and events that
happen while a queue is being read are neither lost nor counted twice."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings as hypothesis_settings, strategies as st

from ecq.config import EcqSettings
from ecq.ops.status import queue_info
from ecq.queue.engine import QueueEngine
from ecq.store.backends import open_store
from ecq.queue.lag import LagIndex, read_queues, scan_lag, top_report
from ecq.queue import lag_scq
from ecq.queue.lag_reads import reader_lags
from ecq.store.leveldb import LevelDbStore
from ecq.store.protocol import (AckState, Append, Appended, Expire, ExpiredRow, ForgetQueue, Message, SaveAck,
                                stored_pages)
from ecq.queue.topics import RewindPoint
from tests.fake_connection import FakeConnection, publish, settle


@dataclass
class FakeConsumer:
    """What the index reads of a consumer: its inflight seqnos; plus the test's model of its ack state."""

    inflight: dict[int, Message] = field(default_factory=dict)
    state: AckState = field(default_factory=AckState)


async def inline_read(func, *args):
    return func(*args)


def stored_messages(store, clientid: str) -> list[Message]:
    return [message for page in stored_pages(store, clientid, 100) for message in page]


def expected_lag(store, clientid: str, state: AckState) -> tuple[int, int, int]:
    """(pending, pending bytes, oldest pending publish ms) as ecq inspect counts them, straight from the store."""
    pending = [m for m in stored_messages(store, clientid) if m.seqno > state.acked and m.seqno not in state.above]
    return len(pending), sum(len(m.payload) for m in pending), min((m.ts_ms for m in pending), default=0)


def indexed(index: LagIndex, clientid: str) -> tuple[int, int, int]:
    lag = index.queues.get(clientid)
    return (lag.pending, lag.bytes, lag.oldest_ms) if lag else (0, 0, 0)


class History:
    """Random operations on a real store, each told to the index as the engine would."""

    def __init__(self, store: LevelDbStore, index: LagIndex, consumers: dict[str, FakeConsumer], seed: int) -> None:
        self.store, self.index, self.consumers = store, index, consumers
        self.rng = random.Random(seed)
        self.clock = 1_000_000

    def write(self, clientid: str) -> None:
        self.clock += self.rng.randint(0, 3)
        op = Append(clientid, f"k{self.rng.randint(0, 6)}", b"x" * self.rng.randint(0, 9), self.clock)
        [result] = self.store.commit([op])
        self.index.appended(op, result)

    def send(self, clientid: str) -> None:
        consumer = self.consumers[clientid]
        state = consumer.state
        unsent = [m for m in stored_messages(self.store, clientid)
                  if m.seqno > state.acked and m.seqno not in state.above and m.seqno not in consumer.inflight]
        for message in unsent[:self.rng.randint(1, 4)]:
            consumer.inflight[message.seqno] = message

    def ack(self, clientid: str) -> None:
        consumer = self.consumers[clientid]
        if consumer.inflight:
            message = consumer.inflight.pop(self.rng.choice(sorted(consumer.inflight)))
            consumer.state.above.add(message.seqno)
            self.index.acked(clientid, message, 0.0)

    def expire(self, clientid: str, reason: str) -> None:
        messages = stored_messages(self.store, clientid)
        chosen = self.rng.sample(messages, k=min(len(messages), self.rng.randint(1, 3)))
        rows = tuple(ExpiredRow(m.seqno, m.key, m.ts_ms, len(m.payload)) for m in chosen)
        [deleted] = self.store.commit([Expire(clientid, rows, reason)])
        self.index.expired(clientid, deleted, reason)

    def rewind(self, clientid: str) -> None:
        consumer = self.consumers[clientid]
        acked = self.rng.randint(0, max(1, self.store.last_seqno(clientid)))
        consumer.inflight.clear()
        consumer.state = AckState(acked, 0, set())
        self.index.rewound(clientid, RewindPoint("seqno", acked), acked)

    async def step(self) -> None:
        clientid = self.rng.choice(sorted(self.consumers))
        action = self.rng.choices(["write", "send", "ack", "expire", "purge", "rewind", "refresh"],
                                  weights=[10, 4, 8, 2, 1, 1, 2])[0]
        if action == "refresh":
            await self.index.refresh()
        elif action in ("expire", "purge"):
            self.expire(clientid, "retention" if action == "expire" else "purge")
        else:
            getattr(self, action)(clientid)


@pytest.mark.parametrize("every", [1, 5, 40])
@pytest.mark.parametrize("seed", [*range(8), 42, 50, 52, 57])
async def test_a_random_history_keeps_every_queue_exact_and_a_scan_finds_the_same(tmp_path, seed, every):
    """After every ``every`` random steps (and a refresh) each queue's lag equals the store's; the seeds include
    histories that once broke it (a rewind past the end, a compaction while a recount was due)."""
    store = LevelDbStore(tmp_path / "db")
    consumers = {f"c{i}": FakeConsumer() for i in range(3)}
    index = LagIndex(store, inline_read, consumers)
    history = History(store, index, consumers, seed)
    try:
        for step in range(1, 401):
            await history.step()
            if step % every == 0:
                await index.refresh()
                for clientid, consumer in consumers.items():
                    assert indexed(index, clientid) == expected_lag(store, clientid, consumer.state), (step, clientid)
        store.commit([SaveAck(cid, consumer.state) for cid, consumer in consumers.items()])
        await index.refresh()
        scanned = scan_lag(store, {})
        assert {cid: lag.as_tuple() for cid, lag in scanned.items()} == \
               {cid: lag.as_tuple() for cid, lag in index.queues.items()}
    finally:
        store.close()


async def test_acks_of_deleted_inflight_entries_are_not_counted_twice(tmp_path):
    store = LevelDbStore(tmp_path / "db")
    consumer = FakeConsumer()
    index = LagIndex(store, inline_read, {"c": consumer})
    try:
        for key in ("a", "b", "c"):
            op = Append("c", key, b"12345", 1000)
            index.appended(op, store.commit([op])[0])
        messages = stored_messages(store, "c")
        consumer.inflight = {m.seqno: m for m in messages}
        op = Append("c", "b", b"1", 1001)  # compacts seqno 2 while it is inflight
        index.appended(op, store.commit([op])[0])
        assert indexed(index, "c") == (3, 11, 1000)
        index.acked("c", consumer.inflight.pop(2), 0.0)  # the PUBACK of the deleted value still comes
        assert indexed(index, "c") == (3, 11, 1000)
        await index.refresh()
        assert index.queues["c"].as_tuple() == (3, 11, 1, 1000)
    finally:
        store.close()


async def test_a_queue_state_gc_forgot_counts_its_new_entries_from_seqno_1(tmp_path):
    engine = QueueEngine(settings(tmp_path), open_store(settings(tmp_path)), publish)
    await engine.start()
    try:
        for _ in range(5):
            await engine.write("f", "k", b"old")  # seqnos 1 to 5, compacted to one entry
        await engine.rewind("f", RewindPoint("latest"))  # acked 5
        await engine.lag.refresh()
        assert indexed(engine.lag, "f") == (0, 0, 0)
        await engine.purge("f")
        engine.consumers.pop("f")
        forgotten = await engine.pool.submit("f", ForgetQueue("f", 2**62))
        assert forgotten is True
        await engine.write("f", "k", b"new")  # seqno 1 of a new life: pending
        assert indexed(engine.lag, "f")[:2] == (1, 3) == inspected(engine, "f")
    finally:
        await engine.close()


def settings(tmp_path) -> EcqSettings:
    return EcqSettings(data_dir=tmp_path / "db", admin_bind=None, events=False, writer_pool_size=2,
                       reader_batch_size=3)


def index_of(engine: QueueEngine) -> dict[str, tuple[int, int, int, int]]:
    return {cid: lag.as_tuple() for cid, lag in engine.lag.queues.items()}


def inspected(engine: QueueEngine, clientid: str) -> tuple[int, int]:
    info = queue_info(engine.store, clientid, engine.consumer_snapshot(clientid))
    return info["pending"], info["pending_bytes"]


async def test_the_engine_keeps_the_index_through_delivery_purge_and_rewind_and_a_restart_finds_it_again(tmp_path):
    engine = QueueEngine(settings(tmp_path), open_store(settings(tmp_path)), publish)
    await engine.start()
    for i in range(12):
        await engine.write("a", f"k{i % 5}", b"x" * (i + 1))
        await engine.write("b", f"k{i}", b"y")
    await engine.lag.refresh()
    assert (engine.lag.queues["a"].pending, engine.lag.queues["a"].bytes) == inspected(engine, "a") == (5, 50)
    connection = FakeConnection()
    await engine.attach("a", connection)
    await settle(lambda: len(connection.sent) == 3)
    connection.ack(2)
    await settle(lambda: engine.consumer_snapshot("a").acked == 9)
    await engine.lag.refresh()
    assert (engine.lag.queues["a"].pending, engine.lag.queues["a"].bytes) == inspected(engine, "a") == (3, 33)
    assert engine.lag.queues["a"].oldest_seqno == 10  # sent, not acked yet
    assert (await engine.purge("b")) == 12
    assert "b" not in engine.lag.queues and inspected(engine, "b") == (0, 0)
    await engine.rewind("a", RewindPoint("earliest"))
    await settle(lambda: len(connection.sent) >= 6)  # delivery restarted from the oldest stored entry
    await engine.lag.refresh()
    assert (engine.lag.queues["a"].pending, engine.lag.queues["a"].bytes) == inspected(engine, "a")
    await settle(lambda: connection.ack() or engine.consumer_snapshot("a").acked == 12)  # acks each window sent
    await engine.lag.refresh()
    await engine.write("a", "new", b"zz")
    before = index_of(engine)
    assert before == {"a": (1, 2, 13, before["a"][3])}
    await engine.close()
    again = QueueEngine(settings(tmp_path), open_store(settings(tmp_path)), publish)
    await again.start()
    try:
        assert index_of(again) == before
    finally:
        await again.close()


@pytest.mark.parametrize("when", ["before the read", "after the read"])
async def test_writes_and_acks_during_a_recount_count_once(tmp_path, when):
    engine = QueueEngine(settings(tmp_path), open_store(settings(tmp_path)), publish)
    await engine.start()
    try:
        for i in range(6):
            await engine.write("q", f"k{i}", b"abc")
        connection = FakeConnection()
        await engine.attach("q", connection)
        await settle(lambda: len(connection.sent) == 3)
        await engine.rewind("q", RewindPoint("seqno", 2))  # due for a recount
        await settle(lambda: len(connection.sent) == 6)  # sends 3, 4, 5 again

        async def racing_read(func, *args):
            if func is read_queues and when == "before the read":
                await traffic()
            found = await engine.read(func, *args)
            if func is read_queues and when == "after the read":
                await traffic()
            return found

        async def traffic():
            await engine.write("q", "late", b"12345")
            connection.ack(1)  # seqno 3
            await settle(lambda: engine.consumer_snapshot("q").acked == 3)

        engine.lag._read = racing_read
        await engine.lag.refresh()
        engine.lag._read = engine.read
        await engine.lag.refresh()
        lag = engine.lag.queues["q"]
        assert (lag.pending, lag.bytes) == inspected(engine, "q") == (4, 14)
        assert lag.oldest_seqno == 4
    finally:
        await engine.close()


async def test_a_deletion_during_a_recount_is_read_again(tmp_path):
    engine = QueueEngine(settings(tmp_path), open_store(settings(tmp_path)), publish)
    await engine.start()
    try:
        for i in range(5):
            await engine.write("q", f"k{i}", b"abc")
        await engine.rewind("q", RewindPoint("seqno", 1))

        async def racing_read(func, *args):
            if func is read_queues:  # told while the recount runs, but committed before it reads: not seen
                await engine.write("q", "k2", b"1")  # compacts seqno 3
            return await engine.read(func, *args)

        engine.lag._read = racing_read
        await engine.lag.refresh()
        engine.lag._read = engine.read
        await engine.lag.refresh()
        assert (engine.lag.queues["q"].pending, engine.lag.queues["q"].bytes) == inspected(engine, "q") == (4, 10)
    finally:
        await engine.close()


def test_top_orders_by_each_key_with_ties_by_clientid(tmp_path):
    store = LevelDbStore(tmp_path / "db")
    try:
        for clientid, count, size, ts in [("few-old", 1, 1, 100), ("many", 5, 1, 300), ("big", 2, 50, 200),
                                          ("many2", 5, 1, 300)]:
            store.commit([Append(clientid, f"k{i}", b"x" * size, ts + i) for i in range(count)])
        queues = scan_lag(store, {})
    finally:
        store.close()
    order = {by: [row["clientid"] for row in top_report(queues, 3, by, 10_000)["queues"]]
             for by in ("pending", "age", "bytes")}
    assert order == {"pending": ["many", "many2", "big"], "age": ["few-old", "big", "many"],
                     "bytes": ["big", "many", "many2"]}
    report = top_report(queues, 1, "age", 10_000)
    assert (report["pending"], report["lagging"], report["oldest_pending_age_s"]) == (13, 4, 9.9)
    assert report["queues"] == [{"clientid": "few-old", "pending": 1, "pending_bytes": 1,
                                 "oldest_pending_age_s": 9.9, "kind": "ecq"}]


SCQ = "$SCQ/fleet"
READERS = [f"$SCQ/fleet/r{i}" for i in range(4)]
scq_steps = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, 5), st.integers(0, 9)),  # key (compaction), payload bytes
    st.tuples(st.just("ack"), st.sampled_from(READERS), st.integers(0, 40)),  # a seqno, maybe deleted or unwritten
    st.tuples(st.just("delete"), st.integers(0, 40), st.integers(0, 1)),
    st.tuples(st.just("rewind"), st.sampled_from(READERS), st.integers(0, 40)),
    st.tuples(st.just("join"), st.sampled_from(READERS), st.integers(0, 40)),  # a position saved elsewhere
    st.tuples(st.just("forget"), st.sampled_from(READERS), st.integers(0, 1))), max_size=60)


@hypothesis_settings(max_examples=200, deadline=None)
@given(steps=scq_steps)
def test_the_readers_of_an_scq_lag_as_a_naive_model_says(steps):
    """Each SCQ reader's pending count, bytes and oldest pending entry (``ecq top --scq``), ``holds`` and
    ``holding`` equal a naive model's (the stored entries minus each reader's acks) after any history of writes
    compacting keys, acks in and out of order (of deleted entries too), deletions, rewinds, readers joining and
    forgotten; seqnos a reader acked before its write was heard of count as acked."""
    index = LagIndex(None, inline_read, {})
    stored: dict[int, tuple[str, int, int]] = {}  # seqno -> (key, payload bytes, publish ms)
    readers: dict[str, tuple[int, set[int]]] = {}  # position id -> (floor, seqnos acked above it)
    seqno = 0
    for action, arg, extra in steps:
        if action == "write":
            seqno += 1
            replaced = tuple(s for s, (key, _size, _ts) in stored.items() if key == f"k{arg}")
            replaced_bytes = sum(stored.pop(s)[1] for s in replaced)
            stored[seqno] = (f"k{arg}", extra, 1000 + seqno)
            op = Append(SCQ, f"k{arg}", b"x" * extra, 1000 + seqno)
            index.appended(op, Appended(seqno, replaced, replaced_bytes))
        elif action == "ack" and arg in readers:
            readers[arg][1].add(extra)
            index.acked(arg, Message(extra, "k", b"", 0), 0.0)
        elif action == "delete" and stored:
            gone = sorted(stored)[arg % len(stored)]
            key, size, ts = stored.pop(gone)
            index.expired(SCQ, (ExpiredRow(gone, key, ts, size),), "purge" if extra else "retention")
        elif action in ("rewind", "join"):
            readers[arg] = (extra, set())
            if action == "rewind":
                index.rewound(arg, RewindPoint("seqno", extra), extra)
            else:
                above = {s for s in range(extra + 1, extra + 6) if s % 2}
                readers[arg] = (extra, set(above))
                index.saved_elsewhere(arg, AckState(extra, 0, above))
        elif action == "forget" and arg in readers:
            del readers[arg]
            index.forgotten(arg)
    model = {}
    for position, (floor, acked) in readers.items():
        pending = sorted(s for s in stored if s > floor and s not in acked)
        for s in stored:
            assert index.holds(position, s) == (s in pending), (position, s)
        if pending:
            model[position] = (len(pending), sum(stored[s][1] for s in pending), 1000 + pending[0])
    for s in stored:
        assert (index.holding(SCQ, s) is not None) == any(s in rows for rows in
                                                         [[t for t in stored if t > f and t not in a]
                                                          for f, a in readers.values()])
    report = asyncio.run(index.report(1000, "pending", "fleet"))
    found = {row["clientid"]: (row["pending"], row["pending_bytes"]) for row in report["queues"]}
    assert found == {position: lag[:2] for position, lag in model.items()}
    lags = reader_lags(index._scqs.values())
    assert {position: (lag.pending, lag.bytes, lag.oldest_ms) for position, lag in lags.items()} == model
    assert index.scq_totals() == (len(readers), sum(lag[0] for lag in model.values()))
    assert index.totals()[0] == sum(lag[0] for lag in model.values())


@pytest.mark.parametrize("when", ["before the read", "after the read"])
async def test_scq_writes_and_deletions_during_the_start_scan_count_once(tmp_path, when):
    """What is heard of an SCQ while the start scan runs is applied on what the scan found, whether the scan saw
    it (counted once) or not (counted)."""
    store = LevelDbStore(tmp_path / "db")
    reader = f"{SCQ}/r"
    try:
        store.commit([Append(SCQ, f"k{i}", b"abc", 1000 + i) for i in range(4)])  # seqnos 1 to 4
        store.commit([SaveAck(reader, AckState(1, 0, {3}))])  # pending: 2 and 4
        index = LagIndex(store, inline_read, {})

        def traffic():
            op = Append(SCQ, "k1", b"12345", 2000)  # compacts seqno 2
            index.appended(op, store.commit([op])[0])
            [deleted] = store.commit([Expire(SCQ, (ExpiredRow(4, "k3", 1003, 3),), "retention")])
            index.expired(SCQ, deleted, "retention")

        async def racing_read(func, *args):
            if when == "before the read":
                traffic()
            found = func(*args)
            if when == "after the read":
                traffic()
            return found

        index._read = racing_read
        await index.rebuild()
        assert (await index.report(10, scq="fleet"))["queues"][0]["pending"] == 1  # seqno 5 only
        assert reader_lags(index._scqs.values())[reader].as_tuple() == (1, 5, 5, 2000) \
            == scan_lag(store, {})[reader].as_tuple()
    finally:
        store.close()


@hypothesis_settings(max_examples=200, deadline=None)
@given(changes=st.lists(st.tuples(st.booleans(), st.integers(1, 30), st.integers(0, 9)), max_size=80),
       slack=st.sampled_from([0, 2, lag_scq.REBUILD_SLACK]))
def test_an_scqs_stored_entries_count_and_find_as_a_dict_does(changes, slack):
    """LiveEntries (the Fenwick trees under an SCQ's readers) against a dict, through appends out of seqno order,
    deletions and the rebuilds that drop deleted slots (made frequent by a small slack)."""
    kept, lag_scq.REBUILD_SLACK = lag_scq.REBUILD_SLACK, slack
    try:
        live, model = lag_scq.LiveEntries(), {}
        for added, seqno, size in changes:
            if added:
                live.add(seqno, size, 1000 + seqno)
                model.setdefault(seqno, size)
            else:
                live.remove(seqno)
                model.pop(seqno, None)
            for floor in range(0, 32, 3):
                above = sorted(s for s in model if s > floor)
                assert live.above(floor) == (len(above), sum(model[s] for s in above))
                assert list(live.after(floor)) == [(s, 1000 + s) for s in above]
        assert list(live.entries()) == [(s, model[s], 1000 + s) for s in sorted(model)] and len(live) == len(model)
    finally:
        lag_scq.REBUILD_SLACK = kept
