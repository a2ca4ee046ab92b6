"""Log lines for repeated failures, at most one per interval, each saying how many were held back."""

from __future__ import annotations

import time


class LogThrottle:
    """Say yes at most ``burst`` times per ``interval_s`` seconds (time.monotonic) to "log this failure now?"."""

    def __init__(self, interval_s: float, burst: int = 1) -> None:
        self.interval_s, self.burst = interval_s, burst
        self._window_ends = float("-inf")
        self._logged = 0
        self._held_back = 0

    def due(self) -> int | None:
        """None when this occurrence is to be held back; otherwise how many were held back since the last
        logged one. An interval starts with the first occurrence after the previous one ended."""
        now = time.monotonic()
        if now >= self._window_ends:
            self._window_ends, self._logged = now + self.interval_s, 0
        if self._logged >= self.burst:
            self._held_back += 1
            return None
        self._logged += 1
        held, self._held_back = self._held_back, 0
        return held
