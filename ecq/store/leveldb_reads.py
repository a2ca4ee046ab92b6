"""The reads of :class:`ecq.store.leveldb.LevelDbStore` (a mixin over its ``_db`` and ``path``): a queue's entries
after a seqno, ack states, GC steps, totals and scans, on the tables of ecq.store.leveldb_tables. Each method
blocks on LevelDB I/O (plyvel releases the GIL): run it in a reader thread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import plyvel

from ecq.store.leveldb_files import reason as _reason
from ecq.store.leveldb_tables import (EXPIRY, INDEX, INDEX_END, INDEX_VALUE, MAX_U64, PAYLOAD, SEQNO, STATE, U64,
                                      decode_state, encode_s, index_entry, index_key_and_expiry, payload_key, read_s)
from ecq.store.protocol import AckState, ExpiredRow, IndexEntry, Message, StoreReadError


class LevelDbReads:
    """Read methods of the QueueStore protocol over ``self._db`` (a plyvel.DB, reopened by the store after a full
    disk) at ``self.path``."""

    _db: plyvel.DB
    path: Path

    def read_after(self, clientid: str, after: int, limit: int, min_ts_ms: int = 0,
                   known_last: int | None = None, lapsed_at_ms: int = 0) -> list[Message]:
        """Up to ``limit`` messages of ``clientid`` with seqno > ``after``, in seqno order.

        Entries published before ``min_ts_ms`` or whose own expiry time is at or before ``lapsed_at_ms`` (not 0)
        are skipped (expired, not yet collected). Blocks read from disk are checksummed; raises StoreReadError
        when LevelDB finds one damaged or unreadable.
        """
        try:
            return self._read_after(clientid, after, limit, min_ts_ms, lapsed_at_ms)
        except (plyvel.CorruptionError, plyvel.IOError) as exc:
            raise StoreReadError(f"LevelDB at {self.path}: {_reason(exc)}") from exc

    def _read_after(self, clientid: str, after: int, limit: int, min_ts_ms: int, lapsed_at_ms: int) -> list[Message]:
        prefix = INDEX + encode_s(clientid)
        messages: list[Message] = []
        with self._db.snapshot() as snap:
            rows = snap.iterator(start=prefix + U64.pack(after + 1), stop=prefix + MAX_U64, include_stop=True,
                                 verify_checksums=True)
            for index_key, value in rows:
                seqno = U64.unpack_from(index_key, len(prefix))[0]
                ts_ms, (key, expires_ms) = U64.unpack_from(value)[0], index_key_and_expiry(value)
                if ts_ms < min_ts_ms or 0 < expires_ms <= lapsed_at_ms:
                    continue
                payload = snap.get(payload_key(clientid, key, seqno, ts_ms), verify_checksums=True)
                if payload is not None:
                    messages.append(Message(seqno, key, payload, ts_ms, expires_ms))
                    if len(messages) >= limit:
                        break
        return messages

    def ack_state(self, clientid: str) -> AckState:
        """The stored progress of ``clientid``'s consumer (acked 0 when it never acked)."""
        raw = self._db.get(STATE + encode_s(clientid))
        return decode_state(raw) if raw else AckState()

    def key_bytes(self, clientid: str, key: str) -> int | None:
        """Payload bytes of the newest stored value of ``key`` in the queue of ``clientid``, None when none is
        stored: one seek in the payload table."""
        prefix = PAYLOAD + encode_s(clientid) + encode_s(key)
        for payload in self._db.iterator(prefix=prefix, include_key=False, reverse=True):
            return len(payload)
        return None

    def last_seqno(self, clientid: str) -> int:
        """Last seqno assigned in the queue of ``clientid`` (0 when it never had a write)."""
        raw = self._db.get(SEQNO + encode_s(clientid))
        return U64.unpack_from(raw)[0] if raw else 0

    def clientids(self) -> Iterator[str]:
        """Every clientid that ever had a write, in key order (reads the seqno table)."""
        for row in self._db.iterator(prefix=SEQNO, include_value=False):
            yield read_s(row, 1)[0]

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
        unpack_value, unpack_seqno = INDEX_VALUE.unpack_from, U64.unpack_from
        with self._db.iterator(start=start or INDEX, stop=INDEX_END) as rows:
            for index_key, value in rows:
                seqno_at = len(index_key) - 8
                ts_ms, size = unpack_value(value)
                if ts_ms >= cutoff_ms:
                    rows.seek(index_key[:seqno_at] + MAX_U64 + b"\x00")  # past this queue's last seqno
                    continue
                if index_key[:seqno_at] != queue:
                    queue = index_key[:seqno_at]
                    rows_of_queue = found.setdefault(read_s(queue, 1)[0], [])
                key = index_key_and_expiry(value)[0]
                rows_of_queue.append(ExpiredRow(unpack_seqno(index_key, seqno_at)[0], key, ts_ms, size))
                taken += 1
                if taken >= limit:
                    return found, index_key + b"\x00"
        return found, None

    def lapsed_step(self, now_ms: int, limit: int, start: bytes | None = None
                    ) -> tuple[dict[str, list[ExpiredRow]], bytes | None]:
        """One GC step over the expiry table: up to ``limit`` entries whose own expiry time is at or before
        ``now_ms``, soonest first, from ``start`` (None: the table's beginning). Returns them by clientid and the
        ``start`` of the next step (None once every entry expiring by ``now_ms`` was found). Costs one index
        lookup per entry found; entries without an expiry are not looked at."""
        found: dict[str, list[ExpiredRow]] = {}
        taken = 0
        with self._db.iterator(start=start or EXPIRY, stop=EXPIRY + U64.pack(now_ms + 1), include_value=False) as rows:
            for expiry_row in rows:
                clientid, seqno_at = read_s(expiry_row, 9)
                seqno = U64.unpack_from(expiry_row, seqno_at)[0]
                value = self._db.get(INDEX + expiry_row[9:seqno_at] + U64.pack(seqno))
                if value is not None:
                    ts_ms, size = INDEX_VALUE.unpack_from(value)
                    key = index_key_and_expiry(value)[0]
                    found.setdefault(clientid, []).append(ExpiredRow(seqno, key, ts_ms, size))
                    taken += 1
                if taken >= limit:
                    return found, expiry_row + b"\x00"
        return found, None

    def idle_queues(self, cutoff_ms: int) -> list[str]:
        """Clientids whose queue stores no entry and had no write and no ack since ``cutoff_ms`` (state GC's
        candidates): one pass over the seqno table, a state lookup and an index seek per queue; then every ack
        state with no seqno row (an SCQ reader's position, stored apart from its SCQ's entries, or a queue only
        rewound) last acked before ``cutoff_ms``: one pass over the state table."""
        idle = []
        with self._db.iterator(prefix=INDEX, include_value=False) as index_keys:
            for row, value in self._db.iterator(prefix=SEQNO):
                if len(value) >= 16 and U64.unpack_from(value, 8)[0] >= cutoff_ms:
                    continue
                queue = row[1:]
                state = self._db.get(STATE + queue)
                if state and decode_state(state).last_ack_ms >= cutoff_ms:
                    continue
                index_keys.seek(INDEX + queue)
                if next(index_keys, b"").startswith(INDEX + queue):
                    continue
                idle.append(read_s(row, 1)[0])
        for row, value in self._db.iterator(prefix=STATE):
            if decode_state(value).last_ack_ms < cutoff_ms and self._db.get(SEQNO + row[1:]) is None:
                idle.append(read_s(row, 1)[0])
        return idle

    def seqnos(self, clientid: str) -> Iterator[int]:
        """Seqnos of the stored entries of ``clientid``, ascending."""
        prefix = INDEX + encode_s(clientid)
        for row in self._db.iterator(prefix=prefix, include_value=False):
            yield U64.unpack_from(row, len(prefix))[0]

    def queue_range(self, clientid: str) -> tuple[int, int, int] | None:
        """(first seqno, last seqno, entry count) of the stored queue of ``clientid``, or None when empty."""
        seqnos = list(self.seqnos(clientid))
        return (seqnos[0], seqnos[-1], len(seqnos)) if seqnos else None

    def stored_totals(self) -> tuple[int, int]:
        """(entries, payload bytes) stored across all queues: a scan of the index table."""
        entries = size = 0
        for value in self._db.iterator(prefix=INDEX, include_key=False):
            entries += 1
            size += INDEX_VALUE.unpack_from(value)[1]
        return entries, size

    def count_queues(self) -> int:
        """Queues that ever had a write (rows of the seqno table)."""
        return sum(1 for _ in self._db.iterator(prefix=SEQNO, include_value=False))

    def edge_index_entries(self) -> tuple[IndexEntry | None, IndexEntry | None]:
        """The first and the last row of the index table, by (clientid, seqno) key order."""
        first = next(self._db.iterator(prefix=INDEX), None)
        last = next(self._db.iterator(prefix=INDEX, reverse=True), None)
        return index_entry(first), index_entry(last)

    def ack_states(self) -> Iterator[tuple[str, AckState]]:
        """Every stored consumer state as (clientid, state), in clientid key order."""
        for row, value in self._db.iterator(prefix=STATE):
            yield read_s(row, 1)[0], decode_state(value)

    def stored_entries(self, clientid: str | None = None, after: int = 0) -> Iterator[tuple[str, int, int, int]]:
        """(clientid, seqno, publish ms, payload bytes) of every stored entry in (clientid, seqno) key order, one
        pass over the index table; with ``clientid``, only that queue's entries with seqno > ``after``."""
        if clientid is not None:
            prefix = INDEX + encode_s(clientid)
            start = prefix + U64.pack(after + 1)
            for index_key, value in self._db.iterator(start=start, stop=prefix + MAX_U64, include_stop=True):
                ts_ms, size = INDEX_VALUE.unpack_from(value)
                yield clientid, U64.unpack_from(index_key, len(prefix))[0], ts_ms, size
            return
        queue, name = b"", ""  # rows of one queue are adjacent: decode each clientid once
        for index_key, value in self._db.iterator(prefix=INDEX):
            seqno_at = len(index_key) - 8
            if index_key[:seqno_at] != queue:
                queue = index_key[:seqno_at]
                name = read_s(queue, 1)[0]
            ts_ms, size = INDEX_VALUE.unpack_from(value)
            yield name, U64.unpack_from(index_key, seqno_at)[0], ts_ms, size
