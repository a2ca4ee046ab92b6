"""ecq.store.jetstream.JetStreamStore on the session's real 3-server NATS cluster: the QueueStore contract
(order, compaction, ack states, GC steps, totals) and the subject tokens that carry any clientid or key."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings, strategies as st

from ecq.store.jetstream import JetStreamStore
from ecq.store.jsapi import token, untoken
from ecq.config import EcqSettings
from ecq.store.protocol import AckState, Append, Appended, Expire, SaveAck

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
    assert results == [Appended(k2, (first.seqno,), 1), Appended(x), Appended(k3, (k2,), 1)]
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


def test_appends_are_told_to_the_watcher_with_clientid_seqno_and_key(store):
    import threading
    told, arrived = [], threading.Event()
    store.watch(lambda cid, seqno, key: (told.append((cid, seqno, key)), arrived.set()), lambda: None)
    seqno = store.commit([Append("w.1", "k k", b"v", 1)])[0].seqno
    assert arrived.wait(5) and told == [("w.1", seqno, "k k")]
