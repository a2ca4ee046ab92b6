"""Persistent MQTT sessions in the embedded LevelDB store, beside the queues (the ``session`` and ``session queue``
tables of :mod:`ecq.store.leveldb_tables`): one record per session and the messages queued for it while it was
offline, as opaque bytes (their encodings are ``ecq.broker.session_state``'s). Each call is one small LevelDB
write or prefix read, run on the caller's thread (the broker's loop: a put is a few microseconds, with the GIL
released by plyvel) through :meth:`LevelDbStore.run`, so none meets a reopen after a full disk.

A write is in LevelDB's log when the call returns, so a broker killed with SIGKILL right after keeps it; only a
power loss can take it (with ``sync_writes: true`` every write is fsynced, as the queues' commits are).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

from ecq.store.leveldb import LevelDbStore
from ecq.store.leveldb_tables import SESSION, SESSION_QUEUE, U64, encode_s, read_s


class LevelDbSessions:
    """The session tables of ``store`` (an open LevelDbStore). Raises what plyvel raises (plyvel.Error,
    RuntimeError once the store is closed)."""

    def __init__(self, store: LevelDbStore) -> None:
        self._store = store
        self._order = itertools.count(time.time_ns())  # queued messages' keys: after those of an earlier run

    def put(self, clientid: str, record: bytes) -> None:
        """Store ``clientid``'s session record, replacing the one stored."""
        self._store.run(lambda: self._db.put(SESSION + encode_s(clientid), record, sync=self._store._sync))

    def put_if_changed(self, clientid: str, record: bytes) -> bool:
        """Store ``clientid``'s session record unless the one stored is ``record`` already: True when it was
        written (a read of one key, then at most the one write of :meth:`put`)."""
        def put() -> bool:
            key = SESSION + encode_s(clientid)
            if self._db.get(key) == record:
                return False
            self._db.put(key, record, sync=self._store._sync)
            return True
        return self._store.run(put)

    def get(self, clientid: str) -> bytes | None:
        """``clientid``'s session record, or None."""
        return self._store.run(self._db.get, SESSION + encode_s(clientid))

    def records(self) -> Iterator[tuple[str, bytes]]:
        """Every stored session as ``(clientid, record)``, in clientid byte order (read in one pass under the gate,
        so a long scan holds off a reopen: call it at start)."""
        def scan() -> list[tuple[str, bytes]]:
            return [(read_s(key, 1)[0], value) for key, value in self._db.iterator(prefix=SESSION)]
        return iter(self._store.run(scan))

    def delete(self, clientid: str) -> None:
        """Delete ``clientid``'s session record and queued messages, in one write batch."""
        def delete() -> None:
            with self._db.write_batch(sync=self._store._sync) as batch:
                batch.delete(SESSION + encode_s(clientid))
                for key in self._db.iterator(prefix=self._queue(clientid), include_value=False):
                    batch.delete(key)
        self._store.run(delete)

    def queue(self, clientid: str, message: bytes, bound: int) -> list[bytes]:
        """Queue ``message`` for ``clientid``, keeping at most ``bound`` (>= 1) messages: the oldest beyond it are
        deleted in the same write batch. Returns those deleted, oldest first."""
        prefix = self._queue(clientid)

        def queue() -> list[bytes]:
            held = list(self._db.iterator(prefix=prefix, include_value=False))
            dropped = held[:max(0, len(held) - bound + 1)]
            values = [self._db.get(key) for key in dropped]
            with self._db.write_batch(sync=self._store._sync) as batch:
                for key in dropped:
                    batch.delete(key)
                batch.put(prefix + U64.pack(next(self._order)), message)
            return values
        return self._store.run(queue)

    def put_messages(self, messages: list[tuple[str, bytes]]) -> list[bytes]:
        """Queue each ``(clientid, message)`` at the end of its client's queue, in one write batch and without the
        bound of :meth:`queue` (the caller bounds them): returns their keys, for :meth:`delete_messages`."""
        keys = [self._queue(clientid) + U64.pack(next(self._order)) for clientid, _message in messages]

        def put() -> None:
            with self._db.write_batch(sync=self._store._sync) as batch:
                for key, (_clientid, message) in zip(keys, messages, strict=True):
                    batch.put(key, message)
        self._store.run(put)
        return keys

    def delete_messages(self, keys: list[bytes]) -> None:
        """Delete the queued messages of ``keys`` (from :meth:`put_messages` or :meth:`replace_queue`), in one write
        batch; a key deleted already is no error."""
        def delete() -> None:
            with self._db.write_batch(sync=self._store._sync) as batch:
                for key in keys:
                    batch.delete(key)
        self._store.run(delete)

    def replace_queue(self, clientid: str, messages: list[bytes], kept: frozenset[bytes] = frozenset()) -> list[bytes]:
        """Make ``clientid``'s queue the messages of ``kept`` keys it holds, then ``messages`` (oldest first), in one
        write batch: returns the keys of ``messages``."""
        prefix = self._queue(clientid)
        keys = [prefix + U64.pack(next(self._order)) for _message in messages]

        def replace() -> None:
            with self._db.write_batch(sync=self._store._sync) as batch:
                for key in self._db.iterator(prefix=prefix, include_value=False):
                    if key not in kept:
                        batch.delete(key)
                for key, message in zip(keys, messages, strict=True):
                    batch.put(key, message)
        self._store.run(replace)
        return keys

    def messages(self, clientid: str) -> list[bytes]:
        """The messages queued for ``clientid``, oldest first."""
        return self._store.run(lambda: list(self._db.iterator(prefix=self._queue(clientid), include_key=False)))

    @property
    def _db(self):  # the store's current database: a reopen after a full disk replaces it
        return self._store._db

    @staticmethod
    def _queue(clientid: str) -> bytes:
        return SESSION_QUEUE + encode_s(clientid)
