"""The files of a ReplayQ directory: segment frames, the COMMIT file, the directory lock.

Why its own module: ReplayQ (ecq/events/replayq.py) decides what an item's position is, when it is
handed out, acked or dropped, and whether it lives in RAM or on disk; this module only knows how those
decisions are kept on disk, and never what they mean. `SegmentDir` is the one object that touches the
directory, so the file format can be read, checked and changed in one place.

Files in the directory:

* ``0000000001.seg``, ``0000000002.seg``, ...: segments, the segno as 10 decimal digits. A segment is
  a run of frames; each frame is, big-endian::

      offset 0   4 bytes  magic  b"\\xe5RQ1"
      offset 4   4 bytes  CRC32 of the payload (zlib.crc32), unsigned
      offset 8   4 bytes  payload length in bytes, unsigned (so an item is at most 4 GiB - 1)
      offset 12  payload

* ``COMMIT``: the ack position as JSON ``{"segno": S, "id": I}``: every item up to item I of segment S
  is acked (``I=0``: every segment before S is). It is replaced atomically (ecq/events/atomic.py:
  ``COMMIT.tmp``, fsync, rename, fsync the directory). A COMMIT that cannot be parsed raises
  `ReplayQError` rather than guessing; a missing COMMIT means nothing is acked.
* ``COMMIT.tmp``, ``<segno>.seg.tmp``: an interrupted atomic write; removed by `SegmentDir.segnos`.
  Other names ending in ``.seg`` raise `ReplayQError`; any other file is ignored.

Corruption. `SegmentDir.scan` checks every frame of a segment (magic, length within the file, CRC32).
From the first bad frame on, the segment is truncated; the discarded items (the bad frame plus the
intact frames found after it by searching for the magic) and bytes are logged at ERROR level and
returned. A segment that changed since it was scanned or written makes `SegmentDir.read` raise
`ReplayQError`.
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from ecq.events.atomic import write_atomically

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


@dataclass(eq=False)
class Segment:
    """What a ReplayQ knows of one segment: items with ids 1..count, in a file or (``on_disk`` false) in RAM."""

    segno: int
    on_disk: bool
    keep_popped: bool = False  # RAM segments of non-volatile offload keep popped items until acked
    count: int = 0
    file_bytes: int = 0  # bytes of complete frames in the file
    read_offset: int = 0  # file offset of the first frame not loaded into `unread`
    next_id: int = 1  # id of the first item not loaded into `unread`
    unread: deque[tuple[int, Any, int]] = field(default_factory=deque)  # (id, item, size), next to pop
    unacked: deque[tuple[int, Any]] = field(default_factory=deque)  # (id, item) popped, not yet acked

    def has_unpopped(self) -> bool:
        """Whether items of this segment wait to be popped (loaded into `unread` or still in the file)."""
        return bool(self.unread) or self.next_id <= self.count


class OnDisk(NamedTuple):
    """What `SegmentDir.recover` found: the COMMIT position (None if none), the segments holding unacked
    items in segno order, the segno for the next new segment, the unacked ``items`` and their ``bytes``
    (size estimates), and what corrupt tails discarded."""

    commit: AckRef | None
    segments: list[Segment]
    next_segno: int
    items: int
    bytes: int
    corrupt: Dropped


def frames(payloads: Iterable[bytes]) -> bytes:
    """``payloads`` encoded as consecutive frames (header and payload each)."""
    parts = []
    for payload in payloads:
        parts.append(_HEADER.pack(MAGIC, zlib.crc32(payload), len(payload)))
        parts.append(payload)
    return b"".join(parts)


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
    """Payloads of the valid frames at the start of ``data``, and the offset of the first bad frame (or the end).
    `_frame_end`'s checks, inlined: the lake exporter reads every event the broker records."""
    buf = memoryview(data)
    payloads = []
    offset, size, header = 0, len(buf), _HEADER.size
    unpack, crc32, append = _HEADER.unpack_from, zlib.crc32, payloads.append
    while size - offset >= header:
        magic, crc, length = unpack(buf, offset)
        start = offset + header
        end = start + length
        if magic != MAGIC or end > size or crc32(payload := buf[start:end]) != crc:
            break
        append(payload)
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


class SegmentDir:
    """The locked directory of one ReplayQ: its segment files and its COMMIT file.

    Opening creates ``path`` if missing and takes an exclusive ``flock`` on it until `close`; raises
    `ReplayQError` when another SegmentDir holds it, OSError when it cannot be created or opened.
    With ``sync`` every write is fsynced (files, and the directory when a file is created or renamed);
    without, writes only reach the OS. Appends go to one segment at a time, the writer's (`start_segment`).
    Not thread-safe; every method blocks on disk I/O.
    """

    def __init__(self, path: Path, sync: bool) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._sync = sync
        self._writer: BinaryIO | None = None
        self._fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise ReplayQError(f"{path} is already open by another ReplayQ") from None

    def recover(self, volatile: bool, size: Callable[[memoryview], int]) -> OnDisk:
        """Read the directory as a queue opening it: delete leftover temporary files, then either wipe it
        (``volatile``) or read COMMIT, delete the fully acked segments and `scan` the others, skipping their
        acked items. ``size(payload)`` gives an item's size estimate. Raises `ReplayQError` for a corrupt
        COMMIT or a stray ``*.seg`` name, OSError."""
        segnos = self.segnos()
        if volatile:
            self.wipe(segnos)
            return OnDisk(None, [], 1, 0, 0, Dropped(0, 0))
        commit = self.read_commit()
        acked = commit or AckRef(0, 0)
        segments = []
        next_segno = acked.segno + 1 if commit is not None else 1
        items = nbytes = corrupt_items = corrupt_bytes = 0
        for segno in segnos:
            next_segno = max(next_segno, segno + 1)
            if segno < acked.segno:
                self.remove(segno)
                continue
            skip = acked.id if segno == acked.segno else 0
            payloads, end, discarded = self.scan(segno)
            corrupt_items, corrupt_bytes = corrupt_items + discarded.items, corrupt_bytes + discarded.bytes
            if skip >= len(payloads):
                self.remove(segno)
                continue
            read_offset = sum(_HEADER.size + len(p) for p in payloads[:skip])
            segments.append(Segment(segno, True, count=len(payloads), file_bytes=end, read_offset=read_offset,
                                    next_id=skip + 1))
            items += len(payloads) - skip
            nbytes += sum(map(size, payloads[skip:]))
        return OnDisk(commit, segments, next_segno, items, nbytes, Dropped(corrupt_items, corrupt_bytes))

    def segnos(self) -> list[int]:
        """The segnos of the segment files, ascending, after deleting leftover temporary files.
        Raises `ReplayQError` for another name ending in ``.seg``."""
        segnos = []
        with os.scandir(self.path) as entries:
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

    def read_commit(self) -> AckRef | None:
        """The position in COMMIT, None when there is no COMMIT. Raises `ReplayQError` when it cannot be parsed."""
        path = self.path / _COMMIT
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

    def write_commit(self, position: AckRef) -> None:
        """Replace COMMIT with ``position`` atomically. Raises OSError."""
        text = json.dumps({"segno": position.segno, "id": position.id})
        write_atomically(self.path / _COMMIT, text.encode(), fsync=self._sync)

    def wipe(self, segnos: Iterable[int]) -> None:
        """Delete the segments ``segnos`` and COMMIT (a volatile queue starts empty). Raises OSError."""
        for segno in segnos:
            self.remove(segno)
        (self.path / _COMMIT).unlink(missing_ok=True)

    def scan(self, segno: int) -> tuple[list[memoryview], int, Dropped]:
        """Check every frame of segment ``segno`` and truncate it at the first bad one.

        Returns (payloads of the intact frames, file bytes kept, items and bytes discarded). Raises OSError.
        """
        path = self._seg_path(segno)
        data = path.read_bytes()
        payloads, end = _parse(data)
        if end == len(data):
            return payloads, end, Dropped(0, 0)
        items = _count_discarded(data, end)
        log.error(
            "ReplayQ segment %s: bad frame at byte %d; truncated %d bytes, discarding %d item(s)",
            path, end, len(data) - end, items,
        )
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
        return payloads, end, Dropped(items, len(data) - end)

    def read(self, seg: Segment) -> list[memoryview]:
        """The payloads of the frames of ``seg`` not read yet (from ``seg.read_offset``), and moves
        ``read_offset`` to the end. Raises `ReplayQError` when the file no longer holds exactly the frames
        ``seg`` counts, OSError."""
        path = self._seg_path(seg.segno)
        with open(path, "rb") as f:
            f.seek(seg.read_offset)
            data = f.read(seg.file_bytes - seg.read_offset)
        payloads, parsed = _parse(data)
        if parsed != len(data) or len(payloads) != seg.count - seg.next_id + 1:
            raise ReplayQError(f"segment {path} changed on disk while the queue was open")
        seg.read_offset = seg.file_bytes
        return payloads

    def is_writing(self) -> bool:
        """Whether a writer segment is open (`start_segment` ran and no failure or `stop_writing` since)."""
        return self._writer is not None

    def start_segment(self, segno: int) -> None:
        """Create segment ``segno`` and make it the writer's. Raises OSError."""
        self.stop_writing()
        self._writer = open(self._seg_path(segno), "ab")
        if self._sync:
            os.fsync(self._fd)

    def append(self, segno: int, data: bytes, good_bytes: int) -> None:
        """Append ``data`` (whole frames) to the writer's segment ``segno``, which holds ``good_bytes``.

        On OSError the writer is closed and the file truncated back to ``good_bytes``, then the error raised.
        """
        try:
            self._writer.write(data)
            self._writer.flush()
            if self._sync:
                os.fsync(self._writer.fileno())
        except OSError:
            with contextlib.suppress(OSError):  # closing flushes the rest of the failed write
                self.stop_writing()
            os.truncate(self._seg_path(segno), good_bytes)
            raise

    def stop_writing(self) -> None:
        """Close the writer's segment, if any; the next append needs a `start_segment`."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def write_segment(self, segno: int, payloads: Iterable[bytes]) -> None:
        """Write segment ``segno`` holding ``payloads`` atomically (a RAM segment dumped on close). Raises OSError."""
        write_atomically(self._seg_path(segno), frames(payloads), fsync=self._sync)

    def remove(self, segno: int) -> None:
        """Delete segment ``segno`` if it exists."""
        self._seg_path(segno).unlink(missing_ok=True)

    def close(self) -> None:
        """Close the writer's segment and release the lock; the object is unusable afterwards."""
        try:
            self.stop_writing()
        finally:
            os.close(self._fd)

    def _seg_path(self, segno: int) -> Path:
        return self.path / f"{segno:010d}.seg"
