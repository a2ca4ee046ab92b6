"""What lets ECQ see that LevelDB lost writes it had acknowledged: the last committed seqno of each queue.

LevelDB keeps its latest writes (up to one memtable, 4 MiB) only in its write-ahead log, ``NNNNNN.log``, until
they are flushed into a table file; a log truncated or deleted while the broker is stopped takes them with it,
and LevelDB opens what is left without a word. So ECQ keeps beside LevelDB's files ``ECQ-COMMITTED``: for each
queue appended to since LevelDB was opened, the last seqno committed. Opening LevelDB turns its log into a
table file, which LevelDB fsyncs, so what a log can lose is what was written since the last open: after the
open's check the file starts empty again.

The file only ever claims what LevelDB has durably, so that neither kill -9 nor a power cut makes a start
refuse falsely: every CHECKPOINT_INTERVAL_S (and at a clean stop, after LevelDB is closed) the seqnos committed
since the last round are taken, then every LevelDB log is fsynced (a log deleted meanwhile was flushed into a
fsynced table first), then those seqnos are appended to the file and it is fsynced. Commits never wait for
this (with ``sync_writes`` off, LevelDB writes its log without fsync). Forgetting a queue (state GC) sets
its seqno back to 0, so a queue the file names is first withdrawn from it (a durable record of seqno 0)
before its forget is committed.

File layout: the header ``ECQ-COMMITTED 1\\n``, then rounds, each ``U32 length, U32 CRC-32, body`` (big
endian) with a body of records ``U16 length, UTF-8 clientid, U64 seqno``; a later record of a queue replaces
an earlier one, seqno 0 withdraws it. A round cut short by a crash while it was written is ignored: it had
not been fsynced, so it claimed nothing.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ecq.events.atomic import fsync_dir, write_atomically
from ecq.queue.throttle import LogThrottle

log = logging.getLogger(__name__)

FILE_NAME = "ECQ-COMMITTED"
CHECKPOINT_INTERVAL_S = 1.0
_HEADER = b"ECQ-COMMITTED 1\n"
_ROUND = struct.Struct(">II")  # body length, CRC-32 of the body
_U16, _U64 = struct.Struct(">H"), struct.Struct(">Q")
_REWRITE_RECORDS = 100_000  # records appended beyond the live claims before the file is rewritten with those alone
_FAILURE_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class Missing:
    """A queue whose stored last seqno (``stored``, 0 when LevelDB has no seqno row) is below the seqno
    ``committed`` that ECQ had committed and acknowledged: seqnos stored+1 .. committed are lost."""

    clientid: str
    stored: int
    committed: int

    @property
    def count(self) -> int:
        return self.committed - self.stored


def describe(missing: list[Missing], shown: int = 5) -> str:
    """``queue 'a' seqnos 1942-3000 (1059), queue 'b' seqno 7, and 3 more queues; 1090 seqnos of 5 queues in
    all``: the first ``shown`` queues, the most seqnos first (the total only for more than one queue)."""
    worst = sorted(missing, key=lambda m: (-m.count, m.clientid))
    text = ", ".join(f"queue {m.clientid!r} seqno {m.committed}" if m.count == 1 else
                     f"queue {m.clientid!r} seqnos {m.stored + 1}-{m.committed} ({m.count})" for m in worst[:shown])
    if len(worst) > shown:
        text += f", and {len(worst) - shown} more queues"
    if len(worst) > 1:
        text += f"; {sum(m.count for m in worst)} seqnos of {len(worst)} queues in all"
    return text


class CommittedSeqnos:
    """``ECQ-COMMITTED`` in the LevelDB directory ``path`` (see the module docstring).

    :meth:`missing` checks a freshly opened database against it, :meth:`start_over` empties it, :meth:`note`
    takes the seqnos of each commit, :meth:`start` runs the rounds in a thread of its own until :meth:`stop`,
    :meth:`record` runs one round, :meth:`withdraw` takes queues out before they are forgotten. Thread-safe.
    """

    def __init__(self, path: Path) -> None:
        self.file = path / FILE_NAME
        self._dir = path
        self._pending: dict[str, int] = {}  # committed since the last round: clientid -> last seqno
        self._pending_lock = threading.Lock()
        self._claimed: dict[str, int] = {}  # what the file claims now (seqno > 0)
        self._appended = 0  # records in the file beyond the header
        self._file_lock = threading.Lock()  # one round or withdrawal at a time, in file order
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures = LogThrottle(_FAILURE_LOG_INTERVAL_S)

    # --- at open ------------------------------------------------------------------------------------

    def missing(self, last_seqno: Callable[[str], int]) -> list[Missing]:
        """The queues whose ``last_seqno(clientid)`` (what the opened database stores) is below what the file
        claims. No file (a store written before ECQ kept it) claims nothing; an unreadable one is logged and
        claims nothing. Raises OSError when the file cannot be read."""
        claims = self._read()
        return [Missing(clientid, stored, committed) for clientid, committed in sorted(claims.items())
                if (stored := last_seqno(clientid)) < committed]

    def start_over(self) -> None:
        """Empty the file (atomically, fsynced): call once the opened database was checked, or to accept a loss.
        Raises OSError."""
        with self._file_lock:
            write_atomically(self.file, _HEADER)
            self._claimed.clear()
            self._appended = 0

    def _read(self) -> dict[str, int]:
        try:
            data = self.file.read_bytes()
        except FileNotFoundError:
            return {}
        if not data.startswith(_HEADER):
            log.warning("%s is not an ECQ-COMMITTED file (it starts with %r): lost LevelDB writes cannot be "
                        "checked at this start", self.file, data[:len(_HEADER)])
            return {}
        claims: dict[str, int] = {}
        pos = len(_HEADER)
        while pos + _ROUND.size <= len(data):
            length, crc = _ROUND.unpack_from(data, pos)
            body = data[pos + _ROUND.size:pos + _ROUND.size + length]
            if len(body) < length or zlib.crc32(body) != crc:
                break
            claims.update(_records(body))
            pos += _ROUND.size + length
        if pos < len(data):
            log.warning("%s: the last %d bytes are not a whole checkpoint (a crash while it was written, before "
                        "it was fsynced): ignored", self.file, len(data) - pos)
        return {clientid: seqno for clientid, seqno in claims.items() if seqno}

    # --- while open ---------------------------------------------------------------------------------

    def note(self, appended: dict[str, int]) -> None:
        """Take the last seqno of each queue (clientid -> seqno) that a commit just appended to."""
        with self._pending_lock:
            self._pending.update(appended)

    def withdraw(self, clientid: str) -> None:
        """Stop claiming ``clientid`` before its queue is forgotten (its seqno row deleted): durably, when the
        file claims it. Raises OSError when that cannot be written (then the forget must not be committed)."""
        with self._file_lock:
            with self._pending_lock:
                self._pending.pop(clientid, None)
            if clientid in self._claimed:
                self._append({clientid: 0})
                del self._claimed[clientid]

    def record(self) -> None:
        """One round: take the seqnos committed since the last one, fsync LevelDB's logs, append them and
        fsync. Raises OSError (the seqnos are then taken again by the next round)."""
        with self._file_lock:
            with self._pending_lock:
                taken, self._pending = self._pending, {}
            if not taken:
                return
            try:
                self._fsync_logs()
                if self._appended + len(taken) > len(self._claimed) + _REWRITE_RECORDS:
                    self._rewrite({**self._claimed, **taken})
                else:
                    self._append(taken)
            except OSError:
                with self._pending_lock:
                    self._pending = {**taken, **self._pending}
                raise
            self._claimed.update(taken)

    def start(self) -> None:
        """Run :meth:`record` every CHECKPOINT_INTERVAL_S in a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._rounds, name="ecq-committed-seqnos", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the rounds' thread (the last round is the caller's: after closing LevelDB, :meth:`record`)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def _rounds(self) -> None:
        while not self._stopping.wait(CHECKPOINT_INTERVAL_S):
            try:
                self.record()
            except OSError as exc:
                if (held_back := self._failures.due()) is not None:
                    log.error("ECQ cannot record the committed seqnos in %s (%s; %d more failures since the last such "
                              "line): until it can, a LevelDB log lost while the broker is stopped would go unnoticed",
                              self.file, exc, held_back)

    def _fsync_logs(self) -> None:
        for log_file in self._dir.glob("*.log"):
            try:
                fd = os.open(log_file, os.O_RDONLY)
            except FileNotFoundError:  # flushed into a table file, which LevelDB fsynced before deleting the log
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(self._dir)  # a log LevelDB created since the last round

    def _append(self, claims: dict[str, int]) -> None:
        fd = os.open(self.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            data = memoryview((b"" if end else _HEADER) + _round(claims))
            try:
                while data:
                    data = data[os.write(fd, data):]
                os.fsync(fd)
            except OSError:
                os.ftruncate(fd, end)  # a round cut by a full disk would hide every later one from _read
                raise
        finally:
            os.close(fd)
        self._appended += len(claims)

    def _rewrite(self, claims: dict[str, int]) -> None:
        write_atomically(self.file, _HEADER + _round(claims))
        self._appended = len(claims)


def _round(claims: dict[str, int]) -> bytes:
    body = b"".join(_U16.pack(len(raw := clientid.encode())) + raw + _U64.pack(seqno)
                    for clientid, seqno in claims.items())
    return _ROUND.pack(len(body), zlib.crc32(body)) + body


def _records(body: bytes) -> Iterable[tuple[str, int]]:
    pos = 0
    while pos < len(body):
        size = _U16.unpack_from(body, pos)[0]
        end = pos + _U16.size + size
        yield body[pos + _U16.size:end].decode(), _U64.unpack_from(body, end)[0]
        pos = end + _U64.size
