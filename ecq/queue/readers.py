"""Blocking store reads off the event loop, batched: the reads asked for during one event-loop iteration
run together in one thread hop.

A hop to a thread pool costs the event loop tens of microseconds (a concurrent Future, a queue put, a
wake-up through the loop's self-pipe) and makes the loop and the thread trade the GIL. With a thousand
consumers each reading a few messages, that hop cost more than the reads (measured in the reads benchmark's profile).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class BatchedReader:
    """Runs blocking read functions in ``threads`` worker threads, one thread hop per event-loop iteration.

    Use from one event loop only. :meth:`shutdown` waits for reads already running in threads.
    """

    def __init__(self, threads: int, thread_name_prefix: str = "ecq-read") -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=thread_name_prefix)
        self._batch: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future]] = []

    def read(self, func: Callable[..., Any], *args: Any) -> asyncio.Future:
        """A future of ``func(*args)`` run in a worker thread: its result, or the exception it raised.

        Cancelling the future (or failing it, e.g. on a timeout) does not stop the read already queued.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._batch:
            loop.call_soon(self._submit_batch, loop)
        self._batch.append((func, args, future))
        return future

    def shutdown(self) -> None:
        """Stop taking reads and wait for the ones running in threads (call before the store closes)."""
        self._executor.shutdown(wait=True)

    def _submit_batch(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._batch = self._batch, []
        try:
            self._executor.submit(self._run_batch, loop, batch)
        except RuntimeError as exc:  # shut down: the broker is closing
            _settle([(future, None, exc) for _func, _args, future in batch])

    @staticmethod
    def _run_batch(loop: asyncio.AbstractEventLoop, batch: list) -> None:
        outcomes = []
        for func, args, future in batch:
            try:
                outcomes.append((future, func(*args), None))
            except Exception as exc:  # handed to the caller that asked for this read
                outcomes.append((future, None, exc))
        loop.call_soon_threadsafe(_settle, outcomes)


def _settle(outcomes: list) -> None:
    for future, result, exc in outcomes:
        if future.done():  # the caller gave up (timeout, cancelled)
            continue
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(exc)
