"""The data directory: one subdirectory per role, and the move of the old layout into it.

Layout of ``data_dir`` (default ``storage``)::

    <data_dir>/queues/   LevelDB (backend leveldb only), with ``lost/`` after an ``ecq repair``, and
                         ``ECQ-COMMITTED`` (the last committed seqnos, ecq.store.committed)
    <data_dir>/events/   the ReplayQ event buffer and its ``lake-stream-id``
    <data_dir>/lake/     the Parquet lake, unless ``lake_dir`` is set

Before, LevelDB's directory was ``data_dir`` itself (its files ``CURRENT``, ``LOCK``, ``LOG``, ``MANIFEST-*``,
``*.ldb``, ``*.log`` directly in it, and ECQ's ``ECQ-COMMITTED`` beside them, see ecq.store.committed), with ``events/`` and ``lake/`` inside it; those two keep their paths.
:func:`migrate` moves the LevelDB files of that old layout into ``queues/``, crash-safely: each file is
renamed into ``queues.migrating/``, which is renamed to ``queues/`` once it holds them all, so an
interrupted move leaves every file in one of two known places and the next start finishes it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ecq.store.protocol import StoreError

log = logging.getLogger(__name__)

QUEUES = "queues"
EVENTS = "events"
LAKE = "lake"
MIGRATING = "queues.migrating"  # the new LevelDB directory while the old layout's files move into it
_LEVELDB_NAME = re.compile(r"CURRENT|LOCK|LOG|LOG\.old|MANIFEST-\d+|\d+\.(?:log|ldb|sst|dbtmp)|ECQ-COMMITTED")
_LEVELDB_LOST = "lost"  # where `ecq repair` (LevelDB RepairDB) puts the files it cannot read


class LayoutError(StoreError):
    """The data directory holds LevelDB files in a way the broker cannot sort out alone (both layouts at
    once, a move interrupted and then written to), or is in use by a running broker."""


def leveldb_files(directory: Path) -> list[str]:
    """Names of LevelDB's own entries directly in ``directory`` (its files and ``lost/``) and ECQ's
    ``ECQ-COMMITTED``, sorted."""
    if not directory.is_dir():
        return []
    return sorted(entry.name for entry in directory.iterdir()
                  if _LEVELDB_NAME.fullmatch(entry.name) or (entry.name == _LEVELDB_LOST and entry.is_dir()))


def migrate(data_dir: Path) -> list[str]:
    """Bring ``data_dir`` to the layout above: move the old layout's LevelDB files into ``queues/`` (or
    finish a move that was interrupted). Logs what it moved; returns the names moved (empty: nothing to do).

    Raises LayoutError when both layouts hold LevelDB files, when a file is in both the old place and the
    half-built ``queues.migrating/``, or when a broker holds the old LevelDB open; OSError on I/O errors
    (what was moved stays moved, and the next call goes on from there).
    """
    queues, partial = data_dir / QUEUES, data_dir / MIGRATING
    if not leveldb_files(data_dir) and not partial.exists():
        return []
    with _exclusive(data_dir):
        old = leveldb_files(data_dir)
        _refuse_conflicts(data_dir, old)
        if partial.exists():
            log.warning("ECQ data_dir %s: finishing the move of LevelDB's files into %s that was interrupted "
                        "(%d already moved)", data_dir, queues, len(leveldb_files(partial)))
        partial.mkdir(exist_ok=True)
        _fsync_dir(data_dir)
        for name in old:
            os.rename(data_dir / name, partial / name)
        _fsync_dir(partial)
        if queues.exists():  # empty: _refuse_conflicts made sure
            queues.rmdir()
        os.rename(partial, queues)
        _fsync_dir(data_dir)
    log.warning("ECQ data_dir %s: moved %d LevelDB entries of the old layout into %s: %s", data_dir, len(old), queues,
                " ".join(old) or "(all had been moved before the interruption)")
    return old


def _some(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _refuse_conflicts(data_dir: Path, old: list[str]) -> None:
    queues, partial = data_dir / QUEUES, data_dir / MIGRATING
    if queues.exists() and (not queues.is_dir() or any(queues.iterdir())):
        old_place = partial if partial.exists() else data_dir
        raise LayoutError(f"data_dir {data_dir} holds LevelDB files both in {queues} (this layout) and in {old_place} "
                          f"({_some(old or leveldb_files(partial))}: the old layout); move one of the two "
                          f"databases out of {data_dir} and start again")
    if data_dir.name == QUEUES and not partial.exists():
        raise LayoutError(f"data_dir {data_dir} holds LevelDB files directly and is named {QUEUES!r}: it looks like "
                          f"the LevelDB directory of data_dir {data_dir.parent}; set data_dir to that one")
    if both := sorted(set(old) & set(leveldb_files(partial))):
        raise LayoutError(f"data_dir {data_dir}: {_some(both)} exist both in {data_dir} and in {partial} (a move "
                          f"into {data_dir / QUEUES} was interrupted and LevelDB files were written since): "
                          f"sort them out by hand")


@contextmanager
def _exclusive(data_dir: Path) -> Iterator[None]:
    """Hold ``data_dir`` against another migration (flock on the directory) and against a broker using the
    old LevelDB (LevelDB's own fcntl lock on its ``LOCK`` file, wherever the file is now)."""
    dir_fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY)
    lock_fd = None
    try:
        _try_lock(fcntl.flock, dir_fd, data_dir)
        lock_file = next((p for p in (data_dir / "LOCK", data_dir / MIGRATING / "LOCK") if p.exists()), None)
        if lock_file is not None:
            lock_fd = os.open(lock_file, os.O_RDWR)
            _try_lock(fcntl.lockf, lock_fd, lock_file)
        yield
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
        os.close(dir_fd)


def _try_lock(lock, fd: int, path: Path) -> None:
    try:
        lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        raise LayoutError(f"cannot move the old LevelDB layout of {path}: it is in use (is a broker running?)") from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def leveldb_dir(data_dir: Path) -> Path | None:
    """Where the LevelDB of ``data_dir`` is, for reading it offline without moving anything: ``queues/``
    (this layout), ``data_dir`` itself (the old layout, read in place), or None when there is none.

    Raises LayoutError when both layouts are present or a move into ``queues/`` was interrupted (the
    broker's next start finishes it).
    """
    queues, partial = data_dir / QUEUES, data_dir / MIGRATING
    old = "CURRENT" in leveldb_files(data_dir)
    if partial.exists():
        raise LayoutError(f"the move of {data_dir}'s LevelDB files into {queues} was interrupted: "
                          f"start the broker once to finish it")
    if (queues / "CURRENT").exists():
        if old:
            _refuse_conflicts(data_dir, leveldb_files(data_dir))
        return queues
    return data_dir if old else None
