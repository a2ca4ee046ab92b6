"""The event recorder: the broker's record of what happens to each queue, buffered on disk in a ReplayQ
until `ecq.events.lake.LakeExporter` exports it (schema: ecq/events/schema.py).

Guarantees.

* `EventRecorder.record` never blocks on I/O and never raises: an event goes into an in-memory deque,
  and a background task moves the deque into a disk-mode ReplayQ (in ``buffer_dir``) from a worker
  thread. Events are analytics, so the ReplayQ runs with ``fsync="never"``: a buffered event survives
  a crash of the broker process (it is in the OS page cache), not a power cut. Measured: fsync on
  every append is 25-47x slower (ecq/events/replayq_config.py).
* Overload: the ReplayQ holds at most ``max_buffer_bytes`` (estimated as encoded event sizes); beyond
  that the oldest events are dropped and counted. The in-memory deque holds at most ``max_pending``
  events (oldest dropped, counted) in case the worker thread is stuck. `EventRecorder.stats` reports both.
* Export: the buffer is emptied into the lake exactly once by ecq/events/lake.py.

Threads: ReplayQ is not thread-safe, so the recorder and the exporter use it only from one shared
single-thread executor (`EventRecorder.call_with_queue`). `EventRecorder.record` may be called from any
thread; everything else must be called from the event loop that ran `EventRecorder.start`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ecq.events.atomic import write_atomically
from ecq.events.replayq import ReplayQ, ReplayQConfig
from ecq.events.schema import InvalidEvent, encode_event, encode_events

log = logging.getLogger(__name__)

STREAM_ID_FILE = "lake-stream-id"
_FLUSH_CHUNK = 10_000  # events per ReplayQ.append
CLOSE_TIMEOUT_S = 5.0  # seconds the recorder and the exporter wait for the queue thread when closing

T = TypeVar("T")


def read_stream_id(buffer_dir: Path) -> str:
    """The lake stream id of the event buffer in ``buffer_dir`` (16 hex digits), created on first use.

    Lake file names carry it, so two buffers (a wiped data dir, a second broker) writing to the same lake
    never overwrite or delete each other's files. Raises OSError when the file cannot be read or written.
    """
    path = buffer_dir / STREAM_ID_FILE
    try:
        stream_id = path.read_text().strip()
    except FileNotFoundError:
        stream_id = secrets.token_hex(8)
        write_atomically(path, stream_id.encode())
        return stream_id
    if not re.fullmatch(r"[0-9a-f]{16}", stream_id):
        raise OSError(f"{path} does not hold a stream id (16 hex digits); move it away to start a new stream")
    return stream_id


@dataclass
class _Counters:
    recorded: int = 0
    invalid: int = 0
    pending_dropped: int = 0  # the in-memory deque was full, or recording after close
    failed_items: int = 0  # a ReplayQ append failed (data dir disk full, ...)
    failed_bytes: int = 0
    exported_items: int = 0
    export_errors: int = 0
    lake_ok: bool = True


class EventRecorder:
    """Collects queue events from the broker into a disk-mode ReplayQ at ``buffer_dir``.

    ``max_buffer_bytes`` bounds the ReplayQ (overload drops the oldest events); ``max_pending`` bounds the
    in-memory deque between `record` and the ReplayQ (events); ``flush_interval_s`` is how often (seconds)
    the background task moves the deque into the ReplayQ. See the module docstring for the guarantees.

    Lifecycle: ``await start()``, then `record` from the broker, ``await close()``. A `LakeExporter`
    exports the buffered events; start it after the recorder and close it before.
    """

    def __init__(self, buffer_dir: Path, max_buffer_bytes: int = 256 * 1024 * 1024, *,
                 max_pending: int = 100_000, flush_interval_s: float = 0.05) -> None:
        self.buffer_dir = Path(buffer_dir)
        self.stream_id: str | None = None
        self._max_buffer_bytes = max_buffer_bytes
        self._max_pending = max_pending
        self._flush_interval_s = flush_interval_s
        self._pending: deque[tuple[int, str, dict[str, Any]]] = deque()
        self._counters = _Counters()
        self._queue: ReplayQ | None = None
        self._queue_state = (0, 0, 0, 0)  # items, bytes, dropped items, dropped bytes; set in the queue thread
        self._inflight = (0, 0)  # items, bytes popped by the exporter and not yet acked
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ecq-events")
        self._flush_task: asyncio.Task | None = None
        self._closed = False
        self._warned: set[str] = set()

    def record(self, type: str, **fields: Any) -> None:
        """Record one event of ``type`` (see `EVENT_TYPES`) with `SCHEMA` fields as keyword arguments.

        ``ts_ms`` defaults to now (ms since epoch). Constant time; never blocks and never raises: a full
        deque drops its oldest event, an invalid event is counted (``invalid`` in `stats`) and logged when
        it is moved into the ReplayQ, a record after `close` is counted as dropped.
        """
        try:
            if self._closed:
                self._counters.pending_dropped += 1
                return
            ts_ms = fields.pop("ts_ms", None)
            self._pending.append((time.time_ns() // 1_000_000 if ts_ms is None else ts_ms, type, fields))
            self._counters.recorded += 1
            if len(self._pending) > self._max_pending:
                self._pending.popleft()
                self._counters.pending_dropped += 1
        except Exception:  # noqa: BLE001 - recording must never fail the broker's write or delivery
            self._counters.pending_dropped += 1

    async def start(self) -> None:
        """Open the ReplayQ (in the queue thread) and start the background flush task.

        Raises ecq.events.replayq.ReplayQError (buffer already open, corrupt COMMIT) or OSError (cannot create
        ``buffer_dir``, unreadable ``lake-stream-id``); the buffer is left closed then.
        """
        config = ReplayQConfig(dir=self.buffer_dir, fsync="never", max_total_bytes=self._max_buffer_bytes)
        loop = asyncio.get_running_loop()
        self._queue = await loop.run_in_executor(self._executor, ReplayQ.open, config)
        try:
            self.stream_id = await self.call_with_queue(lambda _q: read_stream_id(self.buffer_dir))
        except BaseException:
            await self.call_with_queue(lambda queue: queue.close())
            self._queue = None
            raise
        self._flush_task = asyncio.create_task(self._flush_loop(), name="ecq-events-flush")

    async def call_with_queue(self, fn: Callable[[ReplayQ], T]) -> T:
        """Run ``fn(replayq)`` in the queue thread, the only thread that touches the ReplayQ; for
        `LakeExporter`. Raises RuntimeError before `start`, and whatever ``fn`` raises."""
        if self._queue is None:
            raise RuntimeError("EventRecorder.start() has not run")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._with_state, fn)

    def _with_state(self, fn: Callable[[ReplayQ], T]) -> T:
        try:
            return fn(self._queue)
        finally:
            dropped = self._queue.overflow_dropped()
            self._queue_state = (self._queue.count(), self._queue.bytes(), dropped.items, dropped.bytes)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self._flush_interval_s)
            if self._pending:
                try:
                    await self.call_with_queue(self.flush_pending)
                except Exception:  # noqa: BLE001 - keep flushing; the failure is logged
                    log.exception("ECQ events: moving events into the buffer failed")

    def flush_pending(self, queue: ReplayQ) -> None:
        """Move every recorded event into ``queue`` (queue thread only). Invalid events are counted and
        skipped; a failed append drops its events and counts them (the broker must keep running)."""
        while self._pending:
            events = [self._pending.popleft() for _ in range(min(len(self._pending), _FLUSH_CHUNK))]
            try:
                items = encode_events(events)
            except InvalidEvent:
                items = self._encode_each(events)
            try:
                queue.append(items)
            except OSError as exc:
                self._counters.failed_items += len(items)
                self._counters.failed_bytes += sum(map(len, items))
                log.error("ECQ events: cannot buffer %d events in %s: %s", len(items), self.buffer_dir, exc)

    def _encode_each(self, events: list[tuple[int, str, dict[str, Any]]]) -> list[bytes]:
        """The valid ones of ``events`` encoded; each invalid one counted and its type's first logged."""
        items = []
        for ts_ms, type_, fields in events:
            try:
                items.append(encode_event(ts_ms, type_, fields))
            except InvalidEvent as exc:
                self._counters.invalid += 1
                self._warn_once(f"invalid:{type_}", "ECQ events: dropped an invalid event: %s", exc)
        return items

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message, *args)

    def set_inflight(self, items: int, nbytes: int) -> None:
        """Told by `LakeExporter` how many events (and bytes) it popped and has not acked yet."""
        self._inflight = (items, nbytes)

    def note_export(self, exported_items: int = 0, error: bool = False) -> None:
        """Told by `LakeExporter` of each export attempt: events acked, or a failure."""
        self._counters.exported_items += exported_items
        self._counters.export_errors += error
        self._counters.lake_ok = not error

    def stats(self) -> dict[str, Any]:
        """Counters since start, for metrics and ``ecq status``.

        ``recorded`` events given to `record`; ``dropped_items``/``dropped_bytes`` lost to overload (ReplayQ
        over ``max_buffer_bytes``, deque over ``max_pending``; the deque's drops add no bytes, their size
        is unknown) or to failed buffer writes; ``invalid`` events refused by the schema check;
        ``pending_items`` in memory; ``buffered_items``/``buffered_bytes`` in the ReplayQ and not yet in the
        lake (bytes are encoded sizes); ``exported_items`` landed in the lake; ``export_errors`` failed
        export attempts; ``lake_ok`` whether the last export attempt succeeded.
        """
        c = self._counters
        items, nbytes, dropped_items, dropped_bytes = self._queue_state
        inflight_items, inflight_bytes = self._inflight
        return {
            "recorded": c.recorded,
            "dropped_items": dropped_items + c.pending_dropped + c.failed_items,
            "dropped_bytes": dropped_bytes + c.failed_bytes,
            "invalid": c.invalid,
            "pending_items": len(self._pending),
            "buffered_items": items + inflight_items,
            "buffered_bytes": nbytes + inflight_bytes,
            "exported_items": c.exported_items,
            "export_errors": c.export_errors,
            "lake_ok": c.lake_ok,
        }

    async def close(self) -> None:
        """Stop the flush task, move what is pending into the ReplayQ and close it; idempotent.

        Waits at most a few seconds for the queue thread (a hung disk is logged, not waited for).
        """
        if self._closed:
            return
        self._closed = True
        if self._flush_task:
            self._flush_task.cancel()
            await asyncio.gather(self._flush_task, return_exceptions=True)
        if self._queue is not None:
            try:
                await asyncio.wait_for(self.call_with_queue(self._flush_and_close), CLOSE_TIMEOUT_S)
            except TimeoutError:
                log.error("ECQ events: buffer %s did not close within %.0f s", self.buffer_dir, CLOSE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - closing must go on (the broker is shutting down)
                log.exception("ECQ events: closing the buffer failed")
        self._executor.shutdown(wait=False)

    def _flush_and_close(self, queue: ReplayQ) -> None:
        try:
            self.flush_pending(queue)
        finally:
            queue.close()
