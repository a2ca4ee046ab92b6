"""The LevelDB tables on a real database in a temp dir."""

from __future__ import annotations

import pytest

from ecq.queue.store import AckState, Append, Appended, Expire, SaveAck, StoreError
from ecq.queue.leveldb import LevelDbStore as Store


@pytest.fixture
def store(tmp_path):
    db = Store(tmp_path / "db")
    yield db
    db.close()


def test_clientids_that_share_a_prefix_never_see_each_others_rows(store):
    for cid in ("a", "a/b", "ab", "a\x01"):
        store.commit([Append(cid, "k", cid.encode(), 1000)])
    for cid in ("a", "a/b", "ab", "a\x01"):
        assert [(m.seqno, m.payload) for m in store.read_after(cid, 0, 10)] == [(1, cid.encode())]
    assert sorted(store.clientids()) == sorted(["a", "a/b", "ab", "a\x01"])


def test_seqnos_sort_numerically_past_one_byte(store):
    store.commit([Append("c", f"k{i}", b"v", 1000 + i) for i in range(300)])
    seqnos = [m.seqno for m in store.read_after("c", 250, 100)]
    assert seqnos == list(range(251, 301))


def test_append_compacts_older_values_in_db_and_in_the_same_batch(store):
    assert store.commit([Append("c", "k", b"1", 1)]) == [Appended(1)]
    results = store.commit([Append("c", "k", b"2", 2), Append("c", "x", b"x", 3), Append("c", "k", b"3", 4)])
    assert results == [Appended(2, (1,), 1), Appended(3), Appended(4, (2,), 1)]
    assert [(m.seqno, m.key, m.payload) for m in store.read_after("c", 0, 10)] == [(3, "x", b"x"), (4, "k", b"3")]
    assert store.queue_range("c") == (3, 4, 2)


def test_seqnos_only_grow_across_reopen(tmp_path):
    db = Store(tmp_path / "db")
    db.commit([Append("c", "k", b"1", 1), Append("c", "k", b"2", 2)])
    db.close()
    db = Store(tmp_path / "db")
    try:
        assert db.commit([Append("c", "k", b"3", 3)]) == [Appended(3, (2,), 1)]
        assert db.last_seqno("c") == 3
    finally:
        db.close()


def test_ack_state_round_trips_with_out_of_order_acks(store):
    assert store.ack_state("c") == AckState(0, 0, set())
    store.commit([SaveAck("c", AckState(5, 1234, {7, 9, 3}))])  # 3 <= acked is dropped
    assert store.ack_state("c") == AckState(5, 1234, {7, 9})


def test_gc_step_takes_expired_entries_across_queues_and_skips_fresh_tails(store):
    store.commit([Append("a", f"k{i}", b"v", ts) for i, ts in enumerate([100, 200, 300, 400])])
    store.commit([Append("b", "k", b"vv", 150), Append("ab", "k", b"v", 900)])
    found, start = store.expired_step(cutoff_ms=300, limit=10)
    assert start is None
    assert {cid: [(r.seqno, r.size) for r in rows] for cid, rows in found.items()} == {
        "a": [(1, 1), (2, 1)], "b": [(1, 2)]}
    store.commit([Expire(cid, tuple(rows)) for cid, rows in found.items()])
    assert [m.seqno for m in store.read_after("a", 0, 10)] == [3, 4]
    assert store.queue_range("b") is None


def test_gc_steps_are_bounded_and_resume_where_they_stopped(store):
    store.commit([Append(f"c{n}", f"k{i}", b"v", 100) for n in range(3) for i in range(4)])
    seen, start, steps = [], None, 0
    while True:
        found, start = store.expired_step(cutoff_ms=200, limit=5, start=start)
        assert sum(len(rows) for rows in found.values()) <= 5
        seen += [(cid, r.seqno) for cid, rows in found.items() for r in rows]
        steps += 1
        if start is None:
            break
    assert sorted(seen) == [(f"c{n}", s) for n in range(3) for s in range(1, 5)]
    assert steps == 3


def test_stored_totals_follow_appends_compaction_and_expiry(store):
    store.commit([Append("c", "k", b"x" * 10, 1), Append("d", "k", b"y" * 5, 2)])
    assert store.stored_totals() == (2, 15)
    store.commit([Append("c", "k", b"z" * 3, 3)])
    assert store.stored_totals() == (2, 8)
    found, _ = store.expired_step(cutoff_ms=10, limit=10)
    store.commit([Expire("d", tuple(found["d"]))])
    assert store.stored_totals() == (1, 3)


def test_read_skips_entries_older_than_min_ts(store):
    store.commit([Append("c", "old", b"o", 100), Append("c", "new", b"n", 900)])
    assert [m.key for m in store.read_after("c", 0, 10, min_ts_ms=500)] == ["new"]


def test_second_open_of_a_locked_store_gives_a_clear_error(store):
    with pytest.raises(StoreError, match="another broker"):
        Store(store.path)


def test_corrupt_store_gives_a_clear_error(tmp_path):
    path = tmp_path / "db"
    Store(path).close()
    (path / "CURRENT").write_text("garbage\n")
    with pytest.raises(StoreError):
        Store(path)


def test_commits_wait_on_disk_only_with_fsync_or_a_crowded_level0(tmp_path):
    plain = Store(tmp_path / "plain")
    assert plain.commits_without_waiting()  # fresh: level 0 empty, no fsync
    plain.close()
    synced = Store(tmp_path / "synced", sync=True)
    assert not synced.commits_without_waiting()
    synced.close()
