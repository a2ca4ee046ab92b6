"""Queue quotas and state GC in the LevelDB store itself (issue 13 parts 3 and 4): what one commit does to a
real LevelDB on disk, including a hypothesis model test of eviction across batches and reopens."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from ecq.store.leveldb import LevelDbStore
from ecq.store.protocol import Append, Appended, AckState, Expire, ForgetQueue, QueueQuota, QuotaExceeded, SaveAck

DAY_MS = 86_400_000


def append(key: str, payload: bytes | str = b"v", clientid: str = "q", ts_ms: int = 1000) -> Append:
    return Append(clientid, key, payload.encode() if isinstance(payload, str) else payload, ts_ms)


def stored(store: LevelDbStore, clientid: str = "q") -> list[tuple[int, str, bytes]]:
    return [(m.seqno, m.key, m.payload) for m in store.read_after(clientid, 0, 10_000)]


def test_drop_oldest_evicts_the_lowest_seqnos_in_the_appends_batch(tmp_path):
    store = LevelDbStore(tmp_path / "db", quota=QueueQuota(max_messages=3))
    results = [store.commit([append(f"k{i}")])[0] for i in range(1, 6)]
    assert [r.evicted for r in results[:3]] == [(), (), ()]
    assert [row.seqno for r in results[3:] for row in r.evicted] == [1, 2]
    assert [row.key for row in results[3].evicted] == ["k1"]
    assert stored(store) == [(3, "k3", b"v"), (4, "k4", b"v"), (5, "k5", b"v")]
    assert stored(store, "other") == []


def test_a_rewrite_of_a_stored_key_in_a_full_queue_evicts_nothing(tmp_path):
    store = LevelDbStore(tmp_path / "db", quota=QueueQuota(max_messages=2))
    store.commit([append("a"), append("b")])
    (result,) = store.commit([append("a", "new")])
    assert result.replaced == (1,) and result.evicted == ()
    assert stored(store) == [(2, "b", b"v"), (3, "a", b"new")]


def test_the_byte_quota_evicts_until_the_new_payload_fits(tmp_path):
    store = LevelDbStore(tmp_path / "db", quota=QueueQuota(max_bytes=10))
    store.commit([append("a", b"x" * 4), append("b", b"x" * 4)])
    (result,) = store.commit([append("c", b"x" * 6)])
    assert [row.key for row in result.evicted] == ["a"]
    assert [key for _, key, _ in stored(store)] == ["b", "c"]


def test_one_batch_over_the_quota_evicts_its_own_earlier_appends(tmp_path):
    store = LevelDbStore(tmp_path / "db", quota=QueueQuota(max_messages=2))
    store.commit([append("old")])
    results = store.commit([append("a"), append("b"), append("c"), append("a", "again")])
    assert [[row.seqno for row in r.evicted] for r in results] == [[], [1], [2], [3]]
    assert results[3].replaced == ()  # its older value was already evicted in this batch
    assert stored(store) == [(4, "c", b"v"), (5, "a", b"again")]


def test_refuse_stores_nothing_and_spends_no_seqno_but_takes_rewrites(tmp_path):
    store = LevelDbStore(tmp_path / "db", quota=QueueQuota(max_messages=2, policy="refuse"))
    store.commit([append("a"), append("b")])
    refused, rewrite = store.commit([append("c"), append("a", "new")])
    assert isinstance(refused, QuotaExceeded) and refused.reason == "quota_exceeded"
    assert isinstance(rewrite, Appended) and rewrite.seqno == 3
    assert stored(store) == [(2, "b", b"v"), (3, "a", b"new")]


def test_a_payload_larger_than_the_byte_quota_is_refused_under_either_policy(tmp_path):
    for policy in ("drop_oldest", "refuse"):
        store = LevelDbStore(tmp_path / policy, quota=QueueQuota(max_bytes=8, policy=policy))
        store.commit([append("a", b"1234")])
        (refused,) = store.commit([append("b", b"x" * 9)])
        assert isinstance(refused, QuotaExceeded) and "larger than max_queue_bytes" in str(refused)
        assert stored(store) == [(1, "a", b"1234")]
        store.close()


def test_the_counts_are_read_again_after_a_reopen_and_follow_gc(tmp_path):
    store = LevelDbStore(tmp_path / "db", quota=QueueQuota(max_messages=3))
    store.commit([append("a"), append("b"), append("c")])
    store.close()
    store = LevelDbStore(tmp_path / "db", quota=QueueQuota(max_messages=3))
    (result,) = store.commit([append("d")])
    assert [row.key for row in result.evicted] == ["a"]
    rows, _ = store.expired_step(cutoff_ms=2000, limit=10)
    store.commit([Expire("q", tuple(rows["q"][:2]))])  # GC deletes b and c: room for two more
    results = store.commit([append("e"), append("f")])
    assert [r.evicted for r in results] == [(), ()]
    assert [key for _, key, _ in stored(store)] == ["d", "e", "f"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 6)), min_size=1, max_size=6),
                        min_size=1, max_size=8),
       max_messages=st.integers(0, 4), max_bytes=st.integers(0, 12), reopen_after=st.integers(0, 8))
def test_eviction_agrees_with_a_list_model(tmp_path_factory, batches, max_messages, max_bytes, reopen_after):
    quota = QueueQuota(max_messages, max(max_bytes, 6) if max_bytes else 0)
    path = tmp_path_factory.mktemp("model")
    store = LevelDbStore(path, quota=quota)
    model: list[tuple[int, str, int]] = []  # (seqno, key, size) in seqno order
    seqno = 0
    for number, batch in enumerate(batches):
        if number == reopen_after:
            store.close()
            store = LevelDbStore(path, quota=quota)
        store.commit([append(key, b"x" * size) for key, size in batch])
        for key, size in batch:
            seqno += 1
            model = [row for row in model if row[1] != key] + [(seqno, key, size)]
            while quota.over(len(model), sum(row[2] for row in model)):
                model.pop(0)
    assert [(s, k, len(p)) for s, k, p in stored(store)] == model
    store.close()


def test_forget_deletes_an_empty_idle_queue_and_it_starts_again_at_seqno_1(tmp_path):
    store = LevelDbStore(tmp_path / "db")
    store.commit([append("a", ts_ms=1000), SaveAck("q", AckState(1, 2000))])
    rows, _ = store.expired_step(cutoff_ms=5000, limit=10)
    store.commit([Expire("q", tuple(rows["q"]))])
    assert store.idle_queues(cutoff_ms=DAY_MS) == ["q"]
    assert store.commit([ForgetQueue("q", DAY_MS)]) == [True]
    assert store.last_seqno("q") == 0 and store.ack_state("q") == AckState()
    assert store.idle_queues(cutoff_ms=DAY_MS) == []
    (result,) = store.commit([append("b", ts_ms=DAY_MS + 1)])
    assert result.seqno == 1


def test_forget_keeps_a_queue_with_entries_a_recent_write_or_ack_or_one_touched_in_the_batch(tmp_path):
    store = LevelDbStore(tmp_path / "db")
    store.commit([append("a", clientid="full", ts_ms=1000)])
    store.commit([append("a", clientid="written", ts_ms=3000)])
    store.commit([SaveAck("acked", AckState(0, 3000)), append("a", clientid="acked", ts_ms=1000)])
    rows, _ = store.expired_step(cutoff_ms=10_000, limit=10)
    store.commit([Expire(cid, tuple(rows[cid])) for cid in ("written", "acked")])
    assert store.idle_queues(cutoff_ms=2000) == []
    assert store.commit([ForgetQueue(cid, 2000) for cid in ("full", "written", "acked")]) == [False] * 3
    assert store.idle_queues(cutoff_ms=5000) == ["acked", "written"]
    assert store.commit([SaveAck("acked", AckState(0, 4000)), ForgetQueue("acked", 5000)]) == [None, False]
    forgot, appended = store.commit([ForgetQueue("written", 5000), append("b", clientid="written", ts_ms=6000)])
    assert forgot is True and appended.seqno == 1
    assert store.last_seqno("written") == 1 and store.ack_state("acked").last_ack_ms == 4000
