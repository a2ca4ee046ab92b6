"""LevelDB's files seen from outside the database: repair, a log cut inside a record, free space for a
reopen, and the gate that lets a reopen close the database while no read or commit uses it."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import plyvel

from ecq import storage_layout
from ecq.queue.store import StoreError

_REOPEN_SPARE_BYTES = 8 << 20  # free space beyond twice the log before a failed store is reopened (2 memtables)


def repair_hint(path: Path) -> str:
    """The command that repairs the LevelDB at ``path``: ``ecq repair`` takes the broker's data_dir, which is
    the parent of ``<data_dir>/queues`` (ecq.storage_layout), or ``path`` itself in the old layout."""
    data_dir = path.parent if path.name == storage_layout.QUEUES else path
    return f"`ecq repair --data-dir {data_dir}` keeps what can be read"


def repair(path: Path) -> None:
    """Rebuild the LevelDB database at ``path`` from what can still be read (``plyvel.repair_db``).

    Entries in damaged table blocks and the records of a damaged or cut log are dropped (LevelDB moves
    unreadable files to ``path/lost``), so queue rows and acked positions may be lost or move back.
    Raises StoreError when the database is in use or cannot be repaired.
    """
    if not (path / "CURRENT").exists():
        raise StoreError(f"{path} holds no LevelDB database")
    try:
        plyvel.DB(str(path), paranoid_checks=False).close()
    except plyvel.IOError as exc:
        if "lock" in reason(exc).lower():
            raise StoreError(f"LevelDB at {path} is in use (is a broker running?): {reason(exc)}") from exc
    except plyvel.Error:
        pass  # damaged: that is what the repair is for
    try:
        plyvel.repair_db(str(path), paranoid_checks=False)
    except plyvel.Error as exc:
        raise StoreError(f"cannot repair LevelDB at {path}: {reason(exc)}") from exc


_LOG_BLOCK, _LOG_HEADER = 32768, 7  # LevelDB log format: 32 KiB blocks of records with a 7-byte header
_FULL, _FIRST, _LAST = 1, 2, 4


def cut_logs(path: Path) -> list[tuple[Path, int]]:
    """(log file, bytes of the cut record) for each LevelDB log in ``path`` that ends inside a record.

    LevelDB's recovery, even with ``paranoid_checks``, takes such a tail for a write that was under way
    at a crash and drops it without a word; a log cut at a record boundary cannot be told from a whole one.
    """
    cut = []
    for log_file in sorted(path.glob("*.log")):
        data = log_file.read_bytes()
        pos, record_start = 0, None  # record_start: offset of a FIRST fragment whose LAST has not come
        while pos < len(data):
            left_in_block = _LOG_BLOCK - pos % _LOG_BLOCK
            if left_in_block < _LOG_HEADER:  # block trailer
                pos += left_in_block
                continue
            end = pos + _LOG_HEADER + int.from_bytes(data[pos + 4:pos + 6], "little")
            if end > len(data):
                record_start = pos if record_start is None else record_start
                break
            kind = data[pos + 6]
            record_start = pos if kind == _FIRST else None if kind in (_FULL, _LAST) else record_start
            pos = end
        if record_start is not None:
            cut.append((log_file, len(data) - record_start))
    return cut


def reason(exc: Exception) -> str:
    """LevelDB's status text of a plyvel error (plyvel gives it as bytes)."""
    arg = exc.args[0] if exc.args else exc
    return arg.decode(errors="replace") if isinstance(arg, bytes) else str(arg)


def space_for(path: Path) -> bool:
    """True when the filesystem of ``path`` has room to reopen LevelDB and go on writing: recovery turns
    the log into a table file (at most the log's size), then the next memtable flush needs its own."""
    log_bytes = sum(f.stat().st_size for f in path.glob("*.log"))
    return shutil.disk_usage(path).free >= 2 * log_bytes + _REOPEN_SPARE_BYTES


class Gate:
    """Many users of the database at once (``with gate:``), or one reopen alone (``with gate.exclusive():``).
    A waiting reopen keeps new users out, so it cannot starve. Not reentrant: a user must not enter again."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._users = 0
        self._exclusive = False

    @property
    def reopening(self) -> bool:
        """True while a reopen waits for or holds the database."""
        return self._exclusive

    def __enter__(self) -> None:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._users += 1

    def __exit__(self, *_exc: object) -> None:
        with self._cond:
            self._users -= 1
            if not self._users and self._exclusive:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._users:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
