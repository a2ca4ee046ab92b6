"""An ``asyncio.Event`` that costs a few dozen bytes until something waits on it.

``asyncio.Event`` gives each instance a ``collections.deque`` of waiters from the start: 760 bytes on CPython 3.11,
even while nobody waits. A fleet's connections each held a few events (a consumer's wake-up, since then a callback;
amqtt's reader ready and stopped), most of them never or rarely waited on, so those deques were about 2.3 KiB of
every connected consumer (``scripts/benchlib/heapprobe.py --trace``).
"""

from __future__ import annotations

import asyncio


class LeanEvent:
    """``asyncio.Event``'s interface (``set``, ``clear``, ``is_set``, awaitable ``wait``) with its waiters in a list
    made at the first wait and dropped once the last waiter leaves. Like ``asyncio.Event``, ``set`` wakes every
    waiter and a later ``wait`` returns at once until ``clear``; ``wait`` returns True and may be cancelled. It binds
    to the running loop of its first waiter, as ``asyncio.Event`` does (Python 3.10 and later)."""

    __slots__ = ("_value", "_waiters")

    def __init__(self) -> None:
        self._value = False
        self._waiters: list[asyncio.Future] | None = None

    def is_set(self) -> bool:
        """True once :meth:`set` was called and :meth:`clear` not since."""
        return self._value

    def set(self) -> None:
        """Set the event and wake every waiter."""
        if self._value:
            return
        self._value = True
        for waiter in self._waiters or ():
            if not waiter.done():
                waiter.set_result(True)

    def clear(self) -> None:
        """Unset the event: the next :meth:`wait` waits for a :meth:`set`."""
        self._value = False

    async def wait(self) -> bool:
        """Return True once the event is set (at once if it is)."""
        if self._value:
            return True
        waiter = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = [waiter]
        else:
            self._waiters.append(waiter)
        try:
            await waiter
            return True
        finally:
            self._waiters.remove(waiter)
            if not self._waiters:
                self._waiters = None
