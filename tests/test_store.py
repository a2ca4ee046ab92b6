"""The LevelDB tables on a real database in a temp dir (SPEC.md section 1, "Tables")."""

from __future__ import annotations

import pytest

from ecq.store import AckState, Append, Appended, Expire, SaveAck, Store, StoreError


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


def test_expired_rows_stop_at_first_fresh_entry_and_expire_deletes_them(store):
    store.commit([Append("c", f"k{i}", b"v", ts) for i, ts in enumerate([100, 200, 300, 400])])
    rows = store.expired_rows("c", cutoff_ms=300, limit=10)
    assert [(row.seqno, row.size) for row in rows] == [(1, 1), (2, 1)]
    assert store.commit([Expire("c", rows)]) == [2]
    assert [m.seqno for m in store.read_after("c", 0, 10)] == [3, 4]
    assert len(store.expired_rows("c", cutoff_ms=10_000, limit=1)) == 1


def test_stored_totals_follow_appends_compaction_and_expiry(store):
    store.commit([Append("c", "k", b"x" * 10, 1), Append("d", "k", b"y" * 5, 2)])
    assert store.stored_totals() == (2, 15)
    store.commit([Append("c", "k", b"z" * 3, 3)])
    assert store.stored_totals() == (2, 8)
    store.commit([Expire("d", store.expired_rows("d", 10, 10))])
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
