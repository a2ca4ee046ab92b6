"""Writers: a hashed pool of per-client agents with group commit.

Every write op for one clientid (appends, ack-state saves, GC deletions) goes through the same agent,
picked by CRC32(clientid) modulo the pool size, so a queue's order is the order its writes arrived.
An agent takes all ops pending on its queue (up to ``max_batch``) and commits them as one LevelDB
write batch. A batch runs on the event loop itself when it cannot wait on the disk
(:meth:`ecq.store.protocol.QueueStore.commits_without_waiting`: no fsync, level 0 far from LevelDB's write stalls),
otherwise in a thread pool. A commit is mostly Python (keys, compaction lookups) holding the GIL anyway,
while a thread hop costs the event loop ~65 us and a small inline commit ~4 us (measured in the benchmark), and
light traffic makes batches of one op. A batch that deletes many rows (GC, purge) always runs in a thread,
so that GC never holds up delivery on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ecq.store.protocol import Expire, Op, QueueStore
from ecq.queue.throttle import LogThrottle

log = logging.getLogger(__name__)

INLINE_DELETE_ROWS = 32  # a batch deleting more rows (a GC step, a purge page) commits in a thread

OnCommit = Callable[[Sequence[Op], Sequence[object]], None]
FAILURE_LOG_INTERVAL_S = 30.0  # a full disk or a NATS outage fails every commit: one log line per interval


class PoolClosed(RuntimeError):
    """The writer pool is shutting down and takes no more ops."""


class WriterPool:
    """``size`` agents over ``store``; ``on_commit(ops, results)`` runs on the event loop after each batch,
    ``on_error(exc)`` after each batch that failed. An op whose result is an exception (the store refused that op
    alone) fails its own future with it."""

    def __init__(self, store: QueueStore, size: int, on_commit: OnCommit, max_batch: int = 1024,
                 on_error: Callable[[Exception], None] = lambda _exc: None) -> None:
        self._store = store
        self._on_commit = on_commit
        self._on_error = on_error
        self._max_batch = max_batch
        self._queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(size)]
        self._executor = ThreadPoolExecutor(max_workers=min(size, 4), thread_name_prefix="ecq-writer")
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._failure_log = LogThrottle(FAILURE_LOG_INTERVAL_S)

    def start(self) -> None:
        """Start the agents on the running event loop."""
        self._tasks = [asyncio.create_task(self._agent(q), name=f"ecq-writer-{i}") for i, q in enumerate(self._queues)]

    def submit(self, clientid: str, op: Op) -> asyncio.Future:
        """Queue ``op`` on the agent of ``clientid``; the future resolves with its result once committed.

        Synchronous on purpose: callers keep arrival order by submitting without awaiting first.
        Raises PoolClosed after :meth:`close` began.
        """
        if self._closed:
            raise PoolClosed("ECQ writer pool is closed")
        future = asyncio.get_running_loop().create_future()
        self._queues[zlib.crc32(clientid.encode()) % len(self._queues)].put_nowait((op, future))
        return future

    async def close(self) -> None:
        """Refuse new ops, commit everything already queued, stop the agents and the thread pool."""
        self._closed = True
        for queue in self._queues:
            queue.put_nowait(None)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def _agent(self, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        stopping = False
        while not stopping:
            batch = [await queue.get()]
            while len(batch) < self._max_batch and not queue.empty():
                batch.append(queue.get_nowait())
            if None in batch:
                stopping = True
            live = [(op, fut) for op, fut in (item for item in batch if item is not None) if not fut.done()]
            if not live:
                continue
            ops = [op for op, _ in live]
            try:
                inline = self._store.commits_without_waiting() and not _deletes_many(ops)
                if inline:
                    results = self._store.commit(ops)
                elif (pending := self._store.commit_async(ops)) is not None:
                    results = await pending
                else:
                    results = await loop.run_in_executor(self._executor, self._store.commit, ops)
            except Exception as exc:  # LevelDB I/O error, NATS away: fail this batch, keep the agent alive
                if (held_back := self._failure_log.due()) is not None:
                    log.error("ECQ commit of %d ops failed: %s (%d more failed commits since the last such line)",
                              len(ops), exc, held_back)
                self._on_error(exc)
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), result in zip(live, results, strict=True):
                if fut.done():
                    continue
                if isinstance(result, Exception):  # one op refused (a queue quota), the rest of the batch stands
                    fut.set_exception(result)
                else:
                    fut.set_result(result)
            self._on_commit(ops, results)
            if inline:
                await asyncio.sleep(0)  # let the connections run between two inline batches


def _deletes_many(ops: Sequence[Op]) -> bool:
    """True when ``ops`` delete more than INLINE_DELETE_ROWS rows: deleting costs ~3 us a row (measured on the
    2-core dev VM), so a GC step of 512 rows committed inline held up every delivery for ~1.5 ms."""
    return sum(len(op.rows) for op in ops if isinstance(op, Expire)) > INLINE_DELETE_ROWS
