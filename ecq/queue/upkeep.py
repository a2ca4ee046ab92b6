"""The engine's upkeep: GC passes, state GC and the recovery of a store whose commits failed, and the loop that
runs each job periodically."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ecq.queue import gc
from ecq.queue.clock import now_ms, retention_cutoff_ms
from ecq.store.protocol import ExpiredRow, ForgetQueue, QueueStore, StoreError

if TYPE_CHECKING:
    from ecq.queue.engine import QueueEngine

log = logging.getLogger(__name__)

STORE_RECOVERY_INTERVAL_S = 1.0  # after a failed commit, how often to look for free space and reopen the store
FORGET_BATCH = 512               # state GC: queues checked and forgotten per round of commits


async def run_gc(engine: QueueEngine) -> int:
    """Delete every entry published more than ``data_retention`` ago, every entry whose own expiry time has
    passed (an MQTT 5 write's Message Expiry Interval: reason ``message_expiry``) and, with ``tombstones`` on,
    every tombstone (empty payload) published more than ``tombstone_retention`` ago; returns how many (see
    ecq.queue.gc).

    A pass asked for while one runs starts after it; :meth:`QueueEngine.stop_delivering` ends the pass.
    """
    async with engine.gc_lock:
        for observer in engine.observers:
            observer.gc_started()
        gc_pass = functools.partial(gc.run_gc, engine.store, engine.read, engine.pool,
                                    traffic=lambda: engine.traffic, running=lambda: not engine.closing, lagging=engine.gc_lagging)
        cutoff_ms = retention_cutoff_ms(engine.settings.data_retention)
        deleted = await gc_pass(cutoff_ms)
        deleted += await gc_pass(now_ms(), step=engine.store.lapsed_step, reason="message_expiry")
        if engine.settings.tombstones and engine.settings.tombstone_retention < engine.settings.data_retention:
            deleted += await gc_pass(retention_cutoff_ms(engine.settings.tombstone_retention),
                                     select=_is_tombstone, reason="tombstone_retention")
        if deleted:
            log.info("ECQ GC deleted %d entries published before %d ms or past their own expiry", deleted, cutoff_ms)
        if forgotten := await forget_idle_queues(engine):
            log.info("ECQ GC forgot the seqno and ack state of %d empty queues idle for %s s", forgotten,
                     f"{engine.settings.state_retention:g}")
        return deleted


async def forget_idle_queues(engine: QueueEngine) -> int:
    """State GC: delete the seqno counter and ack state of every queue that stores no entry, has no
    consumer in memory (online, or offline with its state cached) and had no write and no ack for
    ``state_retention``; returns how many. Each is checked again in its own commit (ForgetQueue), through
    the queue's writer agent, so a write or an ack that came meanwhile keeps it. Raises what the store's
    reads and commits raise."""
    cutoff_ms = retention_cutoff_ms(engine.settings.state_retention)
    candidates = await engine.read(engine.store.idle_queues, cutoff_ms)
    forgotten = 0
    for start in range(0, len(candidates), FORGET_BATCH):
        idle = [cid for cid in candidates[start:start + FORGET_BATCH]
                if cid not in engine.consumers and cid not in engine.loading and not engine.closing]
        for clientid in idle:
            engine.forgetting[clientid] = engine.pool.submit(clientid, ForgetQueue(clientid, cutoff_ms))
        try:
            forgotten += sum(await asyncio.gather(*(engine.forgetting[cid] for cid in idle)))
        finally:
            for clientid in idle:
                del engine.forgetting[clientid]
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
