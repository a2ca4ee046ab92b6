"""Deleting keys and whole queues, built on QueueStore operations every backend has (no backend code).

A tombstone is an :class:`ecq.store.protocol.Append` with an empty payload (option ``tombstones``): it takes the
next seqno and compacts away the older values of its key like any write, is delivered once as an empty
PUBLISH, and is then deleted on its PUBACK (ecq.queue.delivery) or by GC after ``tombstone_retention``
(ecq.queue.engine.QueueEngine.run_gc). An SCQ's tombstone is deleted once no reader holding a position on the
SCQ still has it pending (:class:`ReaderTombstones`). A purge deletes every stored entry of a queue with Expire ops; the
seqno counter and the ack state are left alone, so nothing acked is ever delivered again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Protocol

from ecq.queue.writer import PoolClosed, WriterPool
from ecq.store.protocol import Expire, ExpiredRow, QueueStore, stored_pages

log = logging.getLogger(__name__)

PURGE_PAGE = 512  # entries read, and deleted in one Expire op, at a time


class TombstonesOff(ValueError):
    """``ecq delete`` on a broker running with ``tombstones: false`` (an empty payload is a value there)."""


def stored_rows(store: QueueStore, clientid: str) -> list[tuple[ExpiredRow, ...]]:
    """Every stored entry of ``clientid`` as GC rows (seqno, key, publish ms, payload bytes), in pages of at most
    PURGE_PAGE, oldest first (a blocking read; raises what ``store.read_after`` raises)."""
    return [tuple(ExpiredRow(m.seqno, m.key, m.ts_ms, len(m.payload)) for m in page)
            for page in stored_pages(store, clientid, PURGE_PAGE)]


def delete_acked(pool: WriterPool, queue: str, rows: list[ExpiredRow]) -> None:
    """Delete the acked tombstones ``rows`` of the queue id ``queue`` (an Expire op with reason ``tombstone_acked``
    through its writer agent, told to the observers like any deletion when committed); a failure, or a pool
    closing, leaves them to GC (``tombstone_retention``)."""
    try:
        future = pool.submit(queue, Expire(queue, tuple(rows), "tombstone_acked"))
    except PoolClosed:
        return
    future.add_done_callback(_log_failed_delete)


def _log_failed_delete(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception():
        log.warning("ECQ deleting acked tombstones failed (%s); GC removes them after tombstone_retention",
                    future.exception())


class Positions(Protocol):
    """What :class:`ReaderTombstones` asks of the lag index (ecq.queue.lag.LagIndex)."""

    def holds(self, position: str, seqno: int) -> bool:
        """True while the reader at ``position`` (a position id) has stored entry ``seqno`` pending."""

    def holding(self, queue: str, seqno: int) -> str | None:
        """The position id of a reader of the SCQ ``queue`` that has entry ``seqno`` pending, or None."""


class ReaderTombstones:
    """The tombstones of SCQs that a reader acked, each deleted once no reader holding a position on its SCQ has it
    pending any more (issue 33 point 5; EMQX's Message Queue keeps a deletion until every subscriber saw it).

    A reader *holds* a position while its position is stored or this broker sent it something (the lag index
    follows it, ecq.queue.lag): online or offline, a group's position (``$SCQ/<queue>/$share/<group>``) too; on a
    cluster, a reader another broker sent entries to is known here from its first ack save's notice. A
    reader that subscribes for the first time after the deletion never saw the key (its older values were
    compacted away when the tombstone was written), so it misses nothing; a position forgotten by state GC
    (``consumer_state_retention``) holds nothing back. Pending means: not acked by a PUBACK this broker heard of
    (its own readers' PUBACKs, other brokers' ack saves by notice), judged by the lag index.

    Checked when an SCQ reader's ack save commits (:meth:`saved`) and when a position is forgotten
    (:meth:`check_soon`), at most once per loop iteration per SCQ (one commit's saves together). Each waiting
    tombstone remembers the reader that held it last: a check asks that reader first (O(1)), then the one that held
    the tombstone checked before it, and walks the SCQ's readers only when neither holds it. On a cluster another
    broker's reader's saved position (heard of by notice) checks again too. What is waiting is kept in memory
    only; after a restart, or when two brokers' readers acked last at once and neither heard of the other yet, the
    next ack save on the SCQ or GC after ``tombstone_retention`` deletes it.
    """

    def __init__(self, pool: WriterPool, positions: Positions) -> None:
        self._pool, self._positions = pool, positions
        self._waiting: dict[str, dict[int, tuple[ExpiredRow, str | None]]] = {}  # queue id -> seqno -> (row, holder)
        self._due: set[str] = set()

    def saved(self, queue: str, rows: list[ExpiredRow]) -> None:
        """A reader of the SCQ ``queue`` (its queue id) had an ack save committed, holding the acks of the
        tombstones ``rows`` (maybe none): check every tombstone of ``queue`` waiting."""
        if rows:
            waiting = self._waiting.setdefault(queue, {})
            for row in rows:
                waiting.setdefault(row.seqno, (row, None))
        self.check_soon(queue)

    def check_soon(self, queue: str) -> None:
        """Check the tombstones of ``queue`` waiting, once, when the loop has run what is ready."""
        if queue in self._waiting and queue not in self._due:
            self._due.add(queue)
            asyncio.get_running_loop().call_soon(self._check, queue)

    def gone(self, queue: str, seqnos: Iterable[int]) -> None:
        """Entries ``seqnos`` of ``queue`` were deleted (GC, compaction, a purge, this deletion): nothing waits on
        them."""
        if (waiting := self._waiting.get(queue)) is None:
            return
        for seqno in seqnos:
            waiting.pop(seqno, None)
        if not waiting:
            del self._waiting[queue]

    def _check(self, queue: str) -> None:
        self._due.discard(queue)
        waiting = self._waiting.get(queue, {})
        free, last_holder = [], None
        for seqno, (row, holder) in list(waiting.items()):
            if holder is None or not self._positions.holds(holder, seqno):
                holder = last_holder if last_holder and self._positions.holds(last_holder, seqno) \
                    else self._positions.holding(queue, seqno)
                last_holder = holder or last_holder
            if holder is None:
                free.append(row)
                del waiting[seqno]
            else:
                waiting[seqno] = (row, holder)
        if not waiting:
            self._waiting.pop(queue, None)
        if free:
            delete_acked(self._pool, queue, free)
