"""Timeouts for many futures at the cost of one timer per event-loop iteration.

``asyncio.wait_for`` arms a timer per call; with one per write and one per store read, timer handles
were ~10 % of the event loop in the latency benchmark's profile. Futures registered during the same
loop iteration with the same timeout expire together, so they can share one timer.
"""

from __future__ import annotations

import asyncio


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
