"""Garbage collection: delete every entry published before the retention cutoff,
in paced steps so that delivery keeps its latency while GC runs.

A pass walks the index table in steps: each step is read in a reader thread
(:meth:`ecq.store.protocol.QueueStore.expired_step`), then deleted through the writer agents of the queues it
touched (serialized with their appends). The commit fan-out tells observers of each deleted row.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ecq.store.protocol import Expire, ExpiredRow, QueueStore
from ecq.queue.writer import WriterPool

LAG_WAIT_S = 0.02  # how often a paused GC looks again whether the observers caught up


async def run_gc(store: QueueStore, read: Callable[..., asyncio.Future], pool: WriterPool, cutoff_ms: int, *,
                 traffic: Callable[[], int], running: Callable[[], bool],
                 lagging: Callable[[], bool] = lambda: False, select: Callable[[ExpiredRow], bool] | None = None,
                 reason: str = "retention", step: Callable[..., tuple] | None = None) -> int:
    """One GC pass: delete every entry published before ``cutoff_ms`` (ms since the epoch); returns how many.
    ``step``: the store's step read, :meth:`QueueStore.expired_step` by default; with
    :meth:`QueueStore.lapsed_step` the pass deletes instead every entry whose own expiry time (MQTT 5 Message
    Expiry Interval) is at or before ``cutoff_ms``, which is then the time now.

    ``read(func, *args)`` runs a blocking store read off the loop; ``traffic()`` is the count of appends and
    PUBACKs so far (GC slows down while it grows, see :class:`GcPacer`); the pass ends early once
    ``running()`` is False (shutdown), and waits between steps while ``lagging()`` is True (an observer, such
    as the event recorder, has not yet taken in the rows deleted so far). ``select(row)``, when given, keeps
    only the rows it is True for (tombstones: ``size == 0``); ``reason`` goes on the Expire ops. Raises what the store read or the
    deleting commit raised.
    """
    pacer = GcPacer()
    deleted, cursor = 0, None
    while running():
        started = time.monotonic()
        found, cursor = await read(step or store.expired_step, cutoff_ms, pacer.rows, cursor)
        if select is not None:
            found = {cid: kept for cid, rows in found.items() if (kept := [row for row in rows if select(row)])}
        deletions = [pool.submit(cid, Expire(cid, tuple(rows), reason)) for cid, rows in found.items()]
        deleted += sum(map(len, await asyncio.gather(*deletions)))
        if cursor is None:
            break
        pacer.note_traffic(traffic(), time.monotonic())
        await asyncio.sleep(pacer.pause_after(time.monotonic() - started))
        while lagging() and running():
            await asyncio.sleep(LAG_WAIT_S)
    return deleted


class GcPacer:
    """How big a GC step is and how long GC pauses after it (GC must not starve delivery).

    The event loop is single-threaded and the reader, writer and event threads share the GIL with it,
    so GC work delays every delivery that is due meanwhile. Two controls:

    * Step size: each step's wall time (read in a thread, delete through the writer agents, record
      the events on the loop) is kept near ``target_s`` by halving or doubling the rows per step
      (``min_rows`` .. ``max_rows``), so one step holds up a delivery for a few ms at most. On a busy
      broker steps take longer (they wait behind traffic) and shrink.
    * Duty cycle: after a step GC pauses ``(1 - duty) / duty`` times as long as the step took (at most
      ``max_pause_s``, so a shutdown never waits long). ``duty`` is ``min_duty`` while the broker has
      traffic (appends or PUBACKs within the last ``quiet_s``) and ``max_duty`` while it has none.
    """

    def __init__(self, target_s: float = 0.005, min_duty: float = 0.1, max_duty: float = 0.5, quiet_s: float = 1.0,
                 min_rows: int = 16, max_rows: int = 512, max_pause_s: float = 0.5) -> None:
        self.rows = min_rows
        self.duty = max_duty
        self._target_s, self._min_duty, self._max_duty, self._quiet_s = target_s, min_duty, max_duty, quiet_s
        self._min_rows, self._max_rows, self._max_pause_s = min_rows, max_rows, max_pause_s
        self._traffic: int | None = None
        self._traffic_at = float("-inf")

    def note_traffic(self, count: int, now: float) -> None:
        """``count``: the broker's appends and PUBACKs so far; ``now``: time.monotonic(). Sets ``duty``."""
        if self._traffic is not None and count != self._traffic:
            self._traffic_at = now
        self._traffic = count
        self.duty = self._min_duty if now - self._traffic_at < self._quiet_s else self._max_duty

    def pause_after(self, busy_s: float) -> float:
        """Seconds to pause after a step that took ``busy_s``; adapts the next step's rows."""
        if busy_s > self._target_s:
            self.rows = max(self._min_rows, self.rows // 2)
        elif busy_s < self._target_s / 2:
            self.rows = min(self._max_rows, self.rows * 2)
        return min(self._max_pause_s, busy_s * (1 - self.duty) / self.duty)
