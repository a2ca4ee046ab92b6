"""The engine's upkeep: GC passes, state GC and the recovery of a store whose commits failed, and the loop that
runs each job periodically."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ecq.queue import gc
from ecq.queue.clock import now_ms, retention_cutoff_ms
from ecq.queue.observer import QueueObserver
from ecq.queue.topics import is_scq_queue_id
from ecq.queue.writer import WriterPool
from ecq.store.protocol import ExpiredRow, ForgetQueue, QueueStore, StoreError

log = logging.getLogger(__name__)

STORE_RECOVERY_INTERVAL_S = 1.0  # after a failed commit, how often to look for free space and reopen the store
FORGET_BATCH = 512               # state GC: queues checked and forgotten per round of commits


class Collector:
    """GC passes and state GC of one engine, handed the parts of the engine they use: ``settings`` (its
    ``EcqSettings``: retentions, ``tombstones``), ``store``, ``read`` (its batched store reads), ``pool`` (its writer
    agents), ``observers`` (told of each pass), ``lock`` (held by a pass), ``traffic()`` (its appends and PUBACKs so
    far: GC paces itself slower while it grows), ``running()`` (False once it closes), ``lagging()`` (an observer has
    not caught up: GC waits between steps), and the queues a state GC must leave alone: ``consumers`` and ``loading``
    (in memory, or having their ack state loaded), ``forgetting`` (filled here while a ForgetQueue is committed; a
    load waits for it)."""

    def __init__(self, settings: Any, store: QueueStore, read: Callable[..., Awaitable[Any]], pool: WriterPool,
                 observers: list[QueueObserver], lock: asyncio.Lock, *, traffic: Callable[[], int],
                 running: Callable[[], bool], lagging: Callable[[], bool], consumers: Mapping[str, Any],
                 loading: Mapping[str, int], forgetting: dict[str, asyncio.Future]) -> None:
        self._settings, self._store, self._read, self._pool = settings, store, read, pool
        self._observers, self._lock, self._traffic, self._running, self._lagging = (observers, lock, traffic, running,
                                                                                     lagging)
        self._consumers, self._loading, self._forgetting = consumers, loading, forgetting

    async def run_gc(self) -> int:
        """Delete every entry published more than ``data_retention`` ago, every entry whose own expiry time has
        passed (an MQTT 5 write's Message Expiry Interval: reason ``message_expiry``) and, with ``tombstones`` on,
        every tombstone (empty payload) published more than ``tombstone_retention`` ago; returns how many (see
        ecq.queue.gc).

        A pass asked for while one runs starts after it; :meth:`QueueEngine.stop_delivering` ends the pass.
        """
        settings = self._settings
        async with self._lock:
            for observer in self._observers:
                observer.gc_started()
            gc_pass = functools.partial(gc.run_gc, self._store, self._read, self._pool, traffic=self._traffic,
                                        running=self._running, lagging=self._lagging)
            cutoff_ms = retention_cutoff_ms(settings.data_retention)
            deleted = await gc_pass(cutoff_ms)
            deleted += await gc_pass(now_ms(), step=self._store.lapsed_step, reason="message_expiry")
            if settings.tombstones and settings.tombstone_retention < settings.data_retention:
                deleted += await gc_pass(retention_cutoff_ms(settings.tombstone_retention),
                                         select=_is_tombstone, reason="tombstone_retention")
            if deleted:
                log.info("ECQ GC deleted %d entries published before %d ms or past their own expiry", deleted,
                         cutoff_ms)
            if forgotten := await self.forget_idle_queues():
                log.info("ECQ GC forgot the seqno and ack state of %d empty queues idle for %s s", forgotten,
                         f"{settings.state_retention:g}")
            return deleted

    async def forget_idle_queues(self) -> int:
        """State GC: delete the seqno counter and ack state of every queue that stores no entry, has no
        consumer in memory (online, or offline with its state cached) and had no write and no ack for
        ``state_retention``, and the position of every SCQ reader with no consumer in memory and no ack for
        ``state_retention`` (its next subscribe starts at the SCQ's oldest entry); returns how many. An SCQ's seqno
        counter is kept: its readers' positions, stored apart,
        would otherwise pass the seqnos of its next writes. Each is checked again in its own commit (ForgetQueue),
        through the queue's writer agent, so a write or an ack that came meanwhile keeps it. Raises what the store's
        reads and commits raise."""
        cutoff_ms = retention_cutoff_ms(self._settings.state_retention)
        candidates = await self._read(self._store.idle_queues, cutoff_ms)
        forgotten = 0
        for start in range(0, len(candidates), FORGET_BATCH):
            idle = [cid for cid in candidates[start:start + FORGET_BATCH]
                    if cid not in self._consumers and cid not in self._loading and self._running()
                    and not is_scq_queue_id(cid)]
            for clientid in idle:
                self._forgetting[clientid] = self._pool.submit(clientid, ForgetQueue(clientid, cutoff_ms))
            try:
                forgotten += sum(await asyncio.gather(*(self._forgetting[cid] for cid in idle)))
            finally:
                for clientid in idle:
                    del self._forgetting[clientid]
        return forgotten


async def recover_store(store: QueueStore) -> None:
    """After a failed commit, reopen the store once the disk has room again (QueueStore.reopen_if_space)."""
    reason = store.write_error
    if not reason:
        return
    try:
        reopened = await asyncio.get_running_loop().run_in_executor(None, store.reopen_if_space)
    except StoreError as exc:
        log.error("ECQ store reopen failed, retrying in %.0f s: %s", STORE_RECOVERY_INTERVAL_S, exc)
        return
    if reopened:
        log.warning("ECQ store reopened after failed writes (%s); writes are accepted again", reason)


def _is_tombstone(row: ExpiredRow) -> bool:
    return row.size == 0


async def every(interval_s: float, job: Callable[[], Any]) -> None:
    """Run ``job()`` every ``interval_s`` seconds until cancelled, logging what it raises."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await job()
        except Exception:
            log.exception("ECQ periodic %s failed", getattr(job, "__name__", job))
