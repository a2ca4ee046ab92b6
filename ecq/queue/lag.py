"""The lag index: per queue, what its consumer has not acked yet, kept up to date as the engine works.

A stored entry is *pending* while its consumer has not acked it (seqno above the acked seqno and not acked out
of order), as ``ecq inspect`` counts it. :class:`LagIndex` holds, for each queue with pending entries only, their
count, payload bytes and the oldest one (seqno, publish ms), plus what it needs to tell whether an entry it hears
about was pending: a *floor* (every stored seqno at or below it is not pending: the acked seqno, or just below
the oldest pending entry), the seqnos acked above the floor, and the seqnos deleted while a PUBACK for them may
still come. A few ints per lagging queue, never one per entry.

It is built by one scan of the store at engine start (:meth:`LagIndex.rebuild`), then kept by the engine's
observer calls. When the oldest pending entry of a queue is acked or deleted the queue is marked *dirty* and
its new oldest entry is read from the store later, by :meth:`LagIndex.refresh` (the heartbeat, and before each
answer), in one reader-thread call for every dirty queue; a rewind marks its queue for a recount, read the same
way. What happens to a queue while it is being read is noted and applied on top of what the read found.

On a shared store (a cluster) the index is kept from the store's notices (ecq.queue.notices): every broker's
appends and deletions reach :meth:`LagIndex.appended` and :meth:`LagIndex.expired`; an ack state another broker
saved marks its queue for a recount from that state (:meth:`LagIndex.saved_elsewhere`); queues changed by lost
notices are recounted (:meth:`LagIndex.resync`). Nothing is re-scanned while the cluster is idle.

An SCQ (ecq.queue.topics.scq_queue_id) is read by many readers, each from its own position: the index keeps, per
SCQ, its stored entries once (ecq.queue.lag_scq.ScqLag) and per reader followed only its acked floor and the seqnos
acked above it, so an append or deletion of the SCQ costs O(log entries) however many read it, and a reader's lag
(under its position id) is computed when asked. It follows the positions found at start (stored ack states), and
a reader first heard of later (its first delivery or ack here, or its position saved by another broker) from its
state. Lost notices of an SCQ read its stored entries again.

The blocking reads and the ``ecq top`` answer are in ecq.queue.lag_reads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ecq.queue.clock import now_ms
from ecq.queue.lag_reads import (OLDEST_CANDIDATES, QueueLag, QueueRead, check_top, read_queues, reader_lags,
                                 scan_lag, scan_store, scq_entries, scq_summary, top_report)
from ecq.queue.lag_scq import Position, ScqLag
from ecq.queue.topics import RewindPoint, is_position_id, is_scq_queue_id, queue_of_position
from ecq.store.protocol import AckState, Append, Appended, ExpiredRow, Message, QueueStore

__all__ = ["LagIndex", "QueueLag", "QueueRead", "check_top", "read_queues", "scan_lag", "top_report"]

log = logging.getLogger(__name__)

ABOVE_LIMIT = 256         # acks above a queue's floor kept before its oldest pending entry is read again


class _Reading:
    """A queue being read in a thread, and what happened to it meanwhile."""

    __slots__ = ("recount", "pending", "bytes", "appended", "removed", "void")

    def __init__(self, recount: bool, lag: QueueLag) -> None:
        self.recount, self.pending, self.bytes = recount, lag.pending, lag.bytes
        self.appended: list[tuple[int, int, int]] = []  # (seqno, payload bytes, publish ms)
        self.removed: set[int] = set()
        self.void = False  # a rewind came: a recount is due anyway


class LagIndex:
    """The lag of every queue of ``store`` (a :class:`ecq.queue.observer.QueueObserver`; call on the event loop).

    ``read(func, *args)`` runs a blocking store read in a reader thread (QueueEngine.read); ``consumers`` is the
    engine's live mapping of clientid to :class:`ecq.queue.delivery.Consumer` (a rescan reads their ack states,
    a deletion their inflight seqnos). One difference from ``ecq inspect``: an entry past ``data_retention``
    that delivery skipped (never sent, so never acked) stays pending here until GC deletes it.
    """

    def __init__(self, store: QueueStore, read: Callable[..., Any], consumers: Mapping[str, Any]) -> None:
        self._store, self._read, self._consumers = store, read, consumers
        self.queues: dict[str, QueueLag] = {}
        self._dirty: dict[str, bool] = {}  # clientid -> True: recount the queue; False: find its oldest pending
        self._reading: dict[str, _Reading] = {}
        self._touched: set[str] | None = None  # queues changed during a rescan
        self._ahead: dict[str, int] = {}  # queues whose acked seqno is past their last seqno: that acked seqno
        self._lock = asyncio.Lock()
        self._soon: asyncio.Task | None = None
        self._summed: tuple[int, int] | None = None  # (pending, oldest ms) over every queue; None: changed since
        self._scqs: dict[str, ScqLag] = {}  # SCQ queue id -> its stored entries and the readers followed here
        self._scq_summed: tuple[int, int] | None = None  # (pending, oldest ms) over SCQ readers; None: changed since

    # --- building -----------------------------------------------------------------------------------

    async def rebuild(self) -> None:
        """Read the whole index from the store (engine start). Queues changed while it reads (a cluster's other
        brokers write meanwhile) are recounted from the scan's floor, or from what was heard of them when the scan
        found nothing pending there; no refresh runs meanwhile. Raises what the store's reads raise."""
        async with self._lock:  # a refresh running now ends first
            live = {cid: (c.state.acked, frozenset(c.state.above)) for cid, c in self._consumers.items()}
            self._touched = set()
            for scq in self._scqs.values():
                scq.recorded = []
        try:
            scan = await self._read(scan_store, self._store, live)
        except BaseException:
            for scq in self._scqs.values():
                scq.recorded = None
            raise
        finally:
            touched, self._touched = self._touched, None
        self._summed = self._scq_summed = None
        for queue in scan.scqs:
            self._scq(queue)
        for queue, scq in self._scqs.items():  # what was heard while the scan ran, applied on what it found
            scq.reload(scan.scqs.get(queue, ()))
        for position_id, (acked, above) in scan.positions.items():  # a reader followed meanwhile is known better
            self._scq(queue_of_position(position_id)).readers.setdefault(position_id, Position(acked, above))
        scanned, ahead = scan.queues, scan.ahead
        for clientid in touched:  # recounted from the scan's floor: an entry the scan missed is above it
            if clientid not in scanned and clientid in self.queues:
                scanned[clientid] = self.queues[clientid]  # nothing pending when scanned: what was heard since
            if clientid in scanned:
                self._dirty[clientid] = True
        self.queues, self._ahead = scanned, ahead

    async def resync(self, clientids: set[str]) -> None:
        """Recount the queues of ``clientids`` from their ack states (this broker's consumer's, or the stored one):
        notices of what changed them were lost (an SCQ's: its stored entries are read again, and each of its readers
        followed here recounted). A failed read leaves that queue as it was."""
        scqs = [queue for queue in clientids if is_scq_queue_id(queue)]
        for queue in scqs:
            await self._reload(queue)
        owners = [*(cid for cid in clientids if not is_scq_queue_id(cid)),
                  *(position for queue in scqs if queue in self._scqs for position in self._scqs[queue].readers)]
        for clientid in owners:
            if (consumer := self._consumers.get(clientid)) is not None:
                state = consumer.state
            else:
                try:
                    state = await self._read(self._store.ack_state, clientid)
                except Exception as exc:
                    log.warning("ECQ lag index: %s not recounted: %s", clientid, exc or type(exc).__name__)
                    continue
            self.saved_elsewhere(clientid, state)
        await self.refresh()

    async def _reload(self, queue: str) -> None:
        """Read the stored entries of the SCQ ``queue`` again (changes heard meanwhile applied on top)."""
        scq = self._scq(queue)
        if scq.recorded is not None:  # being read already
            return
        scq.recorded = []
        try:
            entries = await self._read(scq_entries, self._store, queue)
        except Exception as exc:
            scq.recorded = None
            log.warning("ECQ lag index: SCQ %s not re-read: %s", queue, exc or type(exc).__name__)
            return
        self._summed = self._scq_summed = None
        scq.reload(entries)

    def saved_elsewhere(self, clientid: str, state: AckState) -> None:
        """Another broker of a cluster saved ``state`` for ``clientid`` (its consumer is there): the queue is
        recounted from it at the next :meth:`refresh` (one read of the queue above its acked seqno); an SCQ reader's
        position is taken as it is."""
        if is_position_id(clientid):
            self._note(clientid)
            self._scq(queue_of_position(clientid)).readers[clientid] = Position(state.acked, state.above)
            return
        self.rewound(clientid, RewindPoint("seqno", state.acked), state.acked)
        self.queues[clientid].above = {seqno for seqno in state.above if seqno > state.acked} or None

    async def refresh(self) -> None:
        """Read the dirty queues (new oldest pending entry, or a recount) in one reader-thread call. A failed read
        leaves them dirty, for the next call."""
        async with self._lock:
            if not self._dirty or self._touched is not None:  # nothing to do, or a rescan reads everything
                return
            jobs = [(cid, recount) for cid, recount in self._dirty.items() if cid in self.queues]
            self._dirty = {}
            requests = []
            for cid, recount in jobs:
                lag = self.queues[cid]
                self._reading[cid] = _Reading(recount, lag)
                requests.append((cid, lag.floor, lag.skipped(), recount))
            try:
                found = await self._read(read_queues, self._store, requests)
            except Exception as exc:
                log.warning("ECQ lag index: %d queues not re-read: %s", len(jobs), exc or type(exc).__name__)
                found = [None] * len(jobs)
            self._summed = self._scq_summed = None
            for (cid, recount), read in zip(jobs, found, strict=True):
                reading = self._reading.pop(cid)
                if read is None or reading.void:
                    self._dirty[cid] = self._dirty.get(cid, False) or recount or reading.void
                elif cid in self.queues:
                    (self._apply_recount if recount else self._apply_oldest)(cid, self.queues[cid], read, reading)
                self._forget_if_idle(cid)

    # --- answers ------------------------------------------------------------------------------------

    async def report(self, n: int, by: str = "pending", scq: str | None = None) -> dict[str, Any]:
        """:func:`top_report` of the index (of the readers of the SCQ named ``scq`` only, when given), after a
        refresh. Raises ValueError for a bad ``n`` or ``by``."""
        check_top(n, by)
        await self.refresh()
        return top_report({**self.queues, **reader_lags(self._scqs.values())}, n, by, now_ms(), scq)

    def scq_summary(self, n: int, slowest: int) -> list[dict[str, Any]]:
        """:func:`ecq.queue.lag_reads.scq_summary` of the index as it is now (no refresh: call it after
        :meth:`report`), over the SCQ readers followed here."""
        positions = {queue_id: set(scq.readers) for queue_id, scq in self._scqs.items() if scq.readers}
        return scq_summary(reader_lags(self._scqs.values()), positions, n, slowest, now_ms())

    def totals(self) -> tuple[int, float]:
        """(pending entries over every queue, age in seconds of the oldest pending entry, 0 when none). Summed over
        every lagging queue (and SCQ reader, O(readers x log entries)) only when the index changed since the last
        call: an idle broker's dashboard samples (every 2 s) cost nothing however many queues lag."""
        if self._summed is None:
            scq_pending, scq_oldest = self._scq_sums()
            oldest = [lag.oldest_ms for lag in self.queues.values()] + ([scq_oldest] if scq_oldest else [])
            self._summed = (sum(lag.pending for lag in self.queues.values()) + scq_pending, min(oldest, default=0))
        pending, oldest = self._summed
        return pending, max(0.0, (now_ms() - oldest) / 1000) if oldest else 0.0

    def holds(self, position: str, seqno: int) -> bool:
        """True while the SCQ reader at ``position`` (a position id) has stored entry ``seqno`` pending: not acked
        by a PUBACK heard of here, nor deleted. O(1)."""
        scq = self._scqs.get(queue_of_position(position))
        return scq is not None and position in scq.readers and scq.readers[position].holds(seqno, scq.live)

    def holding(self, queue: str, seqno: int) -> str | None:
        """The first position followed here of a reader of the SCQ ``queue`` (its queue id) that has stored entry
        ``seqno`` pending, or None when no reader has (ecq.queue.tombstones.ReaderTombstones). O(readers followed)
        at worst, stopping at the first one."""
        if (scq := self._scqs.get(queue)) is None:
            return None
        return next((position_id for position_id, position in scq.readers.items() if position.holds(seqno, scq.live)),
                    None)

    def pending_counts(self) -> Iterator[int]:
        """The pending count of every lagging queue, SCQ readers' positions left out (queues not listed have
        none)."""
        return (lag.pending for lag in self.queues.values())

    def scq_totals(self) -> tuple[int, int]:
        """(SCQ readers' positions followed, pending entries over them). O(readers x log entries)."""
        return (sum(len(scq.readers) for scq in self._scqs.values()),
                self._scq_sums()[0])

    # --- observer calls -----------------------------------------------------------------------------

    def appended(self, op: Append, result: Appended) -> None:
        """A write: one more pending entry (for each reader, on an SCQ: one more stored entry); the values compaction
        deleted are pending no more."""
        if is_scq_queue_id(op.clientid):
            self._note(op.clientid)
            scq = self._scq(op.clientid)
            for seqno in result.replaced:
                scq.remove(seqno)
            scq.add(result.seqno, len(op.payload), op.ts_ms)
        else:
            self._appended(op.clientid, op, result)

    def _appended(self, clientid: str, op: Append, result: Appended) -> None:
        seqno, size = result.seqno, len(op.payload)
        self._note(clientid)
        if (ahead := self._ahead.get(clientid)) is not None:
            if seqno <= ahead:  # already "acked" by a rewind past the queue's end: never delivered
                return
            del self._ahead[clientid]
        if reading := self._reading.get(clientid):
            reading.appended.append((seqno, size, op.ts_ms))
            reading.removed.update(result.replaced)
        lag = self.queues.get(clientid)
        if lag is None:
            lag = self.queues[clientid] = QueueLag(seqno - 1)
        if result.replaced:
            self._compacted(clientid, lag, result)
        if lag.pending <= 0 and not self._recount_due(clientid):
            lag.oldest_seqno, lag.oldest_ms = seqno, op.ts_ms
            if self._dirty.get(clientid) is False:
                del self._dirty[clientid]
        lag.pending += 1
        lag.bytes += size

    def _compacted(self, clientid: str, lag: QueueLag, result: Appended) -> None:
        pending = [seqno for seqno in result.replaced if lag.is_pending(seqno)]
        whole = len(pending) == len(result.replaced)
        if pending and not whole:  # the replaced sizes are known only as a sum: recount
            self._dirty[clientid] = True
        for index, seqno in enumerate(pending):
            self._removed(clientid, lag, seqno, result.replaced_bytes if whole and index == 0 else 0)

    def expired(self, clientid: str, rows: tuple[ExpiredRow, ...], reason: str = "retention") -> None:
        """Deleted entries (GC, purge, an acked tombstone, a quota eviction) are pending no more (for any reader, on
        an SCQ)."""
        if is_scq_queue_id(clientid):
            self._note(clientid)
            scq = self._scq(clientid)
            for row in rows:
                scq.remove(row.seqno)
        else:
            self._expired(clientid, rows)

    def _expired(self, clientid: str, rows: tuple[ExpiredRow, ...]) -> None:
        self._note(clientid)
        if reading := self._reading.get(clientid):
            reading.removed.update(row.seqno for row in rows)
        if (lag := self.queues.get(clientid)) is None:
            return
        for row in rows:
            if lag.is_pending(row.seqno):
                self._removed(clientid, lag, row.seqno, row.size)
        self._forget_if_idle(clientid)

    def _removed(self, clientid: str, lag: QueueLag, seqno: int, size: int) -> None:
        lag.pending -= 1
        lag.bytes -= size
        consumer = self._consumers.get(clientid)
        if seqno == lag.oldest_seqno:
            self._oldest_gone(clientid, lag, seqno)
        elif consumer is not None and seqno in consumer.inflight:  # its PUBACK may still come
            lag.gone = (lag.gone or set()) | {seqno}

    def acked(self, clientid: str, message: Message, sent_monotonic: float) -> None:
        """A PUBACK: that entry is pending no more, unless it was deleted meanwhile."""
        self._note(clientid)
        if is_position_id(clientid):
            self._follow_reader(clientid)
            if (scq := self._scqs.get(queue_of_position(clientid))) and (position := scq.readers.get(clientid)):
                position.ack(message.seqno, scq.live)
            return
        if (lag := self.queues.get(clientid)) is None:
            return
        seqno = message.seqno
        if not lag.is_pending(seqno):
            if lag.gone and seqno in lag.gone:
                lag.gone.discard(seqno)
            return
        lag.pending -= 1
        lag.bytes -= len(message.payload)
        if seqno == lag.oldest_seqno:
            self._oldest_gone(clientid, lag, seqno)
        else:
            lag.above = (lag.above or set()) | {seqno}
            if len(lag.above) > ABOVE_LIMIT:  # acks beyond a stale oldest: find the real one, which prunes them
                self._dirty.setdefault(clientid, False)
                self._refresh_soon()
        self._forget_if_idle(clientid)

    def _oldest_gone(self, clientid: str, lag: QueueLag, seqno: int) -> None:
        lag.raise_floor(seqno)  # below the next pending entry, wherever it is
        if lag.pending > 0:
            self._dirty.setdefault(clientid, False)
        else:
            lag.oldest_seqno = lag.oldest_ms = 0

    def _refresh_soon(self) -> None:
        if self._soon is None or self._soon.done():
            self._soon = asyncio.get_running_loop().create_task(self.refresh(), name="ecq-lag-refresh")

    def rewound(self, clientid: str, point: RewindPoint, acked: int) -> None:
        """A rewind: the queue is recounted from its new acked seqno (an SCQ reader's position starts there)."""
        self._note(clientid)
        if is_position_id(clientid):
            self._scq(queue_of_position(clientid)).readers[clientid] = Position(acked)
            return
        if reading := self._reading.get(clientid):
            reading.void = True
        self._ahead.pop(clientid, None)
        lag = self.queues.setdefault(clientid, QueueLag(acked))
        lag.floor, lag.above, lag.gone = acked, None, None
        lag.oldest_seqno = lag.oldest_ms = 0  # unknown until the recount: no event may take it for the oldest
        self._dirty[clientid] = True

    def forgotten(self, clientid: str) -> None:
        """State GC forgot an empty queue (it starts again at seqno 1 with nothing acked) or an SCQ reader's
        position (followed no more)."""
        self._note(clientid)
        if is_position_id(clientid):
            if (scq := self._scqs.get(queue_of_position(clientid))) is not None:
                scq.readers.pop(clientid, None)
            return
        self._ahead.pop(clientid, None)
        if clientid not in self._reading:
            self._dirty.pop(clientid, None)
            self.queues.pop(clientid, None)

    def delivered(self, clientid: str, message: Message, attempt: int) -> None:
        """A send changes no lag; the first one to an SCQ reader not followed yet makes the index follow it."""
        self._follow_reader(clientid)

    def _scq_sums(self) -> tuple[int, int]:
        """(pending entries over every SCQ reader's position, the oldest one's publish ms, 0 when none), computed
        again only when the index changed since the last call. O(readers x log entries)."""
        if self._scq_summed is None:
            lags = [lag for scq in self._scqs.values() for _position, lag in scq.lags()]
            self._scq_summed = (sum(lag[0] for lag in lags), min((lag[3] for lag in lags), default=0))
        return self._scq_summed

    def _scq(self, queue: str) -> ScqLag:
        """The :class:`ScqLag` of the SCQ ``queue`` (its queue id), made when first heard of (recording what is heard
        while a rescan runs)."""
        if (scq := self._scqs.get(queue)) is None:
            scq = self._scqs[queue] = ScqLag()
            if self._touched is not None:
                scq.recorded = []
        return scq

    def _follow_reader(self, clientid: str) -> None:
        """Follow the position ``clientid`` of an SCQ reader first heard of (a reader new to its queue, which has no
        stored state yet): from its consumer's state. Nothing for a queue id."""
        if not is_position_id(clientid):
            return
        if clientid not in self._scq(queue_of_position(clientid)).readers \
                and (consumer := self._consumers.get(clientid)) is not None:
            self.saved_elsewhere(clientid, consumer.state)

    def skipped(self, clientid: str, message: Message, reason: str) -> None:
        """Nothing to do: a skipped entry stays pending."""

    def store_error(self, op: str, exc: Exception) -> None:
        """Nothing to do."""

    def gc_started(self) -> None:
        """Nothing to do."""

    # --- applying reads -----------------------------------------------------------------------------

    def _apply_oldest(self, clientid: str, lag: QueueLag, read: QueueRead, reading: _Reading) -> None:
        if lag.pending <= 0:
            return
        if oldest := self._first_pending(lag, read.candidates, reading, read.last_read):
            lag.oldest_seqno, lag.oldest_ms = oldest
            lag.raise_floor(oldest[0] - 1)
        elif not read.complete:  # every entry read is acked or deleted by now: go on from there
            lag.raise_floor(read.last_read)
            self._dirty.setdefault(clientid, False)
        else:  # the count says pending, the store holds none: the count drifted
            self._dirty[clientid] = True

    def _apply_recount(self, clientid: str, lag: QueueLag, read: QueueRead, reading: _Reading) -> None:
        if read.ahead and not reading.appended:
            self._ahead[clientid] = lag.floor
        counted = [(size, seqno) for seqno, size, _ts in reading.appended if seqno <= read.last_read]
        lag.pending = read.pending + (lag.pending - reading.pending) - len(counted)
        lag.bytes = read.bytes + (lag.bytes - reading.bytes) - sum(size for size, _seqno in counted)
        if any(seqno <= read.last_read for seqno in reading.removed) or lag.pending < 0 or lag.bytes < 0:
            self._dirty[clientid] = True  # deleted before or after the read saw it? read again
        if oldest := self._first_pending(lag, read.candidates, reading, read.last_read):
            lag.oldest_seqno, lag.oldest_ms = oldest
            lag.raise_floor(oldest[0] - 1)
        elif lag.pending > 0:
            cut = len(read.candidates) == OLDEST_CANDIDATES  # more pending entries were read than kept
            lag.raise_floor(read.candidates[-1][0] if cut else read.last_read)
            self._dirty.setdefault(clientid, False)
        else:
            lag.oldest_seqno = lag.oldest_ms = 0

    @staticmethod
    def _first_pending(lag: QueueLag, candidates: Iterable[tuple[int, int]], reading: _Reading,
                       last_read: int) -> tuple[int, int] | None:
        """The first of ``candidates`` or of the entries appended during the read that is still pending."""
        later = [(seqno, ts) for seqno, _size, ts in reading.appended if seqno > last_read]
        for seqno, ts in (*candidates, *later):
            if lag.is_pending(seqno) and seqno not in reading.removed:
                return seqno, ts
        return None

    def _recount_due(self, clientid: str) -> bool:
        reading = self._reading.get(clientid)
        return self._dirty.get(clientid) is True or (reading is not None and reading.recount)

    def _note(self, clientid: str) -> None:
        """Every observer call starts here: the queue of ``clientid`` may change."""
        self._summed = self._scq_summed = None
        if self._touched is not None:
            self._touched.add(clientid)

    def _forget_if_idle(self, clientid: str) -> None:
        """Drop a queue with nothing pending (and nothing left to read for it)."""
        lag = self.queues.get(clientid)
        if lag is None or lag.pending > 0 or clientid in self._reading or self._recount_due(clientid):
            return
        self._dirty.pop(clientid, None)
        del self.queues[clientid]
