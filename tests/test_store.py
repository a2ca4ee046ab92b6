"""The LevelDB tables on a real database in a temp dir."""

from __future__ import annotations

import os
import shutil

import pytest

from ecq.store import committed
from ecq.store.committed import CommittedSeqnos, Missing, describe
from ecq.store.protocol import AckState, Append, Appended, Expire, ExpiredRow, ForgetQueue, SaveAck, StoreError
from ecq.store.leveldb import LevelDbStore as Store
from ecq.testing import wait_until


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


# --- ECQ-COMMITTED: the last committed seqnos, which let a start see a lost LevelDB log ------------------

def crash_image(store: Store, path) -> None:
    """Copy the files of the open ``store`` to ``path``: what a kill -9 would leave of it."""
    shutil.copytree(store.path, path)


def claimed(path) -> list[Missing]:
    """What the ECQ-COMMITTED file in ``path`` claims, as missing from an empty store."""
    return CommittedSeqnos(path).missing(lambda _clientid: 0)


def test_a_forgotten_queue_is_withdrawn_before_its_seqno_row_goes(tmp_path, monkeypatch):
    """State GC deletes a queue's seqno row: ECQ-COMMITTED must stop claiming it first, or a crash after the
    forget would look like a lost log at the next start."""
    monkeypatch.setattr(committed, "CHECKPOINT_INTERVAL_S", 0.01)
    store = Store(tmp_path / "db")
    try:
        store.commit([Append("idle", "k", b"v", 1000)])
        store.commit([Expire("idle", (ExpiredRow(1, "k", 1000, 1),))])
        assert wait_until(lambda: claimed(store.path) == [Missing("idle", 0, 1)])
        assert store.commit([ForgetQueue("idle", cutoff_ms=2**62)]) == [True]
        crash_image(store, tmp_path / "crashed")
    finally:
        store.close()
    Store(tmp_path / "crashed").close()  # no "lost writes"


def test_a_clean_close_claims_every_commit_and_the_next_open_starts_over(tmp_path, monkeypatch):
    monkeypatch.setattr(committed, "CHECKPOINT_INTERVAL_S", 3600.0)
    store = Store(tmp_path / "db")
    store.commit([Append("c", f"k{i}", b"v", 1000) for i in range(3)])
    assert claimed(store.path) == []  # no checkpoint yet: a crash now claims nothing
    store.close()
    assert claimed(store.path) == [Missing("c", 0, 3)]
    Store(store.path).close()  # LevelDB moved its log into a table file
    assert claimed(store.path) == []


def test_a_checkpoint_cut_by_a_crash_claims_nothing(tmp_path, caplog):
    path = tmp_path / "db"
    path.mkdir()
    checkpoint = CommittedSeqnos(path)
    checkpoint.start_over()
    checkpoint.note({"a": 5})
    checkpoint.record()
    checkpoint.note({"a": 9, "b": 2})
    checkpoint.record()
    os.truncate(checkpoint.file, checkpoint.file.stat().st_size - 3)
    assert CommittedSeqnos(path).missing(lambda _cid: 0) == [Missing("a", 0, 5)]
    assert "are not a whole checkpoint" in caplog.text


def test_the_checkpoint_file_is_rewritten_once_it_grew(tmp_path, monkeypatch):
    monkeypatch.setattr(committed, "_REWRITE_RECORDS", 10)
    path = tmp_path / "db"
    path.mkdir()
    checkpoint = CommittedSeqnos(path)
    checkpoint.start_over()
    for seqno in range(1, 200):
        checkpoint.note({"a": seqno, "b": seqno * 2})
        checkpoint.record()
    assert checkpoint.file.stat().st_size < 30 * 50  # about 12 rounds of two records at most
    assert CommittedSeqnos(path).missing(lambda _cid: 1) == [Missing("a", 1, 199), Missing("b", 1, 398)]


def test_missing_names_each_queue_and_the_seqnos():
    missing = [Missing("a", 1941, 3000), Missing("b", 6, 7)] + [Missing(f"q{i}", 0, 1) for i in range(5)]
    assert describe(missing) == ("queue 'a' seqnos 1942-3000 (1059), queue 'b' seqno 7, queue 'q0' seqno 1, "
                                 "queue 'q1' seqno 1, queue 'q2' seqno 1, and 2 more queues; "
                                 "1065 seqnos of 7 queues in all")
