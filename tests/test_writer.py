"""ecq.queue.writer.WriterPool: group commit, order per clientid, close commits what is queued, a failing
commit fails its futures (on a real LevelDB store)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ecq.store.leveldb import LevelDbStore
from ecq.store.protocol import Append, Appended, Expire, ExpiredRow, StoreError
from ecq.queue.writer import PoolClosed, WriterPool


class CountingStore(LevelDbStore):
    """The LevelDB store, noting the size of each committed batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []
        self.threads: list[str] = []  # the thread of each commit

    def commit(self, ops):
        self.batches.append(len(ops))
        self.threads.append(threading.current_thread().name)
        return super().commit(ops)


@pytest.fixture
def store(tmp_path):
    s = CountingStore(tmp_path / "db")
    yield s
    s.close()


def append(clientid: str, key: str, payload: bytes = b"v") -> Append:
    return Append(clientid, key, payload, 1_000)


async def test_ops_submitted_together_commit_as_one_batch_and_notify_once(store):
    commits = []
    pool = WriterPool(store, 1, lambda ops, results: commits.append((list(ops), list(results))))
    pool.start()
    futures = [pool.submit(f"c{i}", append(f"c{i}", "k")) for i in range(10)]
    results = await asyncio.gather(*futures)
    await pool.close()
    assert store.batches == [10]
    assert results == [Appended(1)] * 10
    assert len(commits) == 1 and [op.clientid for op in commits[0][0]] == [f"c{i}" for i in range(10)]


async def test_one_clientid_gets_seqnos_in_submit_order_across_agents(store):
    pool = WriterPool(store, 4, lambda ops, results: None)
    pool.start()
    futures = [pool.submit(cid, append(cid, f"k{i}")) for i in range(20) for cid in ("a", "b", "c")]
    await asyncio.gather(*futures)
    await pool.close()
    for cid in ("a", "b", "c"):
        assert [m.key for m in store.read_after(cid, 0, 100)] == [f"k{i}" for i in range(20)]
        assert [m.seqno for m in store.read_after(cid, 0, 100)] == list(range(1, 21))


async def test_close_commits_every_queued_op_then_refuses_more(store):
    pool = WriterPool(store, 2, lambda ops, results: None)
    pool.start()
    futures = [pool.submit("q", append("q", f"k{i}")) for i in range(50)]
    await pool.close()
    assert all(f.done() and not f.exception() for f in futures)
    assert store.last_seqno("q") == 50
    with pytest.raises(PoolClosed):
        pool.submit("q", append("q", "late"))


async def test_a_failing_commit_fails_its_futures_and_the_agent_goes_on(store):
    errors = []
    pool = WriterPool(store, 1, lambda ops, results: None, on_error=errors.append)
    pool.start()
    store.write_error = "disk full (test)"  # what a failed LevelDB write leaves: commits refused until a reopen
    failed = [pool.submit("q", append("q", f"k{i}")) for i in range(3)]
    outcomes = await asyncio.gather(*failed, return_exceptions=True)
    assert all(isinstance(o, StoreError) for o in outcomes) and len(errors) == 1
    store.write_error = None
    assert await pool.submit("q", append("q", "after")) == Appended(1)
    await pool.close()


async def test_small_batches_commit_on_the_event_loop_and_a_gc_step_in_a_thread(store):
    pool = WriterPool(store, 1, lambda ops, results: None)
    pool.start()
    try:
        await asyncio.gather(*(pool.submit("c", append("c", f"k{i}")) for i in range(100)))
        rows = tuple(ExpiredRow(seqno, f"k{seqno - 1}", 1_000, 1) for seqno in range(1, 65))
        assert len(await pool.submit("c", Expire("c", rows))) == 64
        assert len(await pool.submit("c", Expire("c", rows[:1] + (ExpiredRow(65, "k64", 1_000, 1),)))) == 1
    finally:
        await pool.close()
    loop_thread = threading.current_thread().name
    assert store.threads[0] == loop_thread  # appends: inline, cheaper than a thread hop
    assert store.threads[-2] != loop_thread  # 64 rows deleted: off the loop
    assert store.threads[-1] == loop_thread
