"""Queue events: the broker's record of what happens to each queue, buffered in a ReplayQ and exported
to a Parquet lake (issue 6, section 1; the buffer is SPEC.md section 2).

Schema (one Parquet table, `SCHEMA`, columns in this order; a column that does not apply to an event
type is null). Times are ms since the Unix epoch (UTC), sizes are bytes.

============== ====== ==================================================================================
column         type   meaning
============== ====== ==================================================================================
ts_ms          int64  when the event happened (ms); for ``acked`` the time of the PUBACK
type           string ``appended`` | ``compacted`` | ``delivered`` | ``acked`` | ``expired`` | ``refused``
clientid       string the queue's clientid; ``refused``: the target clientid if the topic names one
key            string the message's key
seqno          int64  ``appended``: the new seqno; ``compacted``: the NEW seqno that replaced the old one;
                      ``delivered``/``acked``/``expired``: the message's seqno
publish_ts_ms  int64  the message's publish (append) time in ms, for every type but ``refused``
payload_bytes  int64  the message's payload size in bytes (``appended``, ``delivered``, ``acked``, ...)
replaced_seqno int64  ``compacted`` only: the seqno that was deleted
attempt        int32  ``delivered`` only: 1 for the first send, 2+ for redeliveries
reason         string ``refused`` only: ``not_a_write``, ``empty_key``, ``bad_key``, ``payload_too_large``,
                      ``acl_denied``, ...
topic          string ``refused`` only: the PUBLISH topic
============== ====== ==================================================================================

Delivery latency from append to ack is ``acked.ts_ms - acked.publish_ts_ms`` (ms).

Lake layout: ``<lake_dir>/date=YYYY-MM-DD/hour=HH/part-<stream>-<segno>-<id>.parquet``, partitioned by
``ts_ms`` in UTC (Hive style, so Spark, pyarrow.dataset and DuckDB discover ``date`` and ``hour``).
``<stream>`` identifies the event buffer that wrote the file (16 hex digits, kept in
``<buffer_dir>/lake-stream-id``); ``<segno>-<id>`` (10 digits each) is the ReplayQ position of the last
event of the exported batch. A batch spanning several hours gives one file per hour, all with that name.
Files being written are hidden (``.part-...parquet.tmp``), which Spark and pyarrow skip.

Guarantees.

* `EventRecorder.record` never blocks on I/O and never raises: an event goes into an in-memory deque,
  and a background task moves the deque into a disk-mode ReplayQ (in ``buffer_dir``) from a worker
  thread. Events are analytics, so the ReplayQ runs with ``fsync="never"``: a buffered event survives
  a crash of the broker process (it is in the OS page cache), not a power cut. Measured: fsync on
  every append is 25-47x slower (ecq/replayq.py).
* Overload: the ReplayQ holds at most ``max_buffer_bytes`` (estimated as encoded event sizes); beyond
  that the oldest events are dropped and counted. The in-memory deque holds at most ``max_pending``
  events (oldest dropped, counted) in case the worker thread is stuck. `EventRecorder.stats` reports both.
* Export, exactly once: `LakeExporter` pops a batch, writes one Parquet file per hour to a temporary
  name, fsyncs it, renames it, fsyncs the directory, and only then acks the batch. While the lake
  cannot be written (missing, not a directory, read-only, disk full) it keeps the same batch and
  retries with exponential backoff (``interval_s`` doubling up to ``max_backoff_s``), while new events
  wait in the ReplayQ. A crash between rename and ack leaves files whose position is after the ReplayQ's
  COMMIT position; before its first export the exporter deletes exactly those files of its own stream,
  so the re-exported events land once. The lake directory itself is created by `LakeExporter.start`
  when missing; if it disappears later (an unmounted volume) it is treated as an outage, not recreated.

Threads: ReplayQ is not thread-safe, so the recorder and the exporter use it only from one shared
single-thread executor (`EventRecorder.call_with_queue`). `EventRecorder.record` may be called from any
thread; everything else must be called from the event loop that ran `EventRecorder.start`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ecq.events.replayq import AckRef, ReplayQ, ReplayQConfig

log = logging.getLogger(__name__)

EVENT_TYPES = frozenset({"appended", "compacted", "delivered", "acked", "expired", "refused"})
SCHEMA = pa.schema([
    pa.field("ts_ms", pa.int64(), nullable=False),
    pa.field("type", pa.string(), nullable=False),
    pa.field("clientid", pa.string()),
    pa.field("key", pa.string()),
    pa.field("seqno", pa.int64()),
    pa.field("publish_ts_ms", pa.int64()),
    pa.field("payload_bytes", pa.int64()),
    pa.field("replaced_seqno", pa.int64()),
    pa.field("attempt", pa.int32()),
    pa.field("reason", pa.string()),
    pa.field("topic", pa.string()),
])
COLUMNS = tuple(SCHEMA.names)
_OPTIONAL = COLUMNS[2:]  # the fields `record` takes besides ts_ms and type
_INT64 = (-(2**63), 2**63 - 1)
_INT32 = (-(2**31), 2**31 - 1)
_FIELD_RULES = {field.name: {pa.int64(): _INT64, pa.int32(): _INT32}.get(field.type)
                for field in SCHEMA if field.name in _OPTIONAL}  # None for a string column
_UNKNOWN = object()  # _FIELD_RULES.get() of a field not in SCHEMA
_encode_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # json.dumps builds one per call
_type_of = type  # encode_event's parameter ``type`` shadows the builtin

STREAM_ID_FILE = "lake-stream-id"
_PART = "part-{stream}-{segno:010d}-{id:010d}.parquet"
_PART_NAME = re.compile(r"\.?part-([0-9a-f]{16})-(\d{10})-(\d{10})\.parquet(\.tmp)?")
_MS_PER_HOUR = 3_600_000
_FLUSH_CHUNK = 10_000  # events per ReplayQ.append
_TABLE_CHUNK = 500  # events per JSON parse and per Arrow conversion when exporting
_CLOSE_TIMEOUT_S = 5.0

T = TypeVar("T")


class InvalidEvent(ValueError):
    """An event that does not fit `SCHEMA` (unknown type or field, wrong value type, out of range)."""


def encode_event(ts_ms: int, type: str, fields: dict[str, Any]) -> bytes:
    """One event as a ReplayQ item: a JSON array of the `COLUMNS` values, UTF-8.

    Raises InvalidEvent for an unknown type or field, a value of the wrong type (int for the int64/int32
    columns, str for the string columns, or None) or out of its column's range, and for strings that are
    not valid Unicode (lone surrogates). Checking here keeps bad events out of the lake export, where one
    of them would make a whole batch fail forever.
    """
    if type not in EVENT_TYPES:
        raise InvalidEvent(f"unknown event type {type!r}")
    _check_value("ts_ms", ts_ms, _INT64)
    for name, value in fields.items():
        rule = _FIELD_RULES.get(name, _UNKNOWN)
        if rule is _UNKNOWN:
            raise InvalidEvent(f"unknown event field {name!r} for {type!r}")
        if value is None or (_type_of(value) is str if rule is None else
                             _type_of(value) is int and rule[0] <= value <= rule[1]):
            continue  # the common case checked inline (it runs for every event); _check_value says what is wrong
        _check_value(name, value, rule)
    row = [ts_ms, type, *map(fields.get, _OPTIONAL)]
    try:
        return _encode_json(row).encode()
    except UnicodeEncodeError as exc:
        raise InvalidEvent(f"{type!r} event has a string that is not valid Unicode: {exc}") from None


def _check_value(name: str, value: Any, rule: tuple[int, int] | None) -> None:
    """``rule`` is None for a string column, else the int column's (lowest, highest) value."""
    if rule is None:
        if not isinstance(value, str):
            raise InvalidEvent(f"{name} must be a str, not {type(value).__name__}")
    elif not isinstance(value, int) or isinstance(value, bool):
        raise InvalidEvent(f"{name} must be an int, not {type(value).__name__}")
    elif not rule[0] <= value <= rule[1]:
        raise InvalidEvent(f"{name}={value} is out of range for its column")


def events_table(items: Sequence[bytes]) -> pa.Table:
    """Decode ReplayQ items made by `encode_event` into a pyarrow Table with `SCHEMA`, in item order.

    Works in chunks of `_TABLE_CHUNK` items: each JSON parse and array conversion is one C call that holds
    the GIL throughout, and the broker's event loop waits for the GIL meanwhile (issue 5, GC under load).
    """
    if not items:
        return SCHEMA.empty_table()
    return pa.Table.from_batches([_record_batch(items[start:start + _TABLE_CHUNK])
                                  for start in range(0, len(items), _TABLE_CHUNK)], schema=SCHEMA)


def _record_batch(items: Sequence[bytes]) -> pa.RecordBatch:
    rows = json.loads(b"[" + b",".join(items) + b"]")  # one parse per chunk, not per item
    if len(rows) != len(items):  # an item that is not one JSON value: parse them one by one
        rows = [json.loads(item) for item in items]
    arrays = [pa.array(col, type=field.type) for col, field in zip(zip(*rows, strict=True), SCHEMA, strict=True)]
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


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
        _write_atomically(path, stream_id.encode())
        return stream_id
    if not re.fullmatch(r"[0-9a-f]{16}", stream_id):
        raise OSError(f"{path} does not hold a stream id (16 hex digits); move it away to start a new stream")
    return stream_id


def committed_position(buffer_dir: Path) -> AckRef:
    """The ack position of the ReplayQ in ``buffer_dir`` from its COMMIT file (format documented in
    ecq/replayq.py); ``AckRef(0, 0)`` when nothing was ever acked. Raises ValueError for a bad COMMIT."""
    try:
        commit = json.loads((buffer_dir / "COMMIT").read_text())
    except FileNotFoundError:
        return AckRef(0, 0)
    return AckRef(int(commit["segno"]), int(commit["id"]))


def write_batch(lake_dir: Path, stream_id: str, ref: AckRef, items: Sequence[bytes]) -> list[Path]:
    """Write one exported batch (ReplayQ items ending at position ``ref``) to the lake, one Parquet file
    per UTC hour of ``ts_ms``, each through a fsynced temporary file and a rename. Writing the same batch
    again replaces the same files. Returns the files written.

    ``lake_dir`` must exist (a missing lake is an outage, see the module docstring); the date and hour
    directories are created. Raises OSError (missing lake, read-only, disk full), with no file of this
    batch left under a visible name if the failure came before its rename.
    """
    table = events_table(items)
    name = _PART.format(stream=stream_id, segno=ref.segno, id=ref.id)
    written = []
    for hour, rows in _rows_by_hour(table):
        directory = _hour_dir(lake_dir, hour)
        path = directory / name
        _write_parquet_atomically(rows, path)
        written.append(path)
    return written


def _rows_by_hour(table: pa.Table) -> Iterable[tuple[int, pa.Table]]:
    """(hour since epoch, rows of that hour in their original order) for each hour present."""
    hours = pc.floor(pc.divide(table.column("ts_ms").cast(pa.float64()), float(_MS_PER_HOUR))).cast(pa.int64())
    for hour in sorted(pc.unique(hours).to_pylist()):
        yield hour, table.filter(pc.equal(hours, hour))


def _hour_dir(lake_dir: Path, hour: int) -> Path:
    moment = datetime.fromtimestamp(hour * 3600, UTC)
    date_dir = lake_dir / f"date={moment:%Y-%m-%d}"
    hour_dir = date_dir / f"hour={moment:%H}"
    if not hour_dir.is_dir():
        _make_dir(date_dir)
        _make_dir(hour_dir)
    return hour_dir


def _make_dir(path: Path) -> None:
    """mkdir ``path`` (its parent must exist) and fsync the parent so the new entry is durable."""
    try:
        path.mkdir()
    except FileExistsError:
        if not path.is_dir():
            raise
        return
    _fsync_dir(path.parent)


def _write_parquet_atomically(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            pq.write_table(table, f, compression="zstd")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_unacked_files(lake_dir: Path, stream_id: str, committed: AckRef) -> list[Path]:
    """Delete the lake files of stream ``stream_id`` whose batch ends after ``committed`` (they were
    renamed but never acked, so their events will be exported again), and its leftover temp files.
    Returns the deleted paths. Raises OSError when the lake cannot be listed or a file not deleted.
    """
    removed = []
    for path in _stream_files(lake_dir, stream_id):
        match = _PART_NAME.fullmatch(path.name)
        position = AckRef(int(match.group(2)), int(match.group(3)))
        if match.group(4) or position > committed:
            path.unlink()
            removed.append(path)
    for directory in {path.parent for path in removed}:
        _fsync_dir(directory)
    return removed


def _stream_files(lake_dir: Path, stream_id: str) -> list[Path]:
    """Files of one stream under ``lake_dir/date=*/hour=*/`` (final and temporary names)."""
    found = []
    for date_dir in _subdirs(lake_dir, "date="):
        for hour_dir in _subdirs(date_dir, "hour="):
            with os.scandir(hour_dir) as entries:
                for entry in entries:
                    match = _PART_NAME.fullmatch(entry.name)
                    if match and match.group(1) == stream_id:
                        found.append(Path(entry.path))
    return found


def _subdirs(path: Path, prefix: str) -> list[Path]:
    with os.scandir(path) as entries:
        return [Path(e.path) for e in entries if e.name.startswith(prefix) and e.is_dir()]


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
    """Collects queue events from the broker into a disk-mode ReplayQ at ``buffer_dir`` (issue 6, section 1).

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

        Raises ecq.replayq.ReplayQError (buffer already open, corrupt COMMIT) or OSError (cannot create
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
            items = []
            for _ in range(min(len(self._pending), _FLUSH_CHUNK)):
                ts_ms, type_, fields = self._pending.popleft()
                try:
                    items.append(encode_event(ts_ms, type_, fields))
                except InvalidEvent as exc:
                    self._counters.invalid += 1
                    self._warn_once(f"invalid:{type_}", "ECQ events: dropped an invalid event: %s", exc)
            try:
                queue.append(items)
            except OSError as exc:
                self._counters.failed_items += len(items)
                self._counters.failed_bytes += sum(map(len, items))
                log.error("ECQ events: cannot buffer %d events in %s: %s", len(items), self.buffer_dir, exc)

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
                await asyncio.wait_for(self.call_with_queue(self._flush_and_close), _CLOSE_TIMEOUT_S)
            except TimeoutError:
                log.error("ECQ events: buffer %s did not close within %.0f s", self.buffer_dir, _CLOSE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - closing must go on (the broker is shutting down)
                log.exception("ECQ events: closing the buffer failed")
        self._executor.shutdown(wait=False)

    def _flush_and_close(self, queue: ReplayQ) -> None:
        try:
            self.flush_pending(queue)
        finally:
            queue.close()


class LakeExporter:
    """Exports the events buffered by ``recorder`` to Parquet files under ``lake_dir`` (issue 6, section 1).

    Every ``interval_s`` seconds (at once while full batches keep coming) it exports one batch of at most
    ``batch_items`` events; after a failure it retries the same batch after ``interval_s`` doubling up to
    ``max_backoff_s`` seconds. Layout and exactly-once rule: see the module docstring.
    """

    def __init__(self, recorder: EventRecorder, lake_dir: Path, batch_items: int = 10_000,
                 interval_s: float = 1.0, max_backoff_s: float = 30.0) -> None:
        self.lake_dir = Path(lake_dir)
        self._recorder = recorder
        self._batch_items = batch_items
        self._interval_s = interval_s
        self._max_backoff_s = max_backoff_s
        self._inflight: tuple[AckRef, list[bytes]] | None = None
        self._lake_checked = False  # unacked files of an earlier run removed
        self._stopping = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Create ``lake_dir`` if missing (a failure is logged and retried as an outage) and start exporting.
        The recorder must be started."""
        try:
            self.lake_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.error("ECQ events: cannot create lake %s (%s); events stay buffered until it can be written",
                      self.lake_dir, exc)
        self._task = asyncio.create_task(self._run(), name="ecq-events-export")

    async def _run(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                exported = await self._recorder.call_with_queue(self._export_batch)
            except Exception as exc:  # noqa: BLE001 - any failure is an outage: keep the batch, back off
                failures += 1
                self._recorder.note_export(error=True)
                log.warning("ECQ events: export to %s failed (attempt %d): %s", self.lake_dir, failures, exc)
                await self._sleep(min(self._max_backoff_s, self._interval_s * 2 ** (failures - 1)))
                continue
            self._recorder.note_export(exported)
            if failures:
                log.info("ECQ events: lake %s writable again after %d failed attempts", self.lake_dir, failures)
                failures = 0
            if exported < self._batch_items:
                await self._sleep(self._interval_s)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    def _export_batch(self, queue: ReplayQ) -> int:
        """Export one batch (queue thread only); returns the number of events acked, 0 if none waited."""
        if not self._lake_checked:
            removed = remove_unacked_files(self.lake_dir, self._recorder.stream_id,
                                           committed_position(self._recorder.buffer_dir))
            if removed:
                log.warning("ECQ events: removed %d lake file(s) of batches exported but not acked before a "
                            "crash; their events are exported again: %s", len(removed), removed)
            self._lake_checked = True
        if self._inflight is None:
            ref, items = queue.pop(self._batch_items)
            if not items:
                return 0
            self._inflight = (ref, items)
            self._recorder.set_inflight(len(items), sum(map(len, items)))
        ref, items = self._inflight
        write_batch(self.lake_dir, self._recorder.stream_id, ref, items)
        queue.ack(ref)
        self._inflight = None
        self._recorder.set_inflight(0, 0)
        return len(items)

    async def close(self, timeout_s: float = _CLOSE_TIMEOUT_S) -> None:
        """Stop the export loop, then flush the recorder's pending events and export what is buffered,
        giving up after ``timeout_s`` seconds in total (what is left stays buffered for the next start)."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        if self._task:
            try:
                await asyncio.wait_for(self._task, timeout_s)
            except TimeoutError:
                log.error("ECQ events: export loop did not stop within %.0f s", timeout_s)
                return
        try:
            exported = await asyncio.wait_for(self._recorder.call_with_queue(lambda q: self._drain(q, deadline)),
                                              max(0.1, deadline - time.monotonic()))
            self._recorder.note_export(exported)
        except TimeoutError:
            log.error("ECQ events: final export to %s did not finish within %.0f s", self.lake_dir, timeout_s)
        except Exception as exc:  # noqa: BLE001 - the events stay buffered for the next start
            self._recorder.note_export(error=True)
            log.warning("ECQ events: final export to %s failed, events stay buffered: %s", self.lake_dir, exc)

    def _drain(self, queue: ReplayQ, deadline: float) -> int:
        """Flush the recorder's deque, then export until the buffer is empty or ``deadline`` (monotonic s)."""
        self._recorder.flush_pending(queue)
        exported = 0
        while time.monotonic() < deadline and (batch := self._export_batch(queue)):
            exported += batch
        return exported
