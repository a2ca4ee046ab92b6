"""The one clock of ECQ: wall-clock milliseconds, and the retention cutoff derived from it.

Every ECQ timestamp (publish time, last ack, event time) is milliseconds since the Unix epoch. An entry
is expired once it was published before :func:`retention_cutoff_ms`: delivery skips it and GC deletes it,
so both must compute the cutoff the same way.
"""

from __future__ import annotations

import time


def now_ms() -> int:
    """Wall-clock time in milliseconds since the Unix epoch (the unit of every ECQ timestamp)."""
    return time.time_ns() // 1_000_000


def retention_cutoff_ms(retention_s: float, now: int | None = None) -> int:
    """The publish time in ms before which an entry is expired, for a retention of ``retention_s`` seconds
    (``data_retention``), at ``now`` ms (default: :func:`now_ms`)."""
    return (now_ms() if now is None else now) - int(retention_s * 1000)
