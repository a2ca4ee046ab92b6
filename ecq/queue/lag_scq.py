"""The lag of an SCQ's readers (ecq.queue.lag): one structure of the SCQ's stored entries shared by its readers, so
that a write or a deletion costs O(log entries) however many read the SCQ, and each reader's lag is computed when
asked.

:class:`LiveEntries` holds an SCQ's stored entries (seqno, payload bytes, publish ms) in seqno order with two
Fenwick trees (counts and bytes over append slots), so the entries above a seqno are counted in O(log n) and the
k-th one found in O(log n). A reader (:class:`Position`) keeps only its *floor* (every entry at or below it is
acked) and the seqnos it acked above it. Its pending entries are the stored ones above the floor less those it
acked above it; its oldest pending one is the first stored entry above the floor it has not acked.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator

REBUILD_SLACK = 64  # deleted slots kept beyond the stored entries' count before the trees are rebuilt

Entry = tuple[int, int, int]  # (seqno, payload bytes, publish ms)


class LiveEntries:
    """The stored entries of one SCQ. Appends in seqno order are O(log n); a deletion is O(log n), plus an O(n)
    rebuild once deleted slots outnumber the entries (amortised O(1)); an append below the last seqno (notices of a
    cluster out of order) rebuilds."""

    __slots__ = ("_seqnos", "_sizes", "_stamps", "_slots", "_count", "_bytes")

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        self._build(sorted(entries))

    def _build(self, entries: list[Entry]) -> None:
        self._seqnos = [seqno for seqno, _size, _ts in entries]
        self._sizes = [size for _seqno, size, _ts in entries]
        self._stamps = [ts for _seqno, _size, ts in entries]
        self._slots = {seqno: slot for slot, seqno in enumerate(self._seqnos)}
        self._count, self._bytes = [0] * (len(entries) + 1), [0] * (len(entries) + 1)
        for index in range(1, len(entries) + 1):
            self._count[index] += 1
            self._bytes[index] += self._sizes[index - 1]
            if (parent := index + (index & -index)) <= len(entries):
                self._count[parent] += self._count[index]
                self._bytes[parent] += self._bytes[index]

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, seqno: int) -> bool:
        return seqno in self._slots

    def entries(self) -> Iterator[Entry]:
        """The stored entries, in seqno order."""
        return ((self._seqnos[slot], self._sizes[slot], self._stamps[slot]) for slot in sorted(self._slots.values()))

    def size(self, seqno: int) -> int:
        """Payload bytes of stored entry ``seqno`` (KeyError when not stored)."""
        return self._sizes[self._slots[seqno]]

    def add(self, seqno: int, size: int, ts_ms: int) -> None:
        """A stored entry (nothing when already there)."""
        if seqno in self._slots:
            return
        if self._seqnos and seqno < self._seqnos[-1]:
            self._build(sorted([*self.entries(), (seqno, size, ts_ms)]))
            return
        index = len(self._seqnos) + 1
        below = index - (index & -index)
        self._count.append(1 + _prefix(self._count, index - 1) - _prefix(self._count, below))
        self._bytes.append(size + _prefix(self._bytes, index - 1) - _prefix(self._bytes, below))
        self._slots[seqno] = len(self._seqnos)
        self._seqnos.append(seqno)
        self._sizes.append(size)
        self._stamps.append(ts_ms)

    def remove(self, seqno: int) -> None:
        """A deleted entry (nothing when not stored)."""
        if (slot := self._slots.pop(seqno, None)) is None:
            return
        index = slot + 1
        while index < len(self._count):
            self._count[index] -= 1
            self._bytes[index] -= self._sizes[slot]
            index += index & -index
        if len(self._seqnos) - len(self._slots) > len(self._slots) + REBUILD_SLACK:
            self._build(list(self.entries()))

    def above(self, floor: int) -> tuple[int, int]:
        """(entries, payload bytes) stored with a seqno above ``floor``. O(log n)."""
        below = bisect_right(self._seqnos, floor)
        return (_prefix(self._count, len(self._seqnos)) - _prefix(self._count, below),
                _prefix(self._bytes, len(self._seqnos)) - _prefix(self._bytes, below))

    def after(self, floor: int) -> Iterator[tuple[int, int]]:
        """(seqno, publish ms) of the stored entries above ``floor``, in seqno order, O(log n) each."""
        rank = _prefix(self._count, bisect_right(self._seqnos, floor))
        while (slot := self._kth(rank + 1)) is not None:
            yield self._seqnos[slot], self._stamps[slot]
            rank += 1

    def _kth(self, k: int) -> int | None:
        """The slot of the k-th stored entry (1-based), or None when fewer are stored."""
        position, step = 0, 1 << (len(self._count) - 1).bit_length()
        while step:
            if position + step < len(self._count) and self._count[position + step] < k:
                position += step
                k -= self._count[position]
            step >>= 1
        return position if position < len(self._seqnos) else None


def _prefix(tree: list[int], index: int) -> int:
    total = 0
    while index > 0:
        total += tree[index]
        index -= index & -index
    return total


class Position:
    """One SCQ reader's position as the index knows it: ``floor`` (every seqno at or below it acked) and ``above``
    (seqnos above the floor acked out of order, or acked before their write was heard of)."""

    __slots__ = ("floor", "above")

    def __init__(self, acked: int, above: Iterable[int] = ()) -> None:
        self.floor, self.above = acked, {seqno for seqno in above if seqno > acked}

    def ack(self, seqno: int, live: LiveEntries) -> None:
        """A PUBACK of ``seqno``: the floor climbs over the stored entries acked in a row. O(log n) per entry."""
        if seqno <= self.floor:
            return
        self.above.add(seqno)
        climbed = False
        for next_seqno, _ts in live.after(self.floor):
            if next_seqno not in self.above:
                break
            self.floor, climbed = next_seqno, True
        if climbed:
            self.above = {acked for acked in self.above if acked > self.floor}

    def holds(self, seqno: int, live: LiveEntries) -> bool:
        """True while stored entry ``seqno`` is pending here. O(1)."""
        return seqno > self.floor and seqno in live and seqno not in self.above

    def lag(self, live: LiveEntries) -> tuple[int, int, int, int]:
        """(pending entries, their payload bytes, oldest pending seqno, its publish ms; 0, 0 when none).
        O(log n x (acked above + 1))."""
        pending, size = live.above(self.floor)
        for seqno in self.above:
            if seqno in live:
                pending, size = pending - 1, size - live.size(seqno)
        if pending <= 0:
            return 0, 0, 0, 0
        oldest = next(((s, ts) for s, ts in live.after(self.floor) if s not in self.above), (0, 0))
        return pending, size, *oldest


class ScqLag:
    """One SCQ as the lag index follows it: ``live`` (its stored entries), ``readers`` (position id ->
    :class:`Position`, the readers followed) and ``recorded``: while its entries are read again, the changes heard
    meanwhile, replayed on what the read found (:meth:`reload`)."""

    __slots__ = ("live", "readers", "recorded")

    def __init__(self) -> None:
        self.live, self.readers = LiveEntries(), {}
        self.recorded: list[tuple[bool, int, int, int]] | None = None  # (added, seqno, payload bytes, publish ms)

    def add(self, seqno: int, size: int, ts_ms: int) -> None:
        """A write stored entry ``seqno``."""
        self.live.add(seqno, size, ts_ms)
        if self.recorded is not None:
            self.recorded.append((True, seqno, size, ts_ms))

    def remove(self, seqno: int) -> None:
        """Entry ``seqno`` was deleted."""
        self.live.remove(seqno)
        if self.recorded is not None:
            self.recorded.append((False, seqno, 0, 0))

    def reload(self, entries: Iterable[Entry]) -> None:
        """The stored entries as a read found them, with the changes recorded since it started applied on top (an
        entry the read saw and a change also names counts once)."""
        live = LiveEntries(entries)
        for added, seqno, size, ts_ms in self.recorded or ():
            (live.add(seqno, size, ts_ms) if added else live.remove(seqno))
        self.live, self.recorded = live, None

    def lags(self) -> Iterator[tuple[str, tuple[int, int, int, int]]]:
        """(position id, :meth:`Position.lag`) of each reader followed with pending entries; computed once per floor
        for the readers with no acks above it (a fleet's caught-up readers share one floor)."""
        by_floor: dict[int, tuple[int, int, int, int]] = {}
        for position_id, position in self.readers.items():
            if position.above:
                lag = position.lag(self.live)
            elif (lag := by_floor.get(position.floor)) is None:
                lag = by_floor[position.floor] = position.lag(self.live)
            if lag[0]:
                yield position_id, lag
