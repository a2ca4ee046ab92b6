"""ReplayQ: a segmented disk buffer queue between a producer and a sink that may be slow or down.

Behaviour comes from SPEC.md section 2 and issue 3. One producer appends batches of items, one reader
pops batches and acks them; everything not acked is handed out again after a restart.

Modes (chosen by `ReplayQConfig`):

* memory only (``dir=None``): volatile, same API and overload protection.
* disk (``dir=...``): every item is written to a segment file before `ReplayQ.append` returns.
* offload (``offload=True``): items collect in RAM until `bytes()` reaches ``seg_bytes``, then the tail
  spills to segment files. What reached disk survives a crash; RAM items (popped-but-unacked ones
  included) are dumped to a segment file by `ReplayQ.close`.
* volatile offload (``offload="volatile"``): as offload, but old segments are wiped on open and RAM is
  never dumped on close; the disk is only overflow space.

Positions. Items live in numbered segments (segno 1, 2, ...); inside a segment the items have ids 1, 2,
... in append order, so ``(segno, id)`` is a position (seqno) that only grows. `ReplayQ.pop` hands out
the next items and an `AckRef` naming the last one; `ReplayQ.ack` is cumulative: it acks every item up
to that position. A new segment starts once the current one has at least ``seg_bytes`` bytes (an
append is never split, so a segment can pass ``seg_bytes`` by one append). Once every item of a segment
is acked its file is deleted; the segment being written waits until the writer moves on.

Files in ``dir``:

* ``0000000001.seg``, ``0000000002.seg``, ...: segments, the segno as 10 decimal digits. A segment is
  a run of frames; each frame is, big-endian::

      offset 0   4 bytes  magic  b"\\xe5RQ1"
      offset 4   4 bytes  CRC32 of the payload (zlib.crc32), unsigned
      offset 8   4 bytes  payload length in bytes, unsigned (so an item is at most 4 GiB - 1)
      offset 12  payload

* ``COMMIT``: the ack position as JSON ``{"segno": S, "id": I}``: every item up to item I of segment S
  is acked (``I=0``: every segment before S is). It is replaced atomically (write ``COMMIT.tmp``,
  fsync, rename, fsync the directory). On open, reading resumes after it. A COMMIT that cannot be parsed
  raises `ReplayQError` rather than guessing; a missing COMMIT means nothing is acked, so every item
  still on disk is handed out again (segments that were fully acked are already gone).
* ``COMMIT.tmp``, ``<segno>.seg.tmp``: an interrupted atomic write; removed on open. Other names
  ending in ``.seg`` raise `ReplayQError`; any other file is ignored.

Corruption. On open every frame of every segment is checked (magic, length within the file, CRC32).
From the first bad frame on, the segment is truncated; the discarded items (the bad frame plus the
intact frames found after it by searching for the magic) and bytes are logged at ERROR level and
reported by `ReplayQ.corrupt_discarded`. Later segments are checked on their own, and appends always
go to a fresh segment after open, so item ids and the COMMIT stay consistent. A segment that changes
under an open queue makes `ReplayQ.pop` raise `ReplayQError`.

Overload. Sizes are estimates: ``sizer(item)``, or the payload length (frame headers are not counted).
`ReplayQ.count` and `ReplayQ.bytes` cover items not yet popped. After an append that takes `bytes()`
over ``max_total_bytes``, the oldest unpopped items are dropped (at least one) until it is within the
limit. With ``high_mem_percent`` set, an append made while the machine's memory use is at or above it
(``psutil.virtual_memory().percent`` or ``mem_probe()``) drops at least as many bytes as it added, and
at least one item. Dropped items are counted by `ReplayQ.overflow_dropped`. A drop counts as an ack of
the dropped items: it reaches COMMIT at once when nothing is popped-but-unacked, otherwise with the ack
of the batch handed out just before it. Until then a restart hands dropped disk items out again.

fsync. ``fsync="always"`` (default) fsyncs the segment on each append, COMMIT on each ack that moves
it, and the directory when a file is created or renamed: what `append` returned from survives power
loss. ``fsync="never"`` only flushes to the OS: it survives a crash of the process, not of the machine.
Measured cost (``scripts/bench_replayq``, 2-core VM, ext4, one item per append): ``always`` adds about
0.25 ms per append. Disk mode appended 3.9 k items/s with ``always`` against 182 k/s with ``never``
for 256 B items (47x slower), 3.5 k/s against 91 k/s for 4 KiB items (26x); popping batches of 100,
each acked, ran at 109 k against 187 k items/s (256 B). Memory only appended 427 k items/s. Figures
depend on the storage: rerun the script on the target machine.

A ReplayQ is not thread-safe, and its disk I/O blocks. Each directory is locked (``flock``) by the
queue that opened it; a second open raises `ReplayQError`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import struct
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal, NamedTuple

import psutil
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

log = logging.getLogger(__name__)

MAGIC = b"\xe5RQ1"
MAX_ITEM_BYTES = 2**32 - 1
_HEADER = struct.Struct(">4sII")  # magic, CRC32 of the payload, payload length
_SEGMENT_NAME = re.compile(r"\d{10}\.seg")
_TMP_NAME = re.compile(r"(\d{10}\.seg|COMMIT)\.tmp")
_COMMIT = "COMMIT"
_MAX_SEGNO = 10**10  # segment names hold 10 digits


class ReplayQError(Exception):
    """A queue directory that cannot be used as it is (corrupt COMMIT, stray segment name, locked), or use after close."""


@dataclass(frozen=True, order=True)
class AckRef:
    """Opaque, immutable position handed out by `ReplayQ.pop`: item ``id`` of segment ``segno``.

    Ordered by position. Only the queue instance that handed a ref out accepts it.
    """

    segno: int
    id: int


class Dropped(NamedTuple):
    """A tally of discarded items: ``items`` (count) and ``bytes`` (size estimates, or file bytes for corruption)."""

    items: int
    bytes: int


def _used_memory_percent() -> float:
    return psutil.virtual_memory().percent


class ReplayQConfig(BaseModel):
    """Options of a ReplayQ (SPEC.md section 2). Bad values raise pydantic.ValidationError naming the option.

    - dir: segment directory, created if missing; None means memory only.
    - seg_bytes: a new segment starts once the current one holds at least this many bytes; in offload
      mode also the RAM threshold. Default 10 MiB.
    - offload: False (disk mode), True (offload) or "volatile" (volatile offload); needs dir.
    - max_total_bytes: overload limit on `ReplayQ.bytes`. Default 2 GiB: plan it as the bytes you can
      spare divided by the number of queues.
    - mem_only: True forces memory only; must not be combined with dir.
    - fsync: "always" or "never" (see the module docstring for the semantics and the measured cost).
    - sizer: item -> size estimate in bytes (non-negative int, deterministic); default: payload length.
    - marshaller: (encode, decode) for items that are not bytes, e.g. (pickle.dumps, pickle.loads).
    - high_mem_percent: machine memory use in percent (0-100] at which each append drops from the head.
    - mem_probe: () -> memory use in percent; default psutil.virtual_memory().percent.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: Path | None = None
    seg_bytes: int = Field(default=10 * 2**20, gt=0)
    offload: StrictBool | Literal["volatile"] = False
    max_total_bytes: int = Field(default=2 * 2**30, gt=0)
    mem_only: bool = False
    fsync: Literal["always", "never"] = "always"
    sizer: Callable[[Any], int] | None = None
    marshaller: tuple[Callable[[Any], bytes], Callable[[bytes], Any]] | None = None
    high_mem_percent: float | None = Field(default=None, gt=0, le=100)
    mem_probe: Callable[[], float] | None = None

    @model_validator(mode="after")
    def _check_mode(self) -> ReplayQConfig:
        if self.mem_only and self.dir is not None:
            raise ValueError("mem_only=True conflicts with dir; use dir=None for a memory-only queue")
        if self.offload is not False and self.dir is None:
            raise ValueError(f"offload={self.offload!r} needs a dir to spill to")
        return self


@dataclass(eq=False)
class _Segment:
    """Items with ids 1..count. ``path`` is None for a segment that lives in RAM."""

    segno: int
    path: Path | None
    keep_popped: bool = False  # RAM segments of non-volatile offload keep popped items until acked
    count: int = 0
    file_bytes: int = 0  # bytes of complete frames in the file
    read_offset: int = 0  # file offset of the first frame not loaded into `unread`
    next_id: int = 1  # id of the first item not loaded into `unread`
    unread: deque[tuple[int, Any, int]] = field(default_factory=deque)  # (id, item, size), next to pop
    unacked: deque[tuple[int, Any]] = field(default_factory=deque)  # (id, item) popped, not yet acked

    def has_unpopped(self) -> bool:
        return bool(self.unread) or self.next_id <= self.count


@dataclass(slots=True)
class _Batch:
    """A batch handed out by pop and not yet acked; ``skip_to`` ends a run of items dropped right after it."""

    ref: AckRef
    skip_to: AckRef | None = None


def _frame_end(buf: memoryview, offset: int) -> int:
    """End offset of the valid frame starting at ``offset`` in ``buf``, or -1 if there is none."""
    if len(buf) - offset < _HEADER.size:
        return -1
    magic, crc, length = _HEADER.unpack_from(buf, offset)
    start = offset + _HEADER.size
    end = start + length
    if magic != MAGIC or end > len(buf) or zlib.crc32(buf[start:end]) != crc:
        return -1
    return end


def _parse(data: bytes) -> tuple[list[memoryview], int]:
    """Payloads of the valid frames at the start of ``data``, and the offset of the first bad frame (or the end)."""
    buf = memoryview(data)
    payloads = []
    offset = 0
    while offset < len(buf):
        end = _frame_end(buf, offset)
        if end < 0:
            break
        payloads.append(buf[offset + _HEADER.size : end])
        offset = end
    return payloads, offset


def _count_discarded(data: bytes, bad: int) -> int:
    """Items lost by truncating ``data`` at ``bad``: the bad frame and each intact frame found after it."""
    buf = memoryview(data)
    items = 1
    pos = data.find(MAGIC, bad + 1)
    while pos >= 0:
        end = _frame_end(buf, pos)
        if end >= 0:
            items += 1
        pos = data.find(MAGIC, end if end >= 0 else pos + 1)
    return items


def _frames(payloads: Iterable[bytes]) -> bytes:
    parts = []
    for payload in payloads:
        parts.append(_HEADER.pack(MAGIC, zlib.crc32(payload), len(payload)))
        parts.append(payload)
    return b"".join(parts)


class ReplayQ:
    """A FIFO of items between one producer and one reader, in RAM or on disk (SPEC.md section 2, issue 3).

    Open with `ReplayQ.open`; see the module docstring for modes, files, corruption and overload rules.
    Also a context manager that closes the queue.
    """

    def __init__(self, config: ReplayQConfig) -> None:
        self._cfg = config
        self._dir = None if config.mem_only else config.dir
        self._encode, self._decode = config.marshaller or (None, None)
        self._size_fn = config.sizer
        self._offload = config.offload is not False
        self._keep_popped = config.offload is True
        self._sync = config.fsync == "always"
        self._probe = config.mem_probe or _used_memory_percent
        self._count = 0
        self._bytes = 0
        self._dropped = Dropped(0, 0)
        self._corrupt = Dropped(0, 0)
        self._popped_segs: deque[_Segment] = deque()  # fully popped, waiting for acks
        self._unpopped_segs: deque[_Segment] = deque()  # the reader's segment first, the writer's last
        self._batches: deque[_Batch] = deque()
        self._acked = AckRef(0, 0)
        self._committed: AckRef | None = None
        self._next_segno = 1
        self._wfile: BinaryIO | None = None
        self._dir_fd: int | None = None
        self._closed = False
        if self._dir is not None:
            self._open_dir(self._dir)

    @classmethod
    def open(cls, config: ReplayQConfig | dict[str, Any]) -> ReplayQ:
        """Open a queue; ``config`` is a `ReplayQConfig` or a dict of its fields.

        With a dir, scans every segment (truncating corrupt tails), deletes fully acked segments and
        resumes after COMMIT. Raises pydantic.ValidationError for bad options, `ReplayQError` for a
        corrupt COMMIT, a stray ``*.seg`` name or a dir already open, OSError for I/O failures.
        """
        if not isinstance(config, ReplayQConfig):
            config = ReplayQConfig.model_validate(config)
        return cls(config)

    def _open_dir(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self._dir_fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._dir_fd)
            raise ReplayQError(f"{path} is already open by another ReplayQ") from None
        try:
            self._load_dir()
        except BaseException:
            os.close(self._dir_fd)
            raise

    def _load_dir(self) -> None:
        segnos = self._list_segments()
        if self._cfg.offload == "volatile":
            for segno in segnos:
                self._seg_path(segno).unlink()
            (self._dir / _COMMIT).unlink(missing_ok=True)
            return
        commit = self._read_commit()
        if commit is not None:
            self._acked = self._committed = commit
            self._next_segno = commit.segno + 1
        for segno in segnos:
            if commit is not None and segno < commit.segno:
                self._seg_path(segno).unlink()
                continue
            skip = commit.id if commit is not None and segno == commit.segno else 0
            seg = self._scan(segno, skip)
            if seg is not None:
                self._unpopped_segs.append(seg)
            self._next_segno = max(self._next_segno, segno + 1)

    def _list_segments(self) -> list[int]:
        segnos = []
        with os.scandir(self._dir) as entries:
            for entry in entries:
                if _TMP_NAME.fullmatch(entry.name):
                    os.unlink(entry.path)
                elif entry.name.endswith(".seg"):
                    if not _SEGMENT_NAME.fullmatch(entry.name) or not entry.is_file():
                        raise ReplayQError(
                            f"unexpected segment file {entry.path}: segment files are named "
                            "<10 digits>.seg; move it out of the queue directory"
                        )
                    segnos.append(int(entry.name[:10]))
        return sorted(segnos)

    def _read_commit(self) -> AckRef | None:
        path = self._dir / _COMMIT
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            position = json.loads(text)
            valid = (
                isinstance(position, dict)
                and position.keys() == {"segno", "id"}
                and all(type(v) is int and 0 <= v < _MAX_SEGNO for v in position.values())
            )
        except ValueError:
            valid = False
        if not valid:
            raise ReplayQError(
                f"corrupt COMMIT file {path}: {text[:80]!r}; the ack position is unknown. "
                "Delete the file to hand out again every item still on disk."
            )
        return AckRef(position["segno"], position["id"])

    def _scan(self, segno: int, skip: int) -> _Segment | None:
        """Check every frame of a segment file, truncate it at the first bad one, skip ``skip`` acked items."""
        path = self._seg_path(segno)
        data = path.read_bytes()
        payloads, end = _parse(data)
        if end < len(data):
            self._truncate(path, data, end)
        if skip >= len(payloads):
            path.unlink()
            return None
        seg = _Segment(segno, path, count=len(payloads), file_bytes=end, next_id=skip + 1)
        seg.read_offset = sum(_HEADER.size + len(p) for p in payloads[:skip])
        for payload in payloads[skip:]:
            self._count += 1
            self._bytes += self._size_fn(self._from_payload(payload)) if self._size_fn else len(payload)
        return seg

    def _truncate(self, path: Path, data: bytes, end: int) -> None:
        items = _count_discarded(data, end)
        self._corrupt = Dropped(self._corrupt.items + items, self._corrupt.bytes + len(data) - end)
        log.error(
            "ReplayQ segment %s: bad frame at byte %d; truncated %d bytes, discarding %d item(s)",
            path, end, len(data) - end, items,
        )
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())

    def append(self, items: Sequence[bytes]) -> None:
        """Append items at the tail, then apply the overload limits (which may drop from the head).

        Items are bytes (bytearray and memoryview are copied), or anything the configured marshaller
        encodes. In disk mode they are in the segment file (fsynced with fsync="always") on return.
        Raises TypeError for an item that is not bytes without a marshaller, ValueError for an item
        over 4 GiB - 1, `ReplayQError` after close, OSError when writing fails (the segment is then
        truncated back to its last whole append).
        """
        self._check_open()
        if isinstance(items, (bytes, bytearray, memoryview, str)):
            raise TypeError("append() takes a sequence of items, not a single item")
        entries = [self._entry(item) for item in items]
        if not entries:
            return
        if self._to_disk():
            self._append_disk(entries)
        else:
            self._append_ram(entries)
        added = sum(size for _, _, size in entries)
        self._count += len(entries)
        self._bytes += added
        self._enforce_limits(added)

    def _entry(self, item: Any) -> tuple[Any, bytes, int]:
        """(item as stored in RAM, payload, size). Encoding up front means a later spill or dump cannot fail."""
        payload = self._payload(item)
        if len(payload) > MAX_ITEM_BYTES:
            raise ValueError(f"item of {len(payload)} bytes is over the {MAX_ITEM_BYTES}-byte frame limit")
        if self._encode is None:
            item = payload
        return item, payload, self._size_fn(item) if self._size_fn else len(payload)

    def _payload(self, item: Any) -> bytes:
        if self._encode is not None:
            payload = self._encode(item)
            if not isinstance(payload, bytes):
                raise TypeError(f"marshaller encode returned {type(payload).__name__}, not bytes")
            return payload
        if isinstance(item, bytes):
            return item
        if isinstance(item, (bytearray, memoryview)):
            return bytes(item)
        raise TypeError(f"ReplayQ items must be bytes (or configure a marshaller), not {type(item).__name__}")

    def _from_payload(self, payload: memoryview) -> Any:
        return self._decode(bytes(payload)) if self._decode else bytes(payload)

    def _to_disk(self) -> bool:
        if self._dir is None:
            return False
        if not self._offload:
            return True
        tail = self._unpopped_segs[-1] if self._unpopped_segs else None
        if tail is not None and tail.path is None:
            return self._bytes >= self._cfg.seg_bytes
        return self._count > 0  # keep spilling until the reader has drained the disk

    def _append_disk(self, entries: list[tuple[Any, bytes, int]]) -> None:
        seg = self._writable_segment()
        data = _frames(payload for _, payload, _ in entries)
        try:
            self._wfile.write(data)
            self._wfile.flush()
            if self._sync:
                os.fsync(self._wfile.fileno())
        except OSError:
            with contextlib.suppress(OSError):  # closing flushes the rest of the failed write
                self._close_writer()
            os.truncate(seg.path, seg.file_bytes)
            raise
        seg.file_bytes += len(data)
        seg.count += len(entries)

    def _writable_segment(self) -> _Segment:
        if self._wfile is None or self._unpopped_segs[-1].file_bytes >= self._cfg.seg_bytes:
            return self._new_segment(on_disk=True)
        return self._unpopped_segs[-1]

    def _append_ram(self, entries: list[tuple[Any, bytes, int]]) -> None:
        tail = self._unpopped_segs[-1] if self._unpopped_segs else None
        if tail is None or tail.path is not None:
            tail = self._new_segment(on_disk=False)
        for item, _, size in entries:
            tail.count += 1
            tail.unread.append((tail.count, item, size))
        tail.next_id = tail.count + 1

    def _new_segment(self, on_disk: bool) -> _Segment:
        self._close_writer()
        segno = self._next_segno
        self._next_segno += 1
        if on_disk:
            seg = _Segment(segno, self._seg_path(segno))
            self._wfile = open(seg.path, "ab")
            if self._sync:
                os.fsync(self._dir_fd)
        else:
            seg = _Segment(segno, None, keep_popped=self._keep_popped)
        self._unpopped_segs.append(seg)
        self._settle()
        return seg

    def _close_writer(self) -> None:
        wfile, self._wfile = self._wfile, None
        if wfile is not None:
            wfile.close()

    def _enforce_limits(self, added: int) -> None:
        """Drop from the head for max_total_bytes and high memory; ``added`` is the size of the append."""
        limit = self._cfg.max_total_bytes
        threshold = self._cfg.high_mem_percent
        high_mem = threshold is not None and self._probe() >= threshold
        items = nbytes = 0
        last = None
        while self._count and (self._bytes > limit or (high_mem and (items == 0 or nbytes < added))):
            seg = self._reader_segment()
            id_, _, size = self._take(seg, keep=False)
            items += 1
            nbytes += size
            last = AckRef(seg.segno, id_)
        if last is not None:
            self._dropped = Dropped(self._dropped.items + items, self._dropped.bytes + nbytes)
            self._settle()
            if self._batches:
                self._batches[-1].skip_to = last
            else:
                self._advance(last)

    def pop(self, count_limit: int | None = None, bytes_limit: int | None = None) -> tuple[AckRef, list[bytes]]:
        """Hand out the next items, oldest first: at most ``count_limit`` items and ``bytes_limit`` bytes
        (size estimates), but at least one item when the queue is not empty. None means no limit.

        Returns (ref, items); pass ref to `ack` once the items are safely processed. Popping again
        without acking hands out the next items. An empty queue gives ``(ref, [])`` where acking ref
        does nothing. Raises ValueError for a limit below 1, `ReplayQError` after close or when a
        segment file changed on disk while open.
        """
        self._check_open()
        if count_limit is not None and count_limit < 1:
            raise ValueError(f"count_limit must be at least 1 or None, not {count_limit}")
        if bytes_limit is not None and bytes_limit < 1:
            raise ValueError(f"bytes_limit must be at least 1 or None, not {bytes_limit}")
        items: list[Any] = []
        total = 0
        while count_limit is None or len(items) < count_limit:
            seg = self._reader_segment()
            if seg is None or (items and bytes_limit is not None and total + seg.unread[0][2] > bytes_limit):
                break
            last_id, item, size = self._take(seg, keep=seg.keep_popped)
            last_segno = seg.segno
            items.append(item)
            total += size
        self._settle()
        if not items:
            return self._acked, []
        ref = AckRef(last_segno, last_id)
        self._batches.append(_Batch(ref))
        return ref, items

    def _reader_segment(self) -> _Segment | None:
        """The segment holding the next item to pop, its unread items loaded; None if nothing is left."""
        self._settle()
        if not self._unpopped_segs or not self._unpopped_segs[0].has_unpopped():
            return None
        seg = self._unpopped_segs[0]
        if not seg.unread:
            self._load(seg)
        return seg

    def _settle(self) -> None:
        """Move drained segments (except the writer's) to the popped list, where acks can delete them."""
        segs = self._unpopped_segs
        while len(segs) > 1 and not segs[0].has_unpopped():
            self._popped_segs.append(segs.popleft())

    def _load(self, seg: _Segment) -> None:
        with open(seg.path, "rb") as f:
            f.seek(seg.read_offset)
            data = f.read(seg.file_bytes - seg.read_offset)
        payloads, end = _parse(data)
        if end != len(data) or len(payloads) != seg.count - seg.next_id + 1:
            raise ReplayQError(f"segment {seg.path} changed on disk while the queue was open")
        for payload in payloads:
            item = self._from_payload(payload)
            seg.unread.append((seg.next_id, item, self._size_fn(item) if self._size_fn else len(payload)))
            seg.next_id += 1
        seg.read_offset = seg.file_bytes

    def _take(self, seg: _Segment, keep: bool) -> tuple[int, Any, int]:
        id_, item, size = entry = seg.unread.popleft()
        self._count -= 1
        self._bytes -= size
        if keep:
            seg.unacked.append((id_, item))
        return entry

    def ack(self, ref: AckRef) -> None:
        """Ack every item up to ``ref`` (cumulative): they are never handed out again, and segments that
        are fully acked are deleted. With a dir the position is written to COMMIT first.

        Acking a ref again, or an older one after a newer one, does nothing. Raises ValueError for a ref
        this queue did not hand out, TypeError for something that is not an `AckRef`, `ReplayQError`
        after close.
        """
        self._check_open()
        if not isinstance(ref, AckRef):
            raise TypeError(f"ack() takes an AckRef from pop(), not {type(ref).__name__}")
        if ref <= self._acked:
            return
        k = next((i for i, batch in enumerate(self._batches) if batch.ref >= ref), None)
        if k is None or self._batches[k].ref != ref:
            raise ValueError(f"{ref} was not handed out by this queue's pop()")
        for _ in range(k):
            self._batches.popleft()
        batch = self._batches.popleft()
        self._advance(batch.skip_to or ref)

    def _advance(self, acked: AckRef) -> None:
        self._acked = acked
        done = []
        while self._popped_segs and self._fully_acked(self._popped_segs[0]):
            done.append(self._popped_segs.popleft())
        head = self._head()
        if head is not None and head.segno == acked.segno:
            while head.unacked and head.unacked[0][0] <= acked.id:
                head.unacked.popleft()
        self._commit()
        for seg in done:
            if seg.path is not None:
                seg.path.unlink(missing_ok=True)

    def _fully_acked(self, seg: _Segment) -> bool:
        return seg.segno < self._acked.segno or (seg.segno == self._acked.segno and self._acked.id >= seg.count)

    def _head(self) -> _Segment | None:
        if self._popped_segs:
            return self._popped_segs[0]
        return self._unpopped_segs[0] if self._unpopped_segs else None

    def _commit(self) -> None:
        """Write the ack position to COMMIT if it changed."""
        if self._dir is None:
            return
        position = self._acked
        head = self._head()
        if head is not None and head.segno == position.segno and head.path is None:
            position = AckRef(position.segno, 0)  # close dumps a RAM segment without its acked items
        if position != self._committed:
            text = json.dumps({"segno": position.segno, "id": position.id})
            self._replace_file(self._dir / _COMMIT, text.encode())
            self._committed = position

    def _replace_file(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            if self._sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if self._sync:
            os.fsync(self._dir_fd)

    def count(self) -> int:
        """Number of items not yet popped (after a reopen: not yet acked)."""
        return self._count

    def overflow_dropped(self) -> Dropped:
        """Items and bytes (size estimates) dropped by overload since open, as `Dropped(items, bytes)`."""
        return self._dropped

    def corrupt_discarded(self) -> Dropped:
        """Items and file bytes discarded by truncating corrupt segments on open, as `Dropped(items, bytes)`."""
        return self._corrupt

    def is_writing_to_disk(self) -> bool:
        """Whether the next append goes to a segment file: always in disk mode, never in memory only,
        and in offload mode while the RAM threshold is exceeded or the disk is not drained yet."""
        return self._to_disk()

    def close(self) -> None:
        """Close the queue; idempotent. In offload mode (not volatile) first dump the RAM items not yet
        acked to segment files, so they are handed out again after reopen. Raises OSError if that fails."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._keep_popped:
                self._dump_ram_segments()
        finally:
            self._close_writer()
            if self._dir_fd is not None:
                os.close(self._dir_fd)

    def _dump_ram_segments(self) -> None:
        for seg in (*self._popped_segs, *self._unpopped_segs):
            items = [item for _, item in seg.unacked] + [item for _, item, _ in seg.unread]
            if seg.path is None and items:
                self._replace_file(self._seg_path(seg.segno), _frames(map(self._payload, items)))

    def purge(self) -> None:
        """Discard every item, popped or not, and delete the segment files. Outstanding refs become
        harmless to ack; the drop counters are unchanged. Raises `ReplayQError` after close."""
        self._check_open()
        self._close_writer()
        segs = [*self._popped_segs, *self._unpopped_segs]
        self._popped_segs.clear()
        self._unpopped_segs.clear()
        self._batches.clear()
        self._count = self._bytes = 0
        if segs:
            self._acked = AckRef(segs[-1].segno, segs[-1].count)
        self._commit()
        for seg in segs:
            if seg.path is not None:
                seg.path.unlink(missing_ok=True)

    def _check_open(self) -> None:
        if self._closed:
            raise ReplayQError("the queue is closed")

    def _seg_path(self, segno: int) -> Path:
        return self._dir / f"{segno:010d}.seg"

    def __enter__(self) -> ReplayQ:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def bytes(self) -> int:
        """Total size estimate in bytes of the items not yet popped; what `max_total_bytes` bounds."""
        return self._bytes
