"""ecq.store.jetstream.JetStreamStore on the session's real 3-server NATS cluster: the QueueStore contract
(order, compaction, ack states, GC steps, totals) and the subject tokens that carry any clientid or key."""

from __future__ import annotations

import contextlib
import re
import threading

import pytest
from hypothesis import given, settings, strategies as st

from ecq.store.jetstream import JetStreamStore
from ecq.store.jsapi import token, untoken
from ecq.config import EcqSettings
from ecq.store.protocol import AckState, Append, Appended, AppendNotice, Expire, ExpiredRow, SaveAck

SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]+")  # no '.', '*', '>', whitespace: one NATS subject token


@pytest.fixture
def store(jetstream_options):
    opened = JetStreamStore(EcqSettings(admin_bind=None, **jetstream_options))
    yield opened
    opened.close()


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_is_one_subject_token_and_comes_back(text):
    assert SUBJECT_TOKEN.fullmatch(token(text)) and untoken(token(text)) == text


def test_clientids_and_keys_with_subject_characters_stay_apart(store):
    names = ["a", "a.b", "a b", "a*", "a>", "a.>", "ä/ö", "a/b", ""]
    store.commit([Append(cid, key, f"{cid}|{key}".encode(), 1000) for cid in names for key in names])
    for cid in names:
        got = [(m.key, m.payload) for m in store.read_after(cid, 0, 100)]
        assert got == [(key, f"{cid}|{key}".encode()) for key in names]
    assert store.count_queues() == len(names)


def test_append_compacts_older_values_and_seqnos_grow_per_queue(store):
    first = store.commit([Append("c", "k", b"1", 1)])[0]
    results = store.commit([Append("c", "k", b"2", 2), Append("c", "x", b"x", 3), Append("c", "k", b"3", 4)])
    k2, x, k3 = (r.seqno for r in results)
    assert first.seqno < k2 < x < k3
    assert results == [Appended(k2), Appended(x), Appended(k3)]  # what was replaced comes by notice (below)
    assert [(m.seqno, m.key, m.payload) for m in store.read_after("c", 0, 10)] == [(x, "x", b"x"), (k3, "k", b"3")]
    assert store.queue_range("c") == (x, k3, 2) and store.last_seqno("c") == k3
    assert [m.key for m in store.read_after("c", x, 10)] == ["k"]


def test_ack_state_round_trips_with_out_of_order_acks(store):
    assert store.ack_state("c") == AckState()
    store.commit([SaveAck("c", AckState(5, 1234, {7, 9, 3}))])  # 3 <= acked is dropped
    assert store.ack_state("c") == AckState(5, 1234, {7, 9})
    store.commit([SaveAck("c", AckState(9, 1300, set()))])
    assert list(store.ack_states()) == [("c", AckState(9, 1300, set()))]


def test_gc_steps_take_expired_entries_across_shards_and_expire_deletes_them_once(store):
    queues = [f"q{i}" for i in range(6)]  # spread over both shards
    store.commit([Append(cid, f"old{i}", b"v", 100 + i) for cid in queues for i in range(3)])
    store.commit([Append(cid, "fresh", b"v", 10_000) for cid in queues])
    found, cursor, steps = {}, None, 0
    while True:
        step, cursor = store.expired_step(5_000, 4, cursor)
        steps += 1
        for cid, rows in step.items():
            found.setdefault(cid, []).extend(rows)
        if cursor is None:
            break
    assert steps > 2  # bounded steps of at most 4 rows, resumed from the cursor
    assert {cid: [r.key for r in rows] for cid, rows in found.items()} == {cid: ["old0", "old1", "old2"] for cid in queues}
    deleted = store.commit([Expire(cid, tuple(rows)) for cid, rows in found.items()])
    assert sum(map(len, deleted)) == 18
    assert store.commit([Expire("q0", tuple(found["q0"]))]) == [()]  # already gone: not counted twice
    assert all([m.key for m in store.read_after(cid, 0, 10)] == ["fresh"] for cid in queues)
    assert store.stored_totals()[0] == 6


def test_read_skips_entries_older_than_min_ts(store):
    store.commit([Append("c", "old", b"o", 100), Append("c", "new", b"n", 5000)])
    assert [m.key for m in store.read_after("c", 0, 10, min_ts_ms=1000)] == ["new"]


class Listener:
    """A StoreListener that records what it is told (on the store's thread) and lets a test wait for it."""

    def __init__(self) -> None:
        self.appends: list[AppendNotice] = []
        self.deletions: list[tuple[str, tuple[ExpiredRow, ...], str]] = []
        self.acks: list[tuple[str, AckState]] = []
        self.resyncs: list[set[str]] = []
        self._changed = threading.Condition()

    def appended(self, notices):
        self._tell(self.appends.extend, notices)

    def deleted(self, clientid, rows, reason):
        self._tell(self.deletions.append, (clientid, rows, reason))

    def ack_saved(self, clientid, state):
        self._tell(self.acks.append, (clientid, state))

    def resynced(self, clientids):
        self._tell(self.resyncs.append, clientids)

    def _tell(self, record, what) -> None:
        with self._changed:
            record(what)
            self._changed.notify_all()

    def wait(self, condition, timeout: float = 5.0) -> bool:
        with self._changed:
            return self._changed.wait_for(condition, timeout)


@pytest.fixture
def watched(jetstream_options):
    """Two stores on one namespace, as two brokers of a cluster: (store, its listener, other, its listener)."""
    settings = EcqSettings(admin_bind=None, **jetstream_options)
    pairs = []
    for name in ("node-a", "node-b"):
        opened = JetStreamStore(settings.model_copy(update={"node_name": name}))
        listener = Listener()
        opened.watch(listener)
        pairs.append((opened, listener))
    yield pairs[0][0], pairs[0][1], pairs[1][0], pairs[1][1]
    for opened, _listener in pairs:
        opened.close()


def test_every_append_is_told_to_every_store_with_what_it_replaced_and_its_payload(watched):
    store, heard, other, heard_there = watched
    first = store.commit([Append("w.1", "k k", b"v1", 1)])[0].seqno
    second = store.commit([Append("w.1", "k k", b"v22", 2)])[0].seqno
    for listener, own in ((heard, True), (heard_there, False)):
        assert listener.wait(lambda listener=listener: len(listener.appends) == 2)
        assert listener.appends == [
            AppendNotice(Append("w.1", "k k", b"v1", 1), Appended(first), own, True),
            AppendNotice(Append("w.1", "k k", b"v22", 2), Appended(second, (first,), 2), own, True)]


def test_deletions_and_ack_saves_are_told_to_the_other_stores_only(watched):
    store, heard, other, heard_there = watched
    seqno = store.commit([Append("d", "k", b"v", 1)])[0].seqno
    row = ExpiredRow(seqno, "k", 1, 1)
    assert store.commit([Expire("d", (row,), "purge")]) == [(row,)]
    store.commit([SaveAck("d", AckState(seqno, 77, set()))])
    assert heard_there.wait(lambda: heard_there.deletions and heard_there.acks)
    assert heard_there.deletions == [("d", (row,), "purge")]
    assert heard_there.acks == [("d", AckState(seqno, 77, set()))]
    assert not heard.deletions and not heard.acks  # the store that did it tells its own engine by commit


def test_an_append_stored_behind_the_watchers_back_is_found_by_the_next_notice(watched):
    store, heard, _other, _heard_there = watched
    assert store.shard("seen") == store.shard("lost")  # the gap is seen in the shard's sequence
    store.commit([Append("seen", "k", b"v", 1)])
    assert heard.wait(lambda: len(heard.appends) == 1)
    with notices_dropped(store):
        lost = store.commit([Append("lost", "k", b"v", 2)])[0].seqno
    after = store.commit([Append("seen", "k", b"w", 3)])[0].seqno
    assert heard.wait(lambda: heard.resyncs and len(heard.appends) == 2)
    assert heard.resyncs == [{"lost"}]
    assert heard.appends[1].result.seqno == after and not heard.appends[1].in_order  # a consumer must read
    assert store._watch.entries[store.shard("lost")][store._queue_subject("lost", "k")] == (lost, 1)  # noqa: SLF001


def test_a_lost_last_notice_is_found_by_the_shard_check(watched):
    store, heard, _other, _heard_there = watched
    with notices_dropped(store):
        store.commit([Append("quiet", "k", b"v", 1)])
    check = store._watch.check  # noqa: SLF001 - the periodic check, run now rather than in CHECK_INTERVAL_S
    store._call(check(), 5)  # noqa: SLF001 - once: a notice may still be on its way
    assert not heard.resyncs
    store._call(check(), 5)  # noqa: SLF001
    assert heard.wait(lambda: heard.resyncs) and heard.resyncs == [{"quiet"}]


@contextlib.contextmanager
def notices_dropped(store):
    """Unsubscribe the store's append notices for the block, as a reconnect or a slow consumer would lose them."""
    watch = store._watch  # noqa: SLF001
    store._call(watch._subs[0].unsubscribe(), 5)  # noqa: SLF001
    try:
        yield
    finally:
        store._call(_resubscribe(store), 5)  # noqa: SLF001


async def _resubscribe(store):
    watch = store._watch  # noqa: SLF001
    watch._subs[0] = await store._link.nc.subscribe(f"{store._ns}.appended.>", cb=watch._appended)  # noqa: SLF001
