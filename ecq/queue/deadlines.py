"""Deadlines of many things at the cost of one timer, not one each.

``asyncio.wait_for`` arms a timer per call; with one per write and one per store read, timer handles
were ~10 % of the event loop in the latency benchmark's profile. Futures registered during the same
loop iteration with the same timeout expire together, so they can share one timer (:class:`SharedDeadline`).

Things that each have their own deadline, far apart (the expiry of each offline session), share one heap
(:class:`DeadlineHeap`): one live deadline per key, whoever set it last, and whoever sweeps it sleeps until the
earliest.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Hashable
from typing import Any


class SharedDeadline:
    """Fails a watched future with TimeoutError when it is still pending ``timeout_s`` seconds (at most one
    event-loop iteration more) after :meth:`watch`. Use from one event loop only."""

    def __init__(self, timeout_s: float, what: str) -> None:
        self.timeout_s = timeout_s
        self._what = what
        self._watched: list[asyncio.Future] = []

    def watch(self, future: asyncio.Future) -> asyncio.Future:
        """Start the clock for ``future``; returns it."""
        if not self._watched:
            asyncio.get_running_loop().call_soon(self._arm)
        self._watched.append(future)
        return future

    def _arm(self) -> None:
        futures, self._watched = self._watched, []
        asyncio.get_running_loop().call_later(self.timeout_s, self._expire, futures)

    def _expire(self, futures: list[asyncio.Future]) -> None:
        for future in futures:
            if not future.done():
                future.set_exception(TimeoutError(f"{self._what} took longer than {self.timeout_s:g} s"))


class DeadlineHeap:
    """One live deadline per key (a number in the caller's unit, e.g. epoch ms) with a value (what to do when it
    comes), in a heap: :meth:`set` replaces a key's deadline, :meth:`discard` drops it, :meth:`pop_due` takes the keys
    whose deadline has come. A replaced or dropped deadline stays in the heap as a stale entry, skipped when met and
    swept away once the stale ones outnumber the live ones (:data:`STALE_SLACK` beyond), so the heap holds at most
    about twice the live keys. ``on_earlier`` is called when a :meth:`set` makes a deadline the earliest (to wake a
    sweeper sleeping until the one before). Keys must be orderable among themselves (ties of deadlines compare them).
    Use from one thread only."""

    STALE_SLACK = 64  # stale entries allowed beyond the live ones before the heap is rebuilt

    def __init__(self, on_earlier: Callable[[], None] | None = None) -> None:
        self._heap: list[tuple[float, Hashable]] = []
        self._live: dict[Hashable, tuple[float, Any]] = {}  # key -> (its deadline, its value)
        self._on_earlier = on_earlier

    def __len__(self) -> int:
        """How many keys have a live deadline."""
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    @property
    def entries(self) -> int:
        """How many entries the heap holds, stale ones included (at most ``2 * len(self) + STALE_SLACK``)."""
        return len(self._heap)

    def set(self, key: Hashable, deadline: float, value: Any = None) -> None:
        """Make ``deadline`` the one live deadline of ``key``, with ``value``."""
        self._live[key] = (deadline, value)
        heapq.heappush(self._heap, (deadline, key))
        if self._heap[0] == (deadline, key) and self._on_earlier is not None:
            self._on_earlier()
        self._sweep_stale()

    def discard(self, key: Hashable) -> None:
        """Drop ``key``'s deadline, if it has one."""
        if self._live.pop(key, None) is not None:
            self._sweep_stale()

    def next_deadline(self) -> float | None:
        """The earliest live deadline, None when there is none."""
        while self._heap and not self._is_live(*self._heap[0]):
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[tuple[Hashable, Any]]:
        """``[(key, value)]`` of the keys whose live deadline is at or before ``now``, earliest first; they no longer
        have one."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            deadline, key = heapq.heappop(self._heap)
            if self._is_live(deadline, key):
                due.append((key, self._live.pop(key)[1]))
        self._sweep_stale()
        return due

    def _is_live(self, deadline: float, key: Hashable) -> bool:
        live = self._live.get(key)
        return live is not None and live[0] == deadline

    def _sweep_stale(self) -> None:
        if len(self._heap) > 2 * len(self._live) + self.STALE_SLACK:
            self._heap = [(deadline, key) for key, (deadline, _value) in self._live.items()]
            heapq.heapify(self._heap)
