"""The ECQ tables in one LevelDB database: opening, checking and committing (the reads are in
ecq.store.leveldb_reads, the key layout and encodings in ecq.store.leveldb_tables).

:meth:`LevelDbStore.commit` applies a list of operations as one LevelDB write batch, so a crash leaves all of
it or none. The methods block (LevelDB I/O, with the GIL released by plyvel) and are meant to run in a thread
pool, off the event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import plyvel

from ecq.queue.throttle import LogThrottle
from ecq.store.committed import CommittedSeqnos, Missing, describe as _describe_missing
from ecq.store.leveldb_files import Gate, cut_logs, reason as _reason, repair_command, repair_hint, room_to_reopen
from ecq.store.leveldb_reads import LevelDbReads
from ecq.store.leveldb_tables import (INDEX, INDEX_VALUE, PAYLOAD, SEQNO, STATE, U64, BatchState, decode_state, encode_s,
                                      encode_state, expiry_key, index_key_and_expiry, index_value)
from ecq.store.protocol import (Append, Appended, Expire, ExpiredRow, ForgetQueue, Op, QueueQuota, QuotaExceeded, SaveAck,
                                StoreError, StoreListener)

log = logging.getLogger(__name__)

_L0_INLINE_LIMIT = 4  # level-0 files; LevelDB slows writes at 8 and stops them at 12
_NO_INDEX_VALUE = INDEX_VALUE.pack(0, 0)  # a payload row without its index row: 0 bytes, no expiry
ROOM_LOG_INTERVAL_S = 30.0  # while writes are suspended for want of space: one line saying what is waited for


class LevelDbStore(LevelDbReads):
    """The ECQ LevelDB database at ``path`` (created if missing), opened with ``paranoid_checks``.

    Raises StoreError when the database cannot be opened, or when it stores less than ECQ committed (its log
    was truncated or deleted: see ecq.store.committed), naming the queues and seqnos missing; with
    ``accept_lost_writes`` it opens anyway and lists them in ``accepted_loss`` (``ecq repair``). ``sync=True``
    fsyncs every commit. ``quota`` bounds each queue, checked in the append's own write batch (entry and byte
    counts of a queue are read once, then kept in memory while quotas are on). ``max_open_files`` and
    ``cache_bytes`` are LevelDB's table cache size (its open table files are memory-mapped: this bounds the
    store's file-backed RSS) and block cache size in bytes; None keeps LevelDB's defaults (1000 files, 8 MiB). A
    broker that may call :meth:`reopen_if_space` runs its reads through :meth:`run`, so that no read uses the
    database while it is closed and opened again; :meth:`commit` takes care of itself."""

    shared = False  # one broker holds the LevelDB lock
    edge_order = "clientid"  # the index table's key order; by time would read every index row

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
        the last key read intact."""
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
        reopened (then every operation fails until a later call succeeds)."""
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
        the next open (with paranoid checks) would fail."""
        if self.write_error:
            raise StoreError(f"writes suspended until LevelDB is reopened: {self.write_error}")
        done = BatchState()
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

    def _commit(self, ops: Sequence[Op], done: BatchState) -> list[Appended | QuotaExceeded | tuple[ExpiredRow, ...]
                                                                     | bool | None]:
        results: list[Appended | QuotaExceeded | tuple[ExpiredRow, ...] | bool | None] = []
        # one iterator, re-seeked per append, is several times cheaper than a new one per compaction scan
        with self._db.write_batch(transaction=True, sync=self._sync) as batch, \
                self._db.iterator(include_value=False) as payload_keys:
            for op in ops:
                if isinstance(op, Append):
                    results.append(self._append(batch, payload_keys, op, done))
                elif isinstance(op, SaveAck):
                    batch.put(STATE + encode_s(op.clientid), encode_state(op.state))
                    done.touched.add(op.clientid)
                    results.append(None)
                elif isinstance(op, Expire):
                    results.append(self._expire(batch, op, done))
                else:
                    results.append(self._forget(batch, op, done))
        return results

    def _append(self, batch, payload_keys, op: Append, done: BatchState) -> Appended | QuotaExceeded:
        clientid, size = op.clientid, len(op.payload)
        queue = encode_s(clientid)
        index_prefix, payload_prefix = INDEX + queue, PAYLOAD + queue + encode_s(op.key)
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
        batch.put(SEQNO + queue, U64.pack(seqno) + U64.pack(op.ts_ms))
        batch.put(index_prefix + U64.pack(seqno), index_value(op.ts_ms, size, op.key, op.expires_ms))
        batch.put(payload_prefix + U64.pack(seqno) + U64.pack(op.ts_ms), op.payload)
        if op.expires_ms:
            batch.put(expiry_key(op.expires_ms, clientid, seqno), b"")
            done.expiries[(clientid, seqno)] = op.expires_ms
        for old_seqno, old_ts, _size, old_expires in older:
            batch.delete(index_prefix + U64.pack(old_seqno))
            batch.delete(payload_prefix + U64.pack(old_seqno) + U64.pack(old_ts))
            if old_expires:
                batch.delete(expiry_key(old_expires, clientid, old_seqno))
            done.deleted.add((clientid, old_seqno))
        done.latest[slot] = (seqno, op.ts_ms, size, op.expires_ms)
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

    def _expire(self, batch, op: Expire, done: BatchState) -> tuple[ExpiredRow, ...]:
        """Delete the rows of ``op`` that are still stored; returns them. A row is gone when an append of
        its key replaced it (in this batch, or committed after GC read the row) or an Expire deleted it."""
        clientid = op.clientid
        queue = encode_s(clientid)
        index_prefix, payload_prefix = INDEX + queue, PAYLOAD + queue
        pack, get = U64.pack, self._db.get
        deleted = []
        for row in op.rows:
            seqno_bytes = pack(row.seqno)
            index_key = index_prefix + seqno_bytes
            if (clientid, row.seqno) in done.deleted or (value := get(index_key)) is None:
                continue
            batch.delete(index_key)
            batch.delete(payload_prefix + encode_s(row.key) + seqno_bytes + pack(row.ts_ms))
            if expires_ms := index_key_and_expiry(value)[1]:
                batch.delete(expiry_key(expires_ms, clientid, row.seqno))
            done.deleted.add((clientid, row.seqno))
            deleted.append(row)
        if deleted and (sizes := self._sizes.get(clientid)):
            sizes[0] -= len(deleted)
            sizes[1] -= sum(row.size for row in deleted)
        return tuple(deleted)

    # --- queue quotas -------------------------------------------------------------------------------

    def _refusal(self, clientid: str, size: int, replaced: int, replaced_bytes: int,
                 done: BatchState) -> QuotaExceeded | None:
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

    def _queue_sizes(self, clientid: str, done: BatchState) -> list[int]:
        """[entries, payload bytes] the queue of ``clientid`` stores, this batch's ops so far included (read
        from the index table the first time, then kept up to date by the commits)."""
        if (sizes := self._sizes.get(clientid)) is None:
            sizes = self._sizes[clientid] = [0, 0]
            for _seqno, _key, _ts_ms, size in self._stored_rows(clientid, done):
                sizes[0] += 1
                sizes[1] += size
        return sizes

    def _stored_rows(self, clientid: str, done: BatchState) -> Iterator[ExpiredRow]:
        """The rows of ``clientid``'s queue in seqno order as this batch leaves them so far: the database's
        rows this batch did not delete, then the rows it appended."""
        prefix = INDEX + encode_s(clientid)
        for index_key, value in self._db.iterator(prefix=prefix):
            seqno = U64.unpack_from(index_key, len(prefix))[0]
            if (clientid, seqno) not in done.deleted:
                ts_ms, size = INDEX_VALUE.unpack_from(value)
                key, expires_ms = index_key_and_expiry(value)
                if expires_ms:
                    done.expiries[(clientid, seqno)] = expires_ms
                yield ExpiredRow(seqno, key, ts_ms, size)
        yield from (row for row in done.added.get(clientid, ()) if (clientid, row.seqno) not in done.deleted)

    def _evict(self, batch, clientid: str, done: BatchState) -> tuple[ExpiredRow, ...]:
        """Delete the oldest entries of ``clientid``'s queue until it is within the quota again (the newest
        entry alone always fits: a larger one was refused). Returns them."""
        sizes, evicted = self._sizes[clientid], []
        index_prefix, payload_prefix = INDEX + encode_s(clientid), PAYLOAD + encode_s(clientid)
        for row in self._stored_rows(clientid, done):
            if not self._quota.over(*sizes):
                break
            batch.delete(index_prefix + U64.pack(row.seqno))
            batch.delete(payload_prefix + encode_s(row.key) + U64.pack(row.seqno) + U64.pack(row.ts_ms))
            if expires_ms := done.expiries.get((clientid, row.seqno)):
                batch.delete(expiry_key(expires_ms, clientid, row.seqno))
            done.deleted.add((clientid, row.seqno))
            if done.latest.get((clientid, row.key), (0,))[0] == row.seqno:
                del done.latest[(clientid, row.key)]  # a later append of that key in this batch finds no older value
            sizes[0] -= 1
            sizes[1] -= row.size
            evicted.append(row)
        return tuple(evicted)

    # --- state GC -----------------------------------------------------------------------------------

    def _forget(self, batch, op: ForgetQueue, done: BatchState) -> bool:
        """Delete the seqno and state rows of an empty queue idle since ``op.cutoff_ms`` (see ForgetQueue)."""
        clientid = op.clientid
        queue = encode_s(clientid)
        if clientid in done.touched or next(self._stored_rows(clientid, done), None) is not None:
            return False
        seqno_row, state_row = self._db.get(SEQNO + queue), self._db.get(STATE + queue)
        last_write_ms = U64.unpack_from(seqno_row, 8)[0] if seqno_row and len(seqno_row) >= 16 else 0
        if last_write_ms >= op.cutoff_ms or state_row and decode_state(state_row).last_ack_ms >= op.cutoff_ms:
            return False
        if seqno_row is None and state_row is None:
            return False
        self._committed.withdraw(clientid)  # its seqno starts again at 1: ECQ-COMMITTED must not claim more
        batch.delete(SEQNO + queue)
        batch.delete(STATE + queue)
        with self._seqno_lock:
            self._seqnos[clientid] = 0  # an append later in this batch starts again at seqno 1
        self._sizes.pop(clientid, None)
        done.forgotten.append(clientid)
        return True

    def _live_versions(self, payload_keys, index_prefix: bytes, payload_prefix: bytes
                       ) -> Iterator[tuple[int, int, int, int]]:
        """(seqno, publish ms, payload bytes, expiry ms or 0) of the stored values of one key (usually one)."""
        payload_keys.seek(payload_prefix)
        for row in payload_keys:
            if not row.startswith(payload_prefix):
                break
            seqno, ts_ms = U64.unpack_from(row, len(payload_prefix)), U64.unpack_from(row, len(payload_prefix) + 8)
            value = self._db.get(index_prefix + U64.pack(seqno[0])) or _NO_INDEX_VALUE
            yield seqno[0], ts_ms[0], INDEX_VALUE.unpack_from(value)[1], index_key_and_expiry(value)[1]

    def _next_seqno(self, clientid: str) -> int:
        with self._seqno_lock:
            last = self._seqnos.get(clientid)
            if last is None:
                raw = self._db.get(SEQNO + encode_s(clientid))
                last = U64.unpack_from(raw)[0] if raw else 0
            self._seqnos[clientid] = last + 1
            return last + 1
