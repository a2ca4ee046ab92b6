"""The ECQ tables in one LevelDB database.

Key layout (one leading byte per table; ``S(x)`` = 2-byte big-endian length + UTF-8 bytes, so a prefix
scan over ``S(clientid)`` returns exactly one client's rows and ``a`` never collides with ``a/b``;
``U64`` = 8-byte big-endian unsigned, so seqnos and timestamps sort numerically):

=======  ========================================  ==================================================
table    key                                       value
=======  ========================================  ==================================================
seqno    ``s`` S(clientid)                         U64 last assigned seqno (seqnos start at 1), U64 its publish ms
state    ``a`` S(clientid)                         U64 acked seqno, U64 last-ack ms, U64* acked above it
index    ``i`` S(clientid) U64(seqno)              U64 publish ms, U32 payload bytes, key bytes
payload  ``p`` S(clientid) S(key) U64(seqno) U64(ms)  payload bytes
=======  ========================================  ==================================================

All timestamps are milliseconds since the Unix epoch (a seqno row written before ECQ kept the last publish time
holds the seqno alone, read as published at 0). :meth:`LevelDbStore.commit` applies a list of operations
as one LevelDB write batch, so a crash leaves all of it or none. The methods block (LevelDB I/O, with
the GIL released by plyvel) and are meant to run in a thread pool, off the event loop.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import plyvel

from ecq.store.protocol import (AckState, Append, Appended, Expire, ExpiredRow, ForgetQueue, IndexEntry, Message, Op,
                             QueueQuota, QuotaExceeded, SaveAck, StoreError, StoreListener, StoreReadError)
from ecq.store.committed import CommittedSeqnos, Missing, describe as _describe_missing
from ecq.store.leveldb_files import Gate, cut_logs, reason as _reason, repair_command, repair_hint, room_to_reopen
from ecq.queue.throttle import LogThrottle

log = logging.getLogger(__name__)

_U64 = struct.Struct(">Q")
_INDEX_VALUE = struct.Struct(">QI")  # publish ms, payload size in bytes; the key follows
_SEQNO, _STATE, _INDEX, _PAYLOAD = b"s", b"a", b"i", b"p"
_MAX_U64 = b"\xff" * 8
_INDEX_END = bytes([_INDEX[0] + 1])  # first key after the index table


def _s(text: str) -> bytes:
    raw = text.encode()
    return len(raw).to_bytes(2, "big") + raw


def _read_s(buf: bytes, offset: int) -> tuple[str, int]:
    size = int.from_bytes(buf[offset:offset + 2], "big")
    end = offset + 2 + size
    return buf[offset + 2:end].decode(), end


def _payload_key(clientid: str, key: str, seqno: int, ts_ms: int) -> bytes:
    return _PAYLOAD + _s(clientid) + _s(key) + _U64.pack(seqno) + _U64.pack(ts_ms)


_L0_INLINE_LIMIT = 4  # level-0 files; LevelDB slows writes at 8 and stops them at 12
ROOM_LOG_INTERVAL_S = 30.0  # while writes are suspended for want of space: one line saying what is waited for


class LevelDbStore:
    """The ECQ LevelDB database at ``path`` (created if missing), opened with ``paranoid_checks``.

    Raises StoreError when the database cannot be opened, or when it stores less than ECQ committed (its log
    was truncated or deleted: see ecq.store.committed), naming the queues and seqnos missing; with
    ``accept_lost_writes`` it opens anyway and lists them in ``accepted_loss`` (``ecq repair``). ``sync=True``
    fsyncs every commit. ``quota`` bounds each queue, checked in the append's own write batch (entry and byte
    counts of a queue are read once, then kept in memory while quotas are on). ``max_open_files`` and ``cache_bytes`` are LevelDB's table cache size
    (its open table files are memory-mapped: this bounds the store's file-backed RSS) and block cache size in
    bytes; None keeps LevelDB's defaults (1000 files, 8 MiB). A broker
    that may call :meth:`reopen_if_space` runs its reads through :meth:`run`, so that no read uses the
    database while it is closed and opened again; :meth:`commit` takes care of itself.
    """

    shared = False  # one broker holds the LevelDB lock

    def __init__(self, path: Path, sync: bool = False, quota: QueueQuota = QueueQuota(),
                 max_open_files: int | None = None, cache_bytes: int | None = None,
                 accept_lost_writes: bool = False) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._sync = sync
        self._quota = quota
        self._tuning = {"max_open_files": max_open_files, "lru_cache_size": cache_bytes or None}
        self._sizes: dict[str, list[int]] = {}  # clientid -> [entries, payload bytes], while quotas are on
        self._seqnos: dict[str, int] = {}
        self._seqno_lock = threading.Lock()
        self._gate = Gate()
        self.write_error: str | None = None  # the I/O error that suspended commits; None again after a reopen
        self._room_log = LogThrottle(ROOM_LOG_INTERVAL_S)
        for log_file, cut in cut_logs(path):
            log.warning("LevelDB log %s ends inside a record (%d bytes): its last write was cut off (power loss, "
                        "full disk or a truncated file); what followed it, if anything, is lost", log_file, cut)
        self._db = self._open()
        self._committed = CommittedSeqnos(path)
        self.accepted_loss = self._check_committed(accept_lost_writes)
        self._committed.start()

    def _check_committed(self, accept: bool) -> list[Missing]:
        """Compare the opened database with what ECQ committed (ecq.store.committed), then start that record over:
        opening turned LevelDB's log into a table file. Returns what is missing when ``accept``; otherwise
        raises StoreError naming it. Closes the database when it raises."""
        try:
            missing = self._committed.missing(self.last_seqno)
            if missing and not accept:
                raise StoreError(f"LevelDB at {self.path} lost writes that ECQ had committed and acknowledged (its "
                                 f"log was truncated or deleted, or files were removed, while the broker was "
                                 f"stopped): {_describe_missing(missing)}; {repair_command(self.path)} accepts the "
                                 f"loss, then the broker starts with what is left")
            if missing:
                log.warning("LevelDB at %s: accepted the loss of %s", self.path, _describe_missing(missing))
            self._committed.start_over()
            return missing
        except OSError as exc:
            self._db.close()
            raise StoreError(f"cannot check what LevelDB at {self.path} lost: {exc}") from exc
        except BaseException:
            self._db.close()
            raise

    def _open(self) -> plyvel.DB:
        """Open with ``paranoid_checks``: LevelDB then fails the open on a damaged log or table metadata
        instead of skipping what it cannot read. Raises StoreError naming the directory and LevelDB's reason."""
        try:
            return plyvel.DB(str(self.path), create_if_missing=True, paranoid_checks=True, **self._tuning)
        except plyvel.IOError as exc:
            reason = _reason(exc)
            if "lock" in reason.lower():
                raise StoreError(f"cannot open LevelDB at {self.path}: {reason} (is another broker using it?)") from exc
            raise StoreError(f"cannot open LevelDB at {self.path}: {reason}") from exc
        except plyvel.CorruptionError as exc:
            raise StoreError(f"LevelDB at {self.path} is corrupt: {_reason(exc)}; {repair_hint(self.path)}") from exc

    def verify(self) -> tuple[int, float]:
        """Read every stored row with checksums on (not filling the block cache): LevelDB opens table files
        lazily, so a damaged ``.ldb`` is otherwise found only when delivery reads it. O(stored bytes):
        about 0.15 s for 100k entries (200k rows, 7 MB) on the 2-core dev VM.

        Returns (rows, seconds). Raises StoreError naming the file (when LevelDB names it), the reason, and
        the last key read intact.
        """
        started, rows, last = time.monotonic(), 0, b""
        try:
            with self._gate:
                # values share the blocks of their keys: reading every key reads (and checks) every block
                for key in self._db.iterator(verify_checksums=True, fill_cache=False, include_value=False):
                    rows, last = rows + 1, key
        except (plyvel.CorruptionError, plyvel.IOError) as exc:
            where = f"after {rows} intact rows, the last with key {last[:40]!r}" if rows else "before any intact row"
            raise StoreError(f"LevelDB at {self.path} is corrupt: {_reason(exc)} (start-up check, {where}); "
                             f"{repair_hint(self.path)}") from exc
        return rows, time.monotonic() - started

    def watch(self, listener: StoreListener) -> None:
        """Nothing to watch: every append comes through this broker's own commits."""

    def commit_async(self, ops: Sequence[Op]) -> None:
        """None: LevelDB commits run inline or in a writer thread."""

    def read_async(self, func: Callable, *args: object) -> None:
        """None: LevelDB reads run in reader threads."""

    def close(self) -> None:
        """Close the database (pending writes were already committed by :meth:`commit`), then record the seqnos
        committed since the last checkpoint (ecq.store.committed); a failure to do so is logged."""
        self._committed.stop()
        with self._gate.exclusive():
            self._db.close()
        try:
            self._committed.record()
        except OSError as exc:
            log.error("ECQ cannot record the committed seqnos in %s at close (%s): a LevelDB log lost before the "
                      "next start would go unnoticed", self._committed.file, exc)

    def run(self, func: Callable, *args):
        """``func(*args)`` while no :meth:`reopen_if_space` can close the database under it (for reads that iterate)."""
        with self._gate:
            return func(*args)

    def reopen_if_space(self) -> bool:
        """After a failed commit: once the volume has room (ecq.store.leveldb_files.room_to_reopen: twice the
        log plus 8 MiB free, less on a small volume), close and reopen LevelDB, which starts a new log and clears
        the error LevelDB keeps after a failed background write (a memtable flush that hit ENOSPC fails every
        later write until the database is reopened); then commits are accepted again. While there is not room,
        logs what it waits for (bytes free, bytes needed) every ROOM_LOG_INTERVAL_S. Blocks until no read or
        commit is running. Returns True when the database was reopened. Raises StoreError if it cannot be
        reopened (then every operation fails until a later call succeeds).
        """
        room = room_to_reopen(self.path)
        if not room.enough:
            if self._room_log.due() is not None:
                log.warning("ECQ store writes stay suspended (%s) until LevelDB at %s can be reopened: %s",
                            self.write_error, self.path, room)
            return False
        self._room_log = LogThrottle(ROOM_LOG_INTERVAL_S)  # the next time space runs out is told at once
        with self._gate.exclusive():
            self._db.close()
            self._seqnos.clear()  # seqnos handed out by failed batches were never stored
            self._sizes.clear()
            self._db = self._open()
            self.write_error = None
        return True

    def commits_without_waiting(self) -> bool:
        """True when a commit should not block on disk: no fsync (``sync`` off) and LevelDB's level 0 below
        its write-slowdown mark (4 of the 8 files at which LevelDB starts delaying every write by 1 ms), and
        no reopen under way."""
        if self._sync or self._gate.reopening:  # a commit would wait for the reopen: not on the event loop
            return False
        with self._gate:
            return int(self._db.get_property(b"leveldb.num-files-at-level0")) < _L0_INLINE_LIMIT

    # --- writes -------------------------------------------------------------------------------------

    def commit(self, ops: Sequence[Op]) -> list[Appended | tuple[ExpiredRow, ...] | None]:
        """Apply ``ops`` in order as one atomic write batch (group commit).

        Returns one result per op: :class:`Appended` for an Append, the rows it deleted for an Expire
        (those still stored: an append of the same key may have replaced one since GC read it), None for
        a SaveAck. Raises plyvel errors on failure; then nothing was written.

        After an I/O error (disk full) every commit raises StoreError until :meth:`reopen_if_space`
        succeeds: a failed log write can leave a partial record at the log's end, which LevelDB's recovery
        reads as an unfinished last write; a record written after it would make it a damaged middle, and
        the next open (with paranoid checks) would fail.
        """
        if self.write_error:
            raise StoreError(f"writes suspended until LevelDB is reopened: {self.write_error}")
        done = _BatchState()
        try:
            with self._gate:
                results = self._commit(ops, done)
        except BaseException as exc:
            for op in ops:  # the counts kept for the quota may include this batch's ops: read them again
                self._sizes.pop(op.clientid, None)
            if isinstance(exc, plyvel.IOError | RuntimeError):  # RuntimeError: closed (a reopen failed)
                self.write_error = _reason(exc)
            raise
        for clientid in done.forgotten:
            with self._seqno_lock:
                if self._seqnos.get(clientid) == 0:  # not written again in the same batch
                    del self._seqnos[clientid]
        if done.appended:
            self._committed.note(done.appended)
        return results

    def _commit(self, ops: Sequence[Op], done: _BatchState) -> list[Appended | QuotaExceeded | tuple[ExpiredRow, ...]
                                                                     | bool | None]:
        results: list[Appended | QuotaExceeded | tuple[ExpiredRow, ...] | bool | None] = []
        # one iterator, re-seeked per append, is several times cheaper than a new one per compaction scan
        with self._db.write_batch(transaction=True, sync=self._sync) as batch, \
                self._db.iterator(include_value=False) as payload_keys:
            for op in ops:
                if isinstance(op, Append):
                    results.append(self._append(batch, payload_keys, op, done))
                elif isinstance(op, SaveAck):
                    batch.put(_STATE + _s(op.clientid), _encode_state(op.state))
                    done.touched.add(op.clientid)
                    results.append(None)
                elif isinstance(op, Expire):
                    results.append(self._expire(batch, op, done))
                else:
                    results.append(self._forget(batch, op, done))
        return results

    def _append(self, batch, payload_keys, op: Append, done: _BatchState) -> Appended | QuotaExceeded:
        clientid, size = op.clientid, len(op.payload)
        queue = _s(clientid)
        index_prefix, payload_prefix = _INDEX + queue, _PAYLOAD + queue + _s(op.key)
        slot = (clientid, op.key)
        if slot in done.latest:  # older rows in the database were already deleted by that earlier op
            older = [done.latest[slot]]
        else:
            older = [version for version in self._live_versions(payload_keys, index_prefix, payload_prefix)
                     if (clientid, version[0]) not in done.deleted]
        replaced_bytes = sum(old[2] for old in older)
        if self._quota and (refused := self._refusal(clientid, size, len(older), replaced_bytes, done)):
            return refused
        seqno = self._next_seqno(clientid)
        batch.put(_SEQNO + queue, _U64.pack(seqno) + _U64.pack(op.ts_ms))
        batch.put(index_prefix + _U64.pack(seqno), _INDEX_VALUE.pack(op.ts_ms, size) + op.key.encode())
        batch.put(payload_prefix + _U64.pack(seqno) + _U64.pack(op.ts_ms), op.payload)
        for old_seqno, old_ts, _size in older:
            batch.delete(index_prefix + _U64.pack(old_seqno))
            batch.delete(payload_prefix + _U64.pack(old_seqno) + _U64.pack(old_ts))
            done.deleted.add((clientid, old_seqno))
        done.latest[slot] = (seqno, op.ts_ms, size)
        done.appended[clientid] = seqno
        done.touched.add(clientid)
        evicted: tuple[ExpiredRow, ...] = ()
        if self._quota:
            sizes = self._sizes[clientid]
            sizes[0] += 1 - len(older)
            sizes[1] += size - replaced_bytes
            done.added.setdefault(clientid, []).append(ExpiredRow(seqno, op.key, op.ts_ms, size))
            if self._quota.over(*sizes):
                evicted = self._evict(batch, clientid, done)
        return Appended(seqno, tuple(old[0] for old in older), replaced_bytes, evicted)

    def _expire(self, batch, op: Expire, done: _BatchState) -> tuple[ExpiredRow, ...]:
        """Delete the rows of ``op`` that are still stored; returns them. A row is gone when an append of
        its key replaced it (in this batch, or committed after GC read the row) or an Expire deleted it."""
        clientid = op.clientid
        queue = _s(clientid)
        index_prefix, payload_prefix = _INDEX + queue, _PAYLOAD + queue
        pack, get = _U64.pack, self._db.get
        deleted = []
        for row in op.rows:
            seqno_bytes = pack(row.seqno)
            index_key = index_prefix + seqno_bytes
            if (clientid, row.seqno) in done.deleted or get(index_key) is None:
                continue
            batch.delete(index_key)
            batch.delete(payload_prefix + _s(row.key) + seqno_bytes + pack(row.ts_ms))
            done.deleted.add((clientid, row.seqno))
            deleted.append(row)
        if deleted and (sizes := self._sizes.get(clientid)):
            sizes[0] -= len(deleted)
            sizes[1] -= sum(row.size for row in deleted)
        return tuple(deleted)

    # --- queue quotas -------------------------------------------------------------------------------

    def _refusal(self, clientid: str, size: int, replaced: int, replaced_bytes: int,
                 done: _BatchState) -> QuotaExceeded | None:
        """Why the quota refuses an append of ``size`` bytes replacing ``replaced`` entries, or None."""
        quota = self._quota
        if quota.max_bytes and size > quota.max_bytes:
            return QuotaExceeded(f"refused a write of {size} bytes to the queue of {clientid!r}: larger than "
                                 f"max_queue_bytes ({quota.max_bytes})")
        entries, stored = self._queue_sizes(clientid, done)
        if quota.policy == "refuse" and quota.over(entries + 1 - replaced, stored + size - replaced_bytes):
            return QuotaExceeded(f"refused a write to the queue of {clientid!r}: it holds {entries} entries, "
                                 f"{stored} bytes (max_queue_messages {quota.max_messages or 'unlimited'}, "
                                 f"max_queue_bytes {quota.max_bytes or 'unlimited'}, quota_policy refuse)")
        return None

    def _queue_sizes(self, clientid: str, done: _BatchState) -> list[int]:
        """[entries, payload bytes] the queue of ``clientid`` stores, this batch's ops so far included (read
        from the index table the first time, then kept up to date by the commits)."""
        if (sizes := self._sizes.get(clientid)) is None:
            sizes = self._sizes[clientid] = [0, 0]
            for _seqno, _key, _ts_ms, size in self._stored_rows(clientid, done):
                sizes[0] += 1
                sizes[1] += size
        return sizes

    def _stored_rows(self, clientid: str, done: _BatchState) -> Iterator[ExpiredRow]:
        """The rows of ``clientid``'s queue in seqno order as this batch leaves them so far: the database's
        rows this batch did not delete, then the rows it appended."""
        prefix = _INDEX + _s(clientid)
        for index_key, value in self._db.iterator(prefix=prefix):
            seqno = _U64.unpack_from(index_key, len(prefix))[0]
            if (clientid, seqno) not in done.deleted:
                ts_ms, size = _INDEX_VALUE.unpack_from(value)
                yield ExpiredRow(seqno, value[_INDEX_VALUE.size:].decode(), ts_ms, size)
        yield from (row for row in done.added.get(clientid, ()) if (clientid, row.seqno) not in done.deleted)

    def _evict(self, batch, clientid: str, done: _BatchState) -> tuple[ExpiredRow, ...]:
        """Delete the oldest entries of ``clientid``'s queue until it is within the quota again (the newest
        entry alone always fits: a larger one was refused). Returns them."""
        sizes, evicted = self._sizes[clientid], []
        index_prefix, payload_prefix = _INDEX + _s(clientid), _PAYLOAD + _s(clientid)
        for row in self._stored_rows(clientid, done):
            if not self._quota.over(*sizes):
                break
            batch.delete(index_prefix + _U64.pack(row.seqno))
            batch.delete(payload_prefix + _s(row.key) + _U64.pack(row.seqno) + _U64.pack(row.ts_ms))
            done.deleted.add((clientid, row.seqno))
            if done.latest.get((clientid, row.key), (0,))[0] == row.seqno:
                del done.latest[(clientid, row.key)]  # a later append of that key in this batch finds no older value
            sizes[0] -= 1
            sizes[1] -= row.size
            evicted.append(row)
        return tuple(evicted)

    # --- state GC -----------------------------------------------------------------------------------

    def _forget(self, batch, op: ForgetQueue, done: _BatchState) -> bool:
        """Delete the seqno and state rows of an empty queue idle since ``op.cutoff_ms`` (see ForgetQueue)."""
        clientid = op.clientid
        queue = _s(clientid)
        if clientid in done.touched or next(self._stored_rows(clientid, done), None) is not None:
            return False
        seqno_row, state_row = self._db.get(_SEQNO + queue), self._db.get(_STATE + queue)
        last_write_ms = _U64.unpack_from(seqno_row, 8)[0] if seqno_row and len(seqno_row) >= 16 else 0
        if last_write_ms >= op.cutoff_ms or state_row and _decode_state(state_row).last_ack_ms >= op.cutoff_ms:
            return False
        if seqno_row is None and state_row is None:
            return False
        self._committed.withdraw(clientid)  # its seqno starts again at 1: ECQ-COMMITTED must not claim more
        batch.delete(_SEQNO + queue)
        batch.delete(_STATE + queue)
        with self._seqno_lock:
            self._seqnos[clientid] = 0  # an append later in this batch starts again at seqno 1
        self._sizes.pop(clientid, None)
        done.forgotten.append(clientid)
        return True

    def _live_versions(self, payload_keys, index_prefix: bytes, payload_prefix: bytes
                       ) -> Iterator[tuple[int, int, int]]:
        """(seqno, publish ms, payload bytes) of the stored values of one key (normally at most one)."""
        payload_keys.seek(payload_prefix)
        for row in payload_keys:
            if not row.startswith(payload_prefix):
                break
            seqno, ts_ms = _U64.unpack_from(row, len(payload_prefix)), _U64.unpack_from(row, len(payload_prefix) + 8)
            index_value = self._db.get(index_prefix + _U64.pack(seqno[0]))
            yield seqno[0], ts_ms[0], _INDEX_VALUE.unpack_from(index_value)[1] if index_value else 0

    def _next_seqno(self, clientid: str) -> int:
        with self._seqno_lock:
            last = self._seqnos.get(clientid)
            if last is None:
                raw = self._db.get(_SEQNO + _s(clientid))
                last = _U64.unpack_from(raw)[0] if raw else 0
            self._seqnos[clientid] = last + 1
            return last + 1

    # --- reads --------------------------------------------------------------------------------------

    def read_after(self, clientid: str, after: int, limit: int, min_ts_ms: int = 0,
                   known_last: int | None = None) -> list[Message]:
        """Up to ``limit`` messages of ``clientid`` with seqno > ``after``, in seqno order.

        Entries published before ``min_ts_ms`` (expired, not yet collected) are skipped. Blocks read from
        disk are checksummed; raises StoreReadError when LevelDB finds one damaged or unreadable.
        """
        try:
            return self._read_after(clientid, after, limit, min_ts_ms)
        except (plyvel.CorruptionError, plyvel.IOError) as exc:
            raise StoreReadError(f"LevelDB at {self.path}: {_reason(exc)}") from exc

    def _read_after(self, clientid: str, after: int, limit: int, min_ts_ms: int) -> list[Message]:
        prefix = _INDEX + _s(clientid)
        messages: list[Message] = []
        with self._db.snapshot() as snap:
            rows = snap.iterator(start=prefix + _U64.pack(after + 1), stop=prefix + _MAX_U64, include_stop=True,
                                 verify_checksums=True)
            for index_key, value in rows:
                seqno = _U64.unpack_from(index_key, len(prefix))[0]
                ts_ms, key = _U64.unpack_from(value)[0], value[_INDEX_VALUE.size:].decode()
                if ts_ms < min_ts_ms:
                    continue
                payload = snap.get(_payload_key(clientid, key, seqno, ts_ms), verify_checksums=True)
                if payload is not None:
                    messages.append(Message(seqno, key, payload, ts_ms))
                    if len(messages) >= limit:
                        break
        return messages

    def ack_state(self, clientid: str) -> AckState:
        """The stored progress of ``clientid``'s consumer (acked 0 when it never acked)."""
        raw = self._db.get(_STATE + _s(clientid))
        return _decode_state(raw) if raw else AckState()

    def last_seqno(self, clientid: str) -> int:
        """Last seqno assigned in the queue of ``clientid`` (0 when it never had a write)."""
        raw = self._db.get(_SEQNO + _s(clientid))
        return _U64.unpack_from(raw)[0] if raw else 0

    def clientids(self) -> Iterator[str]:
        """Every clientid that ever had a write, in key order (reads the seqno table)."""
        for row in self._db.iterator(prefix=_SEQNO, include_value=False):
            yield _read_s(row, 1)[0]

    def expired_step(self, cutoff_ms: int, limit: int, start: bytes | None = None
                     ) -> tuple[dict[str, list[ExpiredRow]], bytes | None]:
        """One GC step: up to ``limit`` entries published before ``cutoff_ms``, scanning the index table
        from ``start`` (None = its beginning) across queues. Returns them by clientid, oldest first, and
        the ``start`` of the next step (None once the whole table was scanned).

        Publish times grow with seqno within a queue, so the scan jumps to the next queue at the first
        entry that is still fresh: a step costs about (expired entries + queues), not stored entries.
        """
        found: dict[str, list[ExpiredRow]] = {}
        taken = 0
        queue, rows_of_queue = b"", []  # rows of one queue are adjacent: decode each clientid once
        unpack_value, unpack_seqno, key_at = _INDEX_VALUE.unpack_from, _U64.unpack_from, _INDEX_VALUE.size
        with self._db.iterator(start=start or _INDEX, stop=_INDEX_END) as rows:
            for index_key, value in rows:
                seqno_at = len(index_key) - 8
                ts_ms, size = unpack_value(value)
                if ts_ms >= cutoff_ms:
                    rows.seek(index_key[:seqno_at] + _MAX_U64 + b"\x00")  # past this queue's last seqno
                    continue
                if index_key[:seqno_at] != queue:
                    queue = index_key[:seqno_at]
                    rows_of_queue = found.setdefault(_read_s(queue, 1)[0], [])
                rows_of_queue.append(ExpiredRow(unpack_seqno(index_key, seqno_at)[0], value[key_at:].decode(), ts_ms, size))
                taken += 1
                if taken >= limit:
                    return found, index_key + b"\x00"
        return found, None

    def idle_queues(self, cutoff_ms: int) -> list[str]:
        """Clientids whose queue stores no entry and had no write and no ack since ``cutoff_ms`` (state GC's
        candidates): one pass over the seqno table, a state lookup and an index seek per queue."""
        idle = []
        with self._db.iterator(prefix=_INDEX, include_value=False) as index_keys:
            for row, value in self._db.iterator(prefix=_SEQNO):
                if len(value) >= 16 and _U64.unpack_from(value, 8)[0] >= cutoff_ms:
                    continue
                queue = row[1:]
                state = self._db.get(_STATE + queue)
                if state and _decode_state(state).last_ack_ms >= cutoff_ms:
                    continue
                index_keys.seek(_INDEX + queue)
                if next(index_keys, b"").startswith(_INDEX + queue):
                    continue
                idle.append(_read_s(row, 1)[0])
        return idle

    def seqnos(self, clientid: str) -> Iterator[int]:
        """Seqnos of the stored entries of ``clientid``, ascending."""
        prefix = _INDEX + _s(clientid)
        for row in self._db.iterator(prefix=prefix, include_value=False):
            yield _U64.unpack_from(row, len(prefix))[0]

    def queue_range(self, clientid: str) -> tuple[int, int, int] | None:
        """(first seqno, last seqno, entry count) of the stored queue of ``clientid``, or None when empty."""
        seqnos = list(self.seqnos(clientid))
        return (seqnos[0], seqnos[-1], len(seqnos)) if seqnos else None

    def stored_totals(self) -> tuple[int, int]:
        """(entries, payload bytes) stored across all queues: a scan of the index table."""
        entries = size = 0
        for value in self._db.iterator(prefix=_INDEX, include_key=False):
            entries += 1
            size += _INDEX_VALUE.unpack_from(value)[1]
        return entries, size

    def count_queues(self) -> int:
        """Queues that ever had a write (rows of the seqno table)."""
        return sum(1 for _ in self._db.iterator(prefix=_SEQNO, include_value=False))

    def edge_index_entries(self) -> tuple[IndexEntry | None, IndexEntry | None]:
        """The first and the last row of the index table, by (clientid, seqno) key order."""
        first = next(self._db.iterator(prefix=_INDEX), None)
        last = next(self._db.iterator(prefix=_INDEX, reverse=True), None)
        return _index_entry(first), _index_entry(last)

    def ack_states(self) -> Iterator[tuple[str, AckState]]:
        """Every stored consumer state as (clientid, state), in clientid key order."""
        for row, value in self._db.iterator(prefix=_STATE):
            yield _read_s(row, 1)[0], _decode_state(value)

    def stored_entries(self, clientid: str | None = None, after: int = 0) -> Iterator[tuple[str, int, int, int]]:
        """(clientid, seqno, publish ms, payload bytes) of every stored entry in (clientid, seqno) key order, one
        pass over the index table; with ``clientid``, only that queue's entries with seqno > ``after``."""
        if clientid is not None:
            prefix = _INDEX + _s(clientid)
            start = prefix + _U64.pack(after + 1)
            for index_key, value in self._db.iterator(start=start, stop=prefix + _MAX_U64, include_stop=True):
                ts_ms, size = _INDEX_VALUE.unpack_from(value)
                yield clientid, _U64.unpack_from(index_key, len(prefix))[0], ts_ms, size
            return
        queue, name = b"", ""  # rows of one queue are adjacent: decode each clientid once
        for index_key, value in self._db.iterator(prefix=_INDEX):
            seqno_at = len(index_key) - 8
            if index_key[:seqno_at] != queue:
                queue = index_key[:seqno_at]
                name = _read_s(queue, 1)[0]
            ts_ms, size = _INDEX_VALUE.unpack_from(value)
            yield name, _U64.unpack_from(index_key, seqno_at)[0], ts_ms, size


class _BatchState:
    """What the earlier ops of one commit did, which the database shows only once the batch is written."""

    __slots__ = ("latest", "deleted", "added", "appended", "touched", "forgotten")

    def __init__(self) -> None:
        self.latest: dict[tuple[str, str], tuple[int, int, int]] = {}  # (clientid, key) -> (seqno, ms, bytes) appended
        self.deleted: set[tuple[str, int]] = set()  # (clientid, seqno) deleted: compaction, Expire, quota eviction
        self.added: dict[str, list[ExpiredRow]] = {}  # clientid -> rows appended, in seqno order (quotas on only)
        self.appended: dict[str, int] = {}  # clientid -> the last seqno appended
        self.touched: set[str] = set()  # queues appended to or acked: state GC leaves them
        self.forgotten: list[str] = []  # queues whose seqno and state rows were deleted (ForgetQueue)


def _index_entry(row: tuple[bytes, bytes] | None) -> IndexEntry | None:
    if row is None:
        return None
    index_key, value = row
    clientid, offset = _read_s(index_key, 1)
    ts_ms, _size = _INDEX_VALUE.unpack_from(value)
    return IndexEntry(clientid, _U64.unpack_from(index_key, offset)[0], value[_INDEX_VALUE.size:].decode(), ts_ms)


def _encode_state(state: AckState) -> bytes:
    above = sorted(s for s in state.above if s > state.acked)
    return b"".join(_U64.pack(v) for v in (state.acked, state.last_ack_ms, *above))


def _decode_state(raw: bytes) -> AckState:
    values = [v for (v,) in _U64.iter_unpack(raw)]
    return AckState(values[0], values[1], set(values[2:]))
