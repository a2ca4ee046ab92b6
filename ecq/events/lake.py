"""The Parquet lake: where exported queue events land, and the exporter that moves them there from the
event buffer (`EventRecorder`) exactly once.

Lake layout: ``<lake_dir>/date=YYYY-MM-DD/hour=HH/part-<stream>-<segno>-<id>.parquet``, partitioned by
``ts_ms`` in UTC (Hive style, so Spark, pyarrow.dataset and DuckDB discover ``date`` and ``hour``).
``<stream>`` identifies the event buffer that wrote the file (16 hex digits, kept in
``<buffer_dir>/lake-stream-id``); ``<segno>-<id>`` (10 digits each) is the ReplayQ position of the last
event of the exported batch. A batch spanning several hours gives one file per hour, all with that name.
Files being written are hidden (``.part-...parquet.tmp``), which Spark and pyarrow skip.
``ecq pipeline compact`` later merges the files of a finished hour into one ``compacted-<token>.parquet``
(ecq/pipeline/compact.py); the exporter neither reads nor deletes those.

File sizing: the exporter lets events gather in the buffer and writes a file only once the buffer holds
``batch_items`` events (plugin option ``lake_file_rows``, default 1 000) or ``batch_bytes`` bytes of
encoded events (``lake_file_bytes``, default 64 MiB), or once ``max_age_s`` seconds (``lake_file_age``,
default 60 s) have passed since it first saw an event waiting after its previous file; it then pops one
batch of at most that many events and bytes, so a file is still one popped batch. It looks every
``interval_s`` (``export_interval``), so an event reaches the lake at most about ``max_age_s`` + 2 x
``interval_s`` after it was buffered. Why these defaults: the export runs in the recorder's thread, which
shares the GIL with the event loop, and the larger the file the more it holds up deliveries while events
pour in (a GC pass over 200,000 entries beside 250 deliveries/s: delivery p99 1.6x its value without GC at
1,000 rows, 3.5x at 10,000, 5.9x at 100,000; scripts/bench --scenario scale, 2-core dev VM); ``ecq pipeline
compact`` makes each finished hour one file anyway. 64 MiB bounds a batch of large events (long
``refused`` topics) in memory; 60 s keeps the lake about a minute behind the broker, giving at most 60
files an hour per broker at low rates, which ``ecq pipeline compact`` merges into one per hour.
`close` exports everything buffered, whatever the bounds.

Export, exactly once: `LakeExporter` pops a batch, writes one Parquet file per hour atomically
(ecq/events/atomic.py: temporary name, fsync, rename, fsync the directory), and only then acks the
batch. Only one batch is ever popped and not acked, so only the files of the stream's newest position
can be unacked (``ecq pipeline compact`` relies on that and leaves them alone). While the lake cannot be
written (missing, not a directory, read-only, disk full) it keeps the
same batch and retries with exponential backoff (``interval_s`` doubling up to ``max_backoff_s``),
while new events wait in the buffer. A crash between rename and ack leaves files whose position is
after the buffer's committed position (`ReplayQ.committed`); before its first export the exporter
deletes exactly those files of its own stream, so the re-exported events land once. The lake directory
itself is created by `LakeExporter.start` when missing; if it disappears later (an unmounted volume)
it is treated as an outage, not recreated.

The exporter uses the buffer only through `EventRecorder.call_with_queue`, in the recorder's queue thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ecq.events.atomic import fsync_dir, write_atomically
from ecq.events.recorder import CLOSE_TIMEOUT_S, EventRecorder
from ecq.events.replayq import AckRef, ReplayQ
from ecq.events.schema import events_table

log = logging.getLogger(__name__)

_PART = "part-{stream}-{segno:010d}-{id:010d}.parquet"
_PART_NAME = re.compile(r"\.?part-([0-9a-f]{16})-(\d{10})-(\d{10})\.parquet(\.tmp)?")
_MS_PER_HOUR = 3_600_000


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
        write_atomically(path, parquet_bytes(rows), hidden_temp=True)
        written.append(path)
    return written


def parquet_bytes(table: pa.Table) -> bytes:
    """``table`` as a zstd-compressed Parquet file, in memory: Arrow writes it into its own buffer instead of into
    a Python file object through a Python call per write."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def _rows_by_hour(table: pa.Table) -> Iterable[tuple[int, pa.Table]]:
    """(hour since epoch, rows of that hour in their original order) for each hour present."""
    hours = pc.floor(pc.divide(table.column("ts_ms").cast(pa.float64()), float(_MS_PER_HOUR))).cast(pa.int64())
    first, last = pc.min_max(hours).values()
    if first.is_valid and first == last:  # the usual batch, all of one hour: no copy
        yield first.as_py(), table
        return
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
    fsync_dir(path.parent)


def part_position(name: str) -> tuple[str, AckRef] | None:
    """(stream id, ReplayQ position of the batch's last event) of a lake file named
    ``part-<stream>-<segno>-<id>.parquet``; None for any other name (temporary and compacted files)."""
    match = _PART_NAME.fullmatch(name)
    if not match or name.startswith(".") or match.group(4):
        return None
    return match.group(1), AckRef(int(match.group(2)), int(match.group(3)))


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
        fsync_dir(directory)
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


class LakeExporter:
    """Exports the events buffered by ``recorder`` to Parquet files under ``lake_dir``.

    Every ``interval_s`` seconds it writes one file (one popped batch) when one is due: ``batch_items``
    events or ``batch_bytes`` bytes (encoded sizes) are buffered, or ``max_age_s`` seconds passed since it
    first saw events waiting after its previous file (0 = at every look). A batch holds at most
    ``batch_items`` events and ``batch_bytes`` bytes; while whole batches are buffered it writes them
    back to back. After a failure it retries the same batch after ``interval_s`` doubling up to
    ``max_backoff_s`` seconds. Sizing, layout and the exactly-once rule: see the module docstring.
    """

    def __init__(self, recorder: EventRecorder, lake_dir: Path, batch_items: int = 1_000,
                 interval_s: float = 1.0, max_backoff_s: float = 30.0, *,
                 batch_bytes: int = 64 * 1024 * 1024, max_age_s: float = 0.0) -> None:
        self.lake_dir = Path(lake_dir)
        self._recorder = recorder
        self._batch_items = batch_items
        self._batch_bytes = batch_bytes
        self._max_age_s = max_age_s
        self._interval_s = interval_s
        self._max_backoff_s = max_backoff_s
        self._inflight: tuple[AckRef, list[bytes]] | None = None
        self._waiting_since: float | None = None  # monotonic s when events were first seen waiting for a file
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
                exported = await self._recorder.call_with_queue(self._export_due)
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
            if not exported:
                await self._sleep(self._interval_s)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    def _export_due(self, queue: ReplayQ) -> int:
        """Export one batch if a file is due (queue thread only); returns the number of events acked."""
        if self._inflight is None and not self._file_due(queue):
            return 0
        return self._export_batch(queue)

    def _file_due(self, queue: ReplayQ) -> bool:
        """Whether the buffer holds a whole file's worth of events, or its oldest waited long enough."""
        if not queue.count():
            self._waiting_since = None
            return False
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        return (queue.count() >= self._batch_items or queue.bytes() >= self._batch_bytes
                or now - self._waiting_since >= self._max_age_s)

    def _export_batch(self, queue: ReplayQ) -> int:
        """Export one batch, due or not (queue thread only); returns the number of events acked, 0 if none
        waited."""
        if not self._lake_checked:
            removed = remove_unacked_files(self.lake_dir, self._recorder.stream_id, queue.committed())
            if removed:
                log.warning("ECQ events: removed %d lake file(s) of batches exported but not acked before a "
                            "crash; their events are exported again: %s", len(removed), removed)
            self._lake_checked = True
        if self._inflight is None:
            ref, items = queue.pop(self._batch_items, self._batch_bytes)
            if not items:
                return 0
            self._inflight = (ref, items)
            self._recorder.set_inflight(len(items), sum(map(len, items)))
        ref, items = self._inflight
        write_batch(self.lake_dir, self._recorder.stream_id, ref, items)
        queue.ack(ref)
        self._inflight = None
        self._recorder.set_inflight(0, 0)
        self._waiting_since = time.monotonic() if queue.count() else None
        return len(items)

    async def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
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
