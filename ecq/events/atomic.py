"""Atomic file replacement: the one way the event side writes a file that must be whole or absent.

Write a temporary file beside the target, fsync it, rename it over the target, fsync the directory.
A crash leaves the old content or the new one, never a mix; at worst a temporary file is left over,
which its owner removes (ReplayQ on open, the lake exporter before its first export). Used for
ReplayQ's COMMIT file and dumped segments, the lake's Parquet files and the lake stream id.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomically(path: Path, content: bytes | Callable[[BinaryIO], object], *, fsync: bool = True,
                     hidden_temp: bool = False) -> None:
    """Replace ``path`` with ``content``: bytes, or a function that writes to the open binary file.

    The temporary file is ``<name>.tmp`` beside ``path``, or ``.<name>.tmp`` with ``hidden_temp`` (so
    readers that skip dot files, such as Spark and pyarrow.dataset, never see it). With ``fsync`` the
    file is fsynced before the rename and its directory after it, so the new content survives a power
    cut once this returns; without, it survives a crash of the process only. On failure the temporary
    file is removed and the error raised again: OSError (missing directory, read-only, disk full) or
    whatever ``content`` raises.
    """
    tmp = path.with_name(f".{path.name}.tmp" if hidden_temp else f"{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """fsync the directory ``path``, making the files created, renamed or deleted in it durable.
    Raises OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
