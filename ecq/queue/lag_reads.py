"""The lag index's values and blocking reads (reader threads), and the ``ecq top`` answer: one queue's lag, the
whole-store scan at engine start, the reads of dirty queues, and the ranking of lagging queues (see
ecq.queue.lag for how the index is kept)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from ecq.queue.lag_scq import Entry, Position, ScqLag
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


class Scan(NamedTuple):
    """What one pass over the store found (:func:`scan_store`)."""

    queues: dict[str, QueueLag]  # ECQ queues with pending entries
    scqs: dict[str, list[Entry]]  # SCQ queue id -> its stored entries, in seqno order
    positions: dict[str, tuple[int, Any]]  # SCQ readers' position id -> (acked seqno, seqnos acked above it)
    ahead: dict[str, int]  # ECQ queues whose acked seqno is past their last seqno: that acked seqno


def scan_store(store: QueueStore, live: Mapping[str, tuple[int, frozenset[int]]]) -> Scan:
    """One pass over the stored entries: the lag of every ECQ queue, judged by the stored ack states or, for the
    clientids in ``live``, by (acked seqno, seqnos acked above it) given there; every SCQ's stored entries and its
    readers' positions (ecq.queue.topics.position_id, those with a stored or live state). Blocking; O(stored
    entries). ``ahead`` lists the queues rewound to a seqno N past their end: their next writes up to N are never
    delivered, so not pending."""
    states: dict[str, tuple[int, Any]] = {cid: (state.acked, state.above) for cid, state in store.ack_states()}
    states.update(live)
    queues: dict[str, QueueLag] = {}
    scqs: dict[str, list[Entry]] = {}
    last_stored: dict[str, int] = {}
    for clientid, seqno, ts_ms, size in store.stored_entries():
        last_stored[clientid] = seqno
        if is_scq_queue_id(clientid):
            scqs.setdefault(clientid, []).append((seqno, size, ts_ms))
        else:
            _count_entry(queues, clientid, states.get(clientid, (0, _NOTHING)), seqno, ts_ms, size)
    ahead = {cid: acked for cid, (acked, _above) in states.items()
             if acked > last_stored.get(cid, 0) and not is_position_id(cid) and acked > store.last_seqno(cid)}
    positions = {cid: state for cid, state in states.items() if is_position_id(cid)}
    return Scan(queues, scqs, positions, ahead)


def scan_lag(store: QueueStore, live: Mapping[str, tuple[int, frozenset[int]]]) -> dict[str, QueueLag]:
    """The lag of every queue (:func:`scan_store`), each SCQ reader's position's under its position id (an SCQ's
    queue id, read by no consumer of its own, is never listed). Blocking."""
    scan = scan_store(store, live)
    return {**scan.queues, **reader_lags(scq_lags(scan).values())}


def scq_lags(scan: Scan) -> dict[str, ScqLag]:
    """Each SCQ's :class:`ScqLag` (its stored entries and readers) from ``scan``."""
    scqs: dict[str, ScqLag] = {}
    for queue, entries in scan.scqs.items():
        scqs[queue] = ScqLag()
        scqs[queue].reload(entries)
    for position_id, (acked, above) in scan.positions.items():
        scqs.setdefault(queue_of_position(position_id), ScqLag()).readers[position_id] = Position(acked, above)
    return scqs


def reader_lags(scqs: Iterable[ScqLag]) -> dict[str, QueueLag]:
    """The :class:`QueueLag` of every SCQ reader's position with pending entries, under its position id."""
    lags: dict[str, QueueLag] = {}
    for scq in scqs:
        for position_id, (pending, size, oldest_seqno, oldest_ms) in scq.lags():
            lag = lags[position_id] = QueueLag(oldest_seqno - 1)
            lag.pending, lag.bytes, lag.oldest_seqno, lag.oldest_ms = pending, size, oldest_seqno, oldest_ms
    return lags


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


def scq_entries(store: QueueStore, queue: str) -> list[Entry]:
    """The stored entries of the SCQ ``queue`` (its queue id) as (seqno, payload bytes, publish ms). Blocking."""
    return [(seqno, size, ts_ms) for _queue, seqno, ts_ms, size in store.stored_entries(queue, 0)]


def read_queues(store: QueueStore, requests: list[tuple[str, int, frozenset[int], bool]]) -> list[QueueRead]:
    """For each (clientid, floor, seqnos not pending, whole) the :class:`QueueRead` of that queue above its floor:
    with ``whole`` every entry (a recount), otherwise up to OLDEST_CANDIDATES pending ones. Blocking."""
    return [read_queue(store, *request) for request in requests]


def read_queue(store: QueueStore, clientid: str, floor: int, skipped: frozenset[int], whole: bool) -> QueueRead:
    """One ECQ queue's :class:`QueueRead` (see :func:`read_queues`)."""
    pending = size = 0
    candidates: list[tuple[int, int]] = []
    last_read, complete = floor, True
    for _clientid, seqno, ts_ms, entry_size in store.stored_entries(clientid, floor):
        if seqno not in skipped:
            if not whole and len(candidates) == OLDEST_CANDIDATES:
                complete = False
                break
            pending, size = pending + 1, size + entry_size
            if len(candidates) < OLDEST_CANDIDATES:
                candidates.append((seqno, ts_ms))
        last_read = seqno
    ahead = whole and last_read == floor and floor > store.last_seqno(clientid)
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
