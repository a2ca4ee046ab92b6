"""ReplayQ: a segmented disk buffer queue between a producer and a sink that may be slow or down.

Behaviour follows emqx/replayq. One producer appends batches of items, one reader pops batches and
acks them; everything not acked is handed out again after a restart. This module holds the queue's
verbs and rules (positions, acks, overload, RAM versus disk); its files are read and written only by
`SegmentDir` (ecq/events/segments.py), and its options, modes included, are in replayq_config.py.

Positions. Items live in numbered segments (segno 1, 2, ...); inside a segment the items have ids 1, 2,
... in append order, so ``(segno, id)`` is a position (seqno) that only grows. `ReplayQ.pop` hands out
the next items and an `AckRef` naming the last one; `ReplayQ.ack` is cumulative: it acks every item up
to that position. A new segment starts once the current one has at least ``seg_bytes`` bytes (an
append is never split, so a segment can pass ``seg_bytes`` by one append). Once every item of a segment
is acked its file is deleted; the segment being written waits until the writer moves on.

Files. In disk and offload mode the items live in segment files in ``dir`` beside a ``COMMIT`` file
holding the ack position; ecq/events/segments.py documents their format. On open, reading resumes after
COMMIT (`ReplayQ.committed` gives that position); a missing COMMIT means nothing is acked, so every item
still on disk is handed out again (segments that were fully acked are already gone), and a COMMIT that
cannot be parsed raises `ReplayQError` rather than guessing. Corrupt segment tails are truncated on open
and reported by `ReplayQ.corrupt_discarded`; later segments are checked on their own, and appends always
go to a fresh segment after open, so item ids and the COMMIT stay consistent.

Overload. Sizes are estimates: ``sizer(item)``, or the payload length (frame headers are not counted).
`ReplayQ.count` and `ReplayQ.bytes` cover items not yet popped. After an append that takes `bytes()`
over ``max_total_bytes``, the oldest unpopped items are dropped (at least one) until it is within the
limit. With ``high_mem_percent`` set, an append made while the machine's memory use is at or above it
(``psutil.virtual_memory().percent`` or ``mem_probe()``) drops at least as many bytes as it added, and
at least one item. Dropped items are counted by `ReplayQ.overflow_dropped`. A drop counts as an ack of
the dropped items: it reaches COMMIT at once when nothing is popped-but-unacked, otherwise with the ack
of the batch handed out just before it. Until then a restart hands dropped disk items out again.

fsync. ``fsync="always"`` (default) makes what `append` returned from survive a power cut, ``"never"``
only a crash of the process; ecq/events/replayq_config.py gives the semantics and the measured cost.

A ReplayQ is not thread-safe, and its disk I/O blocks. Each directory is locked (``flock``) by the
queue that opened it; a second open raises `ReplayQError`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ecq.events.replayq_config import ItemCodec, ReplayQConfig, used_memory_percent
from ecq.events.segments import AckRef, Dropped, OnDisk, ReplayQError, Segment, SegmentDir, frames

__all__ = ["AckRef", "Dropped", "ReplayQ", "ReplayQConfig", "ReplayQError"]


@dataclass(slots=True)
class _Batch:
    """A batch handed out by pop and not yet acked; ``skip_to`` ends a run of items dropped right after it."""

    ref: AckRef
    skip_to: AckRef | None = None


class ReplayQ:
    """A FIFO of items between one producer and one reader, in RAM or on disk.

    Open with `ReplayQ.open`; see the module docstring for modes, files, corruption and overload rules.
    Also a context manager that closes the queue.
    """

    def __init__(self, config: ReplayQConfig) -> None:
        self._cfg = config
        self._codec = ItemCodec(config)
        self._offload = config.offload is not False
        self._keep_popped = config.offload is True
        self._sync = config.fsync == "always"
        self._probe = config.mem_probe or used_memory_percent
        self._count = 0
        self._bytes = 0
        self._dropped = Dropped(0, 0)
        self._corrupt = Dropped(0, 0)
        self._popped_segs: deque[Segment] = deque()  # fully popped, waiting for acks
        self._unpopped_segs: deque[Segment] = deque()  # the reader's segment first, the writer's last
        self._batches: deque[_Batch] = deque()
        self._acked = AckRef(0, 0)
        self._committed: AckRef | None = None
        self._next_segno = 1
        self._files: SegmentDir | None = None
        self._closed = False
        directory = None if config.mem_only else config.dir
        if directory is not None:
            self._files = SegmentDir(directory, sync=self._sync)
            try:
                self._adopt(self._files.recover(config.offload == "volatile", self._codec.size))
            except BaseException:
                self._files.close()
                raise

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

    def _adopt(self, on_disk: OnDisk) -> None:
        """Take over what the directory holds, as read on open."""
        if on_disk.commit is not None:
            self._acked = self._committed = on_disk.commit
        self._unpopped_segs.extend(on_disk.segments)
        self._next_segno = on_disk.next_segno
        self._count, self._bytes, self._corrupt = on_disk.items, on_disk.bytes, on_disk.corrupt

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
        entries = [self._codec.entry(item) for item in items]
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

    def _to_disk(self) -> bool:
        if self._files is None:
            return False
        if not self._offload:
            return True
        tail = self._unpopped_segs[-1] if self._unpopped_segs else None
        if tail is not None and not tail.on_disk:
            return self._bytes >= self._cfg.seg_bytes
        return self._count > 0  # keep spilling until the reader has drained the disk

    def _append_disk(self, entries: list[tuple[Any, bytes, int]]) -> None:
        seg = self._writable_segment()
        data = frames(payload for _, payload, _ in entries)
        self._files.append(seg.segno, data, seg.file_bytes)
        seg.file_bytes += len(data)
        seg.count += len(entries)

    def _writable_segment(self) -> Segment:
        if not self._files.is_writing() or self._unpopped_segs[-1].file_bytes >= self._cfg.seg_bytes:
            return self._new_segment(on_disk=True)
        return self._unpopped_segs[-1]

    def _append_ram(self, entries: list[tuple[Any, bytes, int]]) -> None:
        tail = self._unpopped_segs[-1] if self._unpopped_segs else None
        if tail is None or tail.on_disk:
            tail = self._new_segment(on_disk=False)
        for item, _, size in entries:
            tail.count += 1
            tail.unread.append((tail.count, item, size))
        tail.next_id = tail.count + 1

    def _new_segment(self, on_disk: bool) -> Segment:
        self._stop_writing()
        segno = self._next_segno
        self._next_segno += 1
        if on_disk:
            self._files.start_segment(segno)
        seg = Segment(segno, on_disk, keep_popped=self._keep_popped and not on_disk)
        self._unpopped_segs.append(seg)
        self._settle()
        return seg

    def _stop_writing(self) -> None:
        if self._files is not None:
            self._files.stop_writing()

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
        count_left = count_limit if count_limit is not None else self._count
        bytes_left = bytes_limit
        while count_left and (seg := self._reader_segment()) is not None:
            taken, nbytes, taken_last = self._take_run(seg, count_left, bytes_left, one_at_least=not items)
            if not taken:
                break
            items += taken
            count_left -= len(taken)
            bytes_left = None if bytes_left is None else bytes_left - nbytes
            last_segno, last_id = seg.segno, taken_last
        self._settle()
        if not items:
            return self._acked, []
        ref = AckRef(last_segno, last_id)
        self._batches.append(_Batch(ref))
        return ref, items

    def _reader_segment(self) -> Segment | None:
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

    def _load(self, seg: Segment) -> None:
        payloads = self._files.read(seg)
        first = seg.next_id
        seg.next_id += len(payloads)
        seg.unread.extend((id_, *item) for id_, item in zip(range(first, seg.next_id), self._codec.items(payloads)))

    def _take_run(self, seg: Segment, count: int, bytes_limit: int | None,
                  one_at_least: bool) -> tuple[list[Any], int, int]:
        """Pop up to ``count`` of the loaded items of ``seg``, oldest first, while their sizes add up to at most
        ``bytes_limit`` (None: no limit), the first one whatever its size when ``one_at_least``; returns (items,
        their size, the id of the last one). One loop over the segment's items, not a call per item: the lake
        exporter pops every event the broker records."""
        unread, items, nbytes, last_id = seg.unread, [], 0, 0
        keep = seg.unacked.append if seg.keep_popped else None
        while unread and len(items) < count:
            size = unread[0][2]
            if bytes_limit is not None and nbytes + size > bytes_limit and (items or not one_at_least):
                break
            last_id, item, _ = unread.popleft()
            items.append(item)
            nbytes += size
            if keep is not None:
                keep((last_id, item))
        self._count -= len(items)
        self._bytes -= nbytes
        return items, nbytes, last_id

    def _take(self, seg: Segment, keep: bool) -> tuple[int, Any, int]:
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
            if seg.on_disk:
                self._files.remove(seg.segno)

    def _fully_acked(self, seg: Segment) -> bool:
        return seg.segno < self._acked.segno or (seg.segno == self._acked.segno and self._acked.id >= seg.count)

    def _head(self) -> Segment | None:
        if self._popped_segs:
            return self._popped_segs[0]
        return self._unpopped_segs[0] if self._unpopped_segs else None

    def _commit(self) -> None:
        """Write the ack position to COMMIT if it changed."""
        if self._files is None:
            return
        position = self._acked
        head = self._head()
        if head is not None and head.segno == position.segno and not head.on_disk:
            position = AckRef(position.segno, 0)  # close dumps a RAM segment without its acked items
        if position != self._committed:
            self._files.write_commit(position)
            self._committed = position

    def committed(self) -> AckRef:
        """The ack position last written to COMMIT: what a reopen of the directory resumes after.

        Every item up to it was acked or dropped; ``AckRef(0, 0)`` when nothing was ever committed, and
        always for a memory-only queue. It trails `ack` only in offload mode, where a RAM segment is
        committed as ``(segno, 0)`` because `close` dumps it without its acked items. Reads no file.
        """
        return AckRef(0, 0) if self._committed is None else self._committed

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
            if self._files is not None:
                self._files.close()

    def _dump_ram_segments(self) -> None:
        for seg in (*self._popped_segs, *self._unpopped_segs):
            items = [item for _, item in seg.unacked] + [item for _, item, _ in seg.unread]
            if not seg.on_disk and items:
                self._files.write_segment(seg.segno, map(self._codec.payload, items))

    def purge(self) -> None:
        """Discard every item, popped or not, and delete the segment files. Outstanding refs become
        harmless to ack; the drop counters are unchanged. Raises `ReplayQError` after close."""
        self._check_open()
        self._stop_writing()
        segs = [*self._popped_segs, *self._unpopped_segs]
        self._popped_segs.clear()
        self._unpopped_segs.clear()
        self._batches.clear()
        self._count = self._bytes = 0
        if segs:
            self._acked = AckRef(segs[-1].segno, segs[-1].count)
        self._commit()
        for seg in segs:
            if seg.on_disk:
                self._files.remove(seg.segno)

    def _check_open(self) -> None:
        if self._closed:
            raise ReplayQError("the queue is closed")

    def __enter__(self) -> ReplayQ:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def bytes(self) -> int:
        """Total size estimate in bytes of the items not yet popped; what `max_total_bytes` bounds."""
        return self._bytes
