"""Log lines for repeated failures, at most one per interval, each saying how many were held back."""

from __future__ import annotations

import time


class LogThrottle:
    """Say yes at most once per ``interval_s`` seconds (time.monotonic) to "log this failure now?"."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._next_at = float("-inf")
        self._held_back = 0

    def due(self) -> int | None:
        """None when this occurrence is to be held back; otherwise how many were held back since the last
        logged one (then the next interval starts)."""
        now = time.monotonic()
        if now < self._next_at:
            self._held_back += 1
            return None
        held, self._next_at, self._held_back = self._held_back, now + self.interval_s, 0
        return held
