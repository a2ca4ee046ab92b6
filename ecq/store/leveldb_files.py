"""LevelDB's files seen from outside the database: repair, a log cut inside a record, the room a reopen
needs, and the gate that lets a reopen close the database while no read or commit uses it."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import plyvel

from ecq.store import layout as storage_layout
from ecq.store.protocol import StoreError

_REOPEN_SPARE_BYTES = 8 << 20  # free space beyond twice the log before a failed store is reopened (2 memtables)
_REOPEN_MIN_SPARE_BYTES = 1 << 20  # on a small volume: free space beyond the log, at least


def repair_command(path: Path) -> str:
    """The command that repairs the LevelDB at ``path``, in backquotes: ``ecq repair`` takes the broker's
    data_dir, which is the parent of ``<data_dir>/queues`` (ecq.store.layout), or ``path`` itself in the old
    layout."""
    data_dir = path.parent if path.name == storage_layout.QUEUES else path
    return f"`ecq repair --data-dir {data_dir}`"


def repair_hint(path: Path) -> str:
    """What to do about a damaged LevelDB at ``path``: :func:`repair_command`, which keeps what can be read."""
    return f"{repair_command(path)} keeps what can be read"


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


@dataclass(frozen=True)
class Room:
    """Bytes free on the volume of a LevelDB directory, bytes needed free to reopen it, the volume's size and
    the size of LevelDB's log(s)."""

    free: int
    needed: int
    volume: int
    log: int

    @property
    def enough(self) -> bool:
        return self.free >= self.needed

    def __str__(self) -> str:
        return (f"{_mib(self.needed)} free needed, {_mib(self.free)} free now on a volume of {_mib(self.volume)} "
                f"(LevelDB's log: {_mib(self.log)})")


def room_to_reopen(path: Path) -> Room:
    """How much room the volume of the LevelDB at ``path`` has, and needs, to reopen it and go on writing.

    Recovery turns the log into a table file (at most the log's size) before deleting it, then the next
    memtable flush needs a table of its own, and LevelDB's compactions some more: twice the log plus 8 MiB.
    A small volume can never free that much (a 20 MB one holding a 4 MB log would need 16 MB): the need is
    capped at half of what the volume would have free if it held nothing but LevelDB's files, and never below
    the log plus 1 MiB, which recovery cannot do without. Raises OSError when ``path`` cannot be read.
    """
    files = [f.stat() for f in path.iterdir() if f.is_file()]
    log_bytes = sum(f.stat().st_size for f in path.glob("*.log"))
    usage = shutil.disk_usage(path)
    reachable = usage.total - sum(f.st_size for f in files)
    needed = max(log_bytes + _REOPEN_MIN_SPARE_BYTES, min(2 * log_bytes + _REOPEN_SPARE_BYTES, reachable // 2))
    return Room(usage.free, needed, usage.total, log_bytes)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


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
