"""The lag index's values and blocking reads (reader threads), and the ``ecq top`` answer: one queue's lag, the
whole-store scan at engine start, the reads of dirty queues, and the ranking of lagging queues (see
ecq.queue.lag for how the index is kept)."""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any, NamedTuple

from ecq.queue.topics import SCQ_PREFIX, is_position_id, is_scq_queue_id, queue_of_position, scq_queue_id
from ecq.store.protocol import QueueStore

OLDEST_CANDIDATES = 64    # pending entries one dirty-queue read returns: acks arriving meanwhile may use up some
TOP_ORDERS = ("pending", "age", "bytes")
TOP_MAX = 1000            # most queues one top answer lists
_NOTHING: frozenset[int] = frozenset()


class QueueLag:
    """The pending entries of one queue: ``pending`` (count), ``bytes`` (payload), the oldest one's ``oldest_seqno``
    and ``oldest_ms`` (publish time, ms since the epoch); ``floor``, ``above`` and ``gone`` decide whether a seqno
    is pending (see :meth:`is_pending`)."""

    __slots__ = ("pending", "bytes", "oldest_seqno", "oldest_ms", "floor", "above", "gone")

    def __init__(self, floor: int, above: set[int] | None = None) -> None:
        self.pending = self.bytes = self.oldest_seqno = self.oldest_ms = 0
        self.floor, self.above, self.gone = floor, above, None

    def is_pending(self, seqno: int) -> bool:
        """True when stored entry ``seqno`` is pending: above the floor, not acked out of order, not deleted."""
        return seqno > self.floor and not (self.above and seqno in self.above) \
            and not (self.gone and seqno in self.gone)

    def skipped(self) -> frozenset[int]:
        """The seqnos above the floor that are not pending (acked out of order, or deleted)."""
        return frozenset(self.above or ()) | frozenset(self.gone or ())

    def raise_floor(self, floor: int) -> None:
        """Every stored seqno at or below ``floor`` is not pending: forget what is known of those."""
        if floor > self.floor:
            self.floor = floor
            self.above = {s for s in self.above if s > floor} or None if self.above else None
            self.gone = {s for s in self.gone if s > floor} or None if self.gone else None

    def as_tuple(self) -> tuple[int, int, int, int]:
        """(pending, bytes, oldest seqno, oldest publish ms), e.g. to compare two indexes."""
        return self.pending, self.bytes, self.oldest_seqno, self.oldest_ms


class QueueRead(NamedTuple):
    """What one read of a queue found above its floor: pending entries and bytes (a whole read only), the first
    pending ones as (seqno, publish ms), the last seqno read, and whether it read to the queue's end."""

    pending: int
    bytes: int
    candidates: list[tuple[int, int]]
    last_read: int
    complete: bool
    ahead: bool = False  # a whole read found the floor above the queue's last seqno (a rewind past its end)


def scan_lag(store: QueueStore, live: Mapping[str, tuple[int, frozenset[int]]],
             ahead: dict[str, int] | None = None, positions: dict[str, set[str]] | None = None) -> dict[str, QueueLag]:
    """The lag of every queue from one pass over the stored entries, judged by the stored ack states or, for the
    clientids in ``live``, by (acked seqno, seqnos acked above it) given there. An SCQ's entries are counted once
    for each of its readers' positions (ecq.queue.topics.position_id), under the position id; the SCQ's queue id,
    read by no consumer of its own, is never listed. Blocking; O(stored entries x readers of their queue).
    Fills ``ahead`` with the queues whose acked seqno is past their last seqno (a rewind to a seqno N past the
    end): their next writes up to it are never delivered, so not pending; fills ``positions`` with each SCQ queue
    id's readers' position ids (those with a stored or live state)."""
    states: dict[str, tuple[int, Any]] = {cid: (state.acked, state.above) for cid, state in store.ack_states()}
    states.update(live)
    readers: dict[str, set[str]] = {}
    for stored_id in states:
        if is_position_id(stored_id):
            readers.setdefault(queue_of_position(stored_id), set()).add(stored_id)
    if positions is not None:
        positions.update(readers)
    queues: dict[str, QueueLag] = {}
    last_stored: dict[str, int] = {}
    for clientid, seqno, ts_ms, size in store.stored_entries():
        last_stored[clientid] = seqno
        for owner in readers.get(clientid, ()) if is_scq_queue_id(clientid) else (clientid,):
            _count_entry(queues, owner, states.get(owner, (0, _NOTHING)), seqno, ts_ms, size)
    if ahead is not None:
        ahead.update((cid, acked) for cid, (acked, _above) in states.items()
                     if acked > last_stored.get(cid, 0) and not is_position_id(cid) and acked > store.last_seqno(cid))
    return queues


def _count_entry(queues: dict[str, QueueLag], owner: str, state: tuple[int, Any], seqno: int, ts_ms: int,
                 size: int) -> None:
    acked, above = state
    if seqno <= acked or seqno in above:
        return
    lag = queues.get(owner)
    if lag is None:  # each queue's entries come in seqno order: this is its oldest pending one
        lag = queues[owner] = QueueLag(seqno - 1, {s for s in above if s > seqno} or None)
        lag.oldest_seqno, lag.oldest_ms = seqno, ts_ms
    lag.pending += 1
    lag.bytes += size


def read_queues(store: QueueStore, requests: list[tuple[str, int, frozenset[int], bool]]) -> list[QueueRead]:
    """For each (clientid, floor, seqnos not pending, whole) the :class:`QueueRead` of that queue above its floor:
    with ``whole`` every entry (a recount), otherwise up to OLDEST_CANDIDATES pending ones. Blocking."""
    return [read_queue(store, *request) for request in requests]


def read_queue(store: QueueStore, clientid: str, floor: int, skipped: frozenset[int], whole: bool) -> QueueRead:
    """One queue's :class:`QueueRead` (see :func:`read_queues`); for an SCQ reader's position, of its SCQ's entries."""
    queue = queue_of_position(clientid)
    pending = size = 0
    candidates: list[tuple[int, int]] = []
    last_read, complete = floor, True
    for _clientid, seqno, ts_ms, entry_size in store.stored_entries(queue, floor):
        if seqno not in skipped:
            if not whole and len(candidates) == OLDEST_CANDIDATES:
                complete = False
                break
            pending, size = pending + 1, size + entry_size
            if len(candidates) < OLDEST_CANDIDATES:
                candidates.append((seqno, ts_ms))
        last_read = seqno
    ahead = whole and last_read == floor and floor > store.last_seqno(queue)
    return QueueRead(pending, size, candidates, last_read, complete, ahead)


def check_top(n: int, by: str) -> None:
    """Raise ValueError unless 1 <= ``n`` <= TOP_MAX and ``by`` is one of TOP_ORDERS."""
    if not 1 <= n <= TOP_MAX:
        raise ValueError(f"n must be from 1 to {TOP_MAX}, not {n}")
    if by not in TOP_ORDERS:
        raise ValueError(f"by must be one of {', '.join(TOP_ORDERS)}, not {by!r}")


def top_report(queues: Mapping[str, QueueLag], n: int, by: str, at_ms: int, scq: str | None = None) -> dict[str, Any]:
    """What ``ecq top`` shows: ``by``, ``pending`` (entries over every queue), ``lagging`` (queues with pending
    entries), ``oldest_pending_age_s`` (seconds at ``at_ms``, null when none) and ``queues``: the ``n`` queues
    with the most pending entries (``by="pending"``), the oldest pending entry (``age``) or the most pending
    payload bytes (``bytes``), ties by clientid, each as clientid, pending, pending_bytes, oldest_pending_age_s
    (the keys of ``ecq inspect``) and ``kind``: ``ecq``, or ``scq`` for an SCQ reader's position, whose row also
    has ``queue`` (the SCQ's name) and ``reader`` (its client id; ``clientid`` is the position id). With ``scq``
    (an SCQ's name), only that SCQ's readers: its slowest readers, and the summary over them (``scq`` added)."""
    if scq is not None:
        queue_id = scq_queue_id(scq)
        queues = {cid: lag for cid, lag in queues.items() if is_position_id(cid) and queue_of_position(cid) == queue_id}
    order = {"pending": lambda item: (item[1].pending, -item[1].oldest_ms),
             "age": lambda item: (-item[1].oldest_ms, item[1].pending),
             "bytes": lambda item: (item[1].bytes, item[1].pending)}[by]
    ranked = heapq.nlargest(n, sorted(queues.items()), key=order)
    oldest = min((lag.oldest_ms for lag in queues.values()), default=0)
    report = {"by": by, "pending": sum(lag.pending for lag in queues.values()), "lagging": len(queues),
              "oldest_pending_age_s": _age_s(at_ms, oldest) if oldest else None,
              "queues": [_top_row(clientid, lag, at_ms) for clientid, lag in ranked]}
    return report if scq is None else {**report, "scq": scq}


def scq_summary(queues: Mapping[str, QueueLag], positions: Mapping[str, set[str]], n: int, slowest: int,
                at_ms: int) -> list[dict[str, Any]]:
    """What the dashboard's SCQ panel shows: the ``n`` SCQs with the most pending entries over their readers (ties by
    name) among those whose readers ``positions`` (SCQ queue id -> position ids followed) holds, each as ``queue``
    (its name), ``readers`` (positions followed), and :func:`top_report` with ``scq`` over its readers at ``at_ms``:
    ``pending``, ``lagging``, ``oldest_pending_age_s`` and ``slowest``, its ``slowest`` readers' rows (most pending
    first). One pass over ``queues``, then one per SCQ listed."""
    pending = dict.fromkeys(positions, 0)
    for clientid, lag in queues.items():
        if is_position_id(clientid):
            queue_id = queue_of_position(clientid)
            pending[queue_id] = pending.get(queue_id, 0) + lag.pending
    rows = []
    for queue_id, _ in heapq.nsmallest(n, pending.items(), key=lambda item: (-item[1], item[0])):
        name = queue_id[len(SCQ_PREFIX):]
        report = top_report(queues, slowest, "pending", at_ms, name)
        rows.append({"queue": name, "readers": len(positions.get(queue_id, ())), "pending": report["pending"],
                     "lagging": report["lagging"], "oldest_pending_age_s": report["oldest_pending_age_s"],
                     "slowest": report["queues"]})
    return rows


def _top_row(clientid: str, lag: QueueLag, at_ms: int) -> dict[str, Any]:
    row = {"clientid": clientid, "pending": lag.pending, "pending_bytes": lag.bytes,
           "oldest_pending_age_s": _age_s(at_ms, lag.oldest_ms), "kind": "ecq"}
    if is_position_id(clientid):
        queue_id = queue_of_position(clientid)
        row.update(kind="scq", queue=queue_id[len(SCQ_PREFIX):], reader=clientid[len(queue_id) + 1:])
    return row


def _age_s(at_ms: int, ts_ms: int) -> float:
    return round((at_ms - ts_ms) / 1000, 3)
