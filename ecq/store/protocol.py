"""The storage seam of ECQ: the value types every layer shares and :class:`QueueStore`, the one interface
through which the queue engine, delivery, GC and the operations reach stored queues.

A store holds, per queue (a clientid): entries numbered by a seqno that starts at 1 and only grows, each
with a compaction key, a payload, its publish time and, for an MQTT 5 write with a Message Expiry Interval,
its expiry time (an entry is gone once either ``data_retention`` or its own expiry has passed); the
consumer's ack state; and the last seqno ever assigned. Writes come as ops (:data:`Op`) committed in
batches, each batch atomically. All timestamps are milliseconds since the Unix epoch; sizes are payload bytes. The methods block (disk I/O) and are run off
the event loop, in reader or writer threads. :class:`ecq.store.leveldb.LevelDbStore` is the embedded
implementation, :class:`ecq.store.jetstream.JetStreamStore` the one a cluster of brokers shares.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

from ecq.queue.topics import BadWrite

T = TypeVar("T")


class StoreError(RuntimeError):
    """The data directory cannot be opened (locked by another broker, corrupt, not writable)."""


class StoreReadError(StoreError):
    """A stored block cannot be read (LevelDB reports corruption or an I/O error): retrying will not help."""


class QuotaExceeded(BadWrite):
    """An append refused by the queue quota (``quota_policy: refuse``, or a payload larger than
    ``max_queue_bytes``): nothing was stored. A :meth:`QueueStore.commit` returns it as that op's result."""

    def __init__(self, detail: str) -> None:
        super().__init__("quota_exceeded", detail)


@dataclass(frozen=True, slots=True)
class QueueQuota:
    """The bounds of one queue, applied by the store in the append's own write batch: at most ``max_messages``
    stored entries and ``max_bytes`` payload bytes (0 = unlimited), acked or not. ``policy`` ``drop_oldest``
    deletes the lowest seqnos until the append fits, ``refuse`` refuses the append (like EMQX 6 message queues'
    ``max_messages`` / ``max_bytes`` with drop-oldest or drop-new). A rewrite of a stored key is not a new entry."""

    max_messages: int = 0
    max_bytes: int = 0
    policy: str = "drop_oldest"

    def __bool__(self) -> bool:
        return bool(self.max_messages or self.max_bytes)

    def over(self, entries: int, size: int) -> bool:
        """True when a queue of ``entries`` entries and ``size`` payload bytes breaks a bound."""
        return bool(self.max_messages and entries > self.max_messages or self.max_bytes and size > self.max_bytes)


@dataclass(frozen=True, slots=True)
class Message:
    """One stored queue entry: seqno, compaction key, payload bytes, publish time in ms, and the time in ms at
    which it expires (``expires_ms``; 0: never, the common case), set from an MQTT 5 write's Message Expiry
    Interval (MQTT 5.0 section 3.3.2.3.3)."""

    seqno: int
    key: str
    payload: bytes
    ts_ms: int
    expires_ms: int = 0

    def lapsed(self, at_ms: int) -> bool:
        """True when the entry's own expiry time is at or before ``at_ms`` (ms since the epoch); never without one."""
        return 0 < self.expires_ms <= at_ms


@dataclass(slots=True)
class AckState:
    """Consumer progress: every seqno <= ``acked`` is done; ``above`` holds seqnos acked out of order."""

    acked: int = 0
    last_ack_ms: int = 0
    above: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Append:
    """Write op: append ``payload`` under ``key`` to the queue of ``clientid`` (compacting older values), published
    at ``ts_ms`` and expiring at ``expires_ms`` (0: no expiry of its own; see :class:`Message`)."""

    clientid: str
    key: str
    payload: bytes
    ts_ms: int
    expires_ms: int = 0


@dataclass(frozen=True, slots=True)
class Appended:
    """Result of an :class:`Append`: the new seqno, the seqnos its compaction deleted and their payload bytes,
    and the oldest entries the queue quota deleted to make room (``quota_policy: drop_oldest``)."""

    seqno: int
    replaced: tuple[int, ...] = ()
    replaced_bytes: int = 0
    evicted: tuple[ExpiredRow, ...] = ()


class ExpiredRow(NamedTuple):
    """An entry found by GC: seqno, key, publish ms, payload bytes.

    A NamedTuple rather than a frozen dataclass: GC makes one per stored entry, and this is 2-3x cheaper.
    """

    seqno: int
    key: str
    ts_ms: int
    size: int


@dataclass(frozen=True, slots=True)
class SaveAck:
    """Write op: persist the consumer progress of ``clientid``."""

    clientid: str
    state: AckState


@dataclass(frozen=True, slots=True)
class Expire:
    """Write op: delete the rows of ``clientid`` found by :meth:`QueueStore.expired_step` (GC) or by a read.

    ``reason`` says why, for observers only (the store ignores it): ``retention`` (GC, ``data_retention``),
    ``message_expiry`` (GC, the entry's own expiry: :meth:`QueueStore.lapsed_step`),
    ``tombstone_retention`` (GC of tombstones), ``tombstone_acked`` (a delivered tombstone's PUBACK) or
    ``purge`` (``ecq purge``)."""

    clientid: str
    rows: tuple[ExpiredRow, ...]
    reason: str = "retention"


@dataclass(frozen=True, slots=True)
class ForgetQueue:
    """Write op (state GC): delete the seqno counter and ack state of ``clientid`` if, when committed, its queue
    stores no entry and neither a write nor an ack came since ``cutoff_ms``; its result is True when it did. A
    queue written again afterwards starts at seqno 1 with nothing acked."""

    clientid: str
    cutoff_ms: int


Op = Append | SaveAck | Expire | ForgetQueue


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One index row: which queue, which seqno, its key and publish time (ms)."""

    clientid: str
    seqno: int
    key: str
    ts_ms: int


CommitResult = Appended | QuotaExceeded | tuple[ExpiredRow, ...] | bool | None


class AppendNotice(NamedTuple):
    """One entry a broker of a cluster stored: the op as it was written, its seqno with the value it replaced
    (compaction), ``own`` when this broker took the write, and ``in_order`` when every earlier entry of its
    shard was told before it (then a consumer that read everything may take ``op.payload`` without a read)."""

    op: Append
    result: Appended
    own: bool
    in_order: bool


class StoreListener(Protocol):
    """What a shared store tells every broker (:meth:`QueueStore.watch`); each method must return at once."""

    def appended(self, notices: list[AppendNotice]) -> None:
        """Entries stored by any broker, each shard's in seqno order."""

    def deleted(self, clientid: str, rows: tuple[ExpiredRow, ...], reason: str) -> None:
        """Another broker deleted ``rows`` of the queue of ``clientid`` (GC, purge, an acked tombstone)."""

    def ack_saved(self, clientid: str, state: AckState) -> None:
        """Another broker saved ``state`` as the ack state of ``clientid``."""

    def resynced(self, clientids: set[str]) -> None:
        """Notices were lost (a reconnect, a gap in a shard's sequence): the stored entries of ``clientids``
        changed without being told; read them again."""


class QueueStore(Protocol):
    """What the queue engine needs from storage. Every method may block; none may be called on the event loop
    except :meth:`commit` when :meth:`commits_without_waiting` said so."""

    write_error: str | None
    """The I/O error that suspended commits, None while commits are accepted (see :meth:`reopen_if_space`)."""

    shared: bool
    """True when other brokers write to the same store (a cluster): every append, this broker's too, arrives
    through :meth:`watch` rather than from commit results, and stored totals are read from the store now and
    then, not only counted."""

    edge_order: str
    """How :meth:`edge_index_entries` picks its two entries: ``"clientid"`` (the lowest and the highest by
    clientid, then seqno: the index's key order, not time) or ``"time"`` (the oldest and the newest by publish
    time)."""

    def watch(self, listener: StoreListener) -> None:
        """For a shared store: tell ``listener`` of every change any broker made (see :class:`StoreListener`),
        from a thread of the store's own. Blocks until the store's view of what is stored is built."""

    def commit(self, ops: Sequence[Op]) -> list[CommitResult]:
        """Apply ``ops`` in order as one atomic batch (group commit); returns one result per op.

        An :class:`Append` gets the next seqno of its queue and deletes the older values of its key
        (compaction): its result is :class:`Appended`, or :class:`QuotaExceeded` when the store's queue quota
        refuses it (an exception returned, not raised: the rest of the batch stands). An :class:`Expire` deletes those of its rows that are
        still stored and returns them (an append of the same key may have replaced one since GC read it).
        A :class:`SaveAck` returns None, a :class:`ForgetQueue` whether it forgot the queue. On failure nothing was written; after an I/O error every commit
        raises :class:`StoreError` until :meth:`reopen_if_space` succeeds.
        """

    def commit_async(self, ops: Sequence[Op]) -> asyncio.Future | None:
        """Start :meth:`commit` without a thread, on a store that can (a network store's own event loop):
        a future of the event loop calling it; None when the commit must run in a thread (or inline)."""

    def read_async(self, func: Callable[..., T], *args: Any) -> asyncio.Future | None:
        """Start the read ``func(*args)`` (one of this store's read methods) without a thread, on a store that
        can: a future of the calling event loop; None when it must run in a reader thread."""

    def commits_without_waiting(self) -> bool:
        """True when :meth:`commit` will not block on the disk, so the writer may run it on the event loop."""

    def read_after(self, clientid: str, after: int, limit: int, min_ts_ms: int = 0,
                   known_last: int | None = None, lapsed_at_ms: int = 0) -> list[Message]:
        """Up to ``limit`` entries of ``clientid`` with seqno > ``after``, in seqno order, skipping those
        published before ``min_ts_ms`` and those whose own expiry time is at or before ``lapsed_at_ms`` (0: none
        skipped for that) (expired, not yet collected). ``known_last``: a seqno the caller was
        told is stored (None: not known), for a store whose replicas may lag: a shorter answer is checked.
        Raises :class:`StoreReadError` for damaged data."""

    def ack_state(self, clientid: str) -> AckState:
        """The saved progress of ``clientid``'s consumer (``AckState()`` when it never acked)."""

    def ack_states(self) -> Iterator[tuple[str, AckState]]:
        """Every saved consumer state as (clientid, state), in clientid order."""

    def expired_step(self, cutoff_ms: int, limit: int, start: bytes | None = None
                     ) -> tuple[dict[str, list[ExpiredRow]], bytes | None]:
        """One GC step: up to ``limit`` entries published before ``cutoff_ms``, scanning from ``start`` (None:
        the beginning) across queues. Returns them by clientid, oldest first, and the opaque ``start`` of the
        next step (None once every queue was scanned)."""

    def lapsed_step(self, now_ms: int, limit: int, start: bytes | None = None
                    ) -> tuple[dict[str, list[ExpiredRow]], bytes | None]:
        """One GC step over the entries with an expiry time of their own (:attr:`Message.expires_ms`): up to
        ``limit`` of those expiring at or before ``now_ms``, scanning from ``start`` (None: the beginning).
        Returns them by clientid and the opaque ``start`` of the next step (None once all were scanned)."""

    def idle_queues(self, cutoff_ms: int) -> list[str]:
        """Clientids whose queue stores no entry and had no write and no ack since ``cutoff_ms`` (ms since the
        epoch): the candidates of state GC, each checked again by its :class:`ForgetQueue` commit."""

    def stored_totals(self) -> tuple[int, int]:
        """(entries, payload bytes) stored across all queues; a full scan."""

    def count_queues(self) -> int:
        """How many queues ever had a write."""

    def key_bytes(self, clientid: str, key: str) -> int | None:
        """Payload bytes of the stored value of ``key`` in the queue of ``clientid`` (0 for a tombstone, an empty
        payload), None when the queue stores no entry of ``key``."""

    def last_seqno(self, clientid: str) -> int:
        """Last seqno assigned in the queue of ``clientid`` (0 when it never had a write)."""

    def seqnos(self, clientid: str) -> Iterator[int]:
        """Seqnos of the stored entries of ``clientid``, ascending."""

    def queue_range(self, clientid: str) -> tuple[int, int, int] | None:
        """(first seqno, last seqno, entry count) of the stored queue of ``clientid``, or None when empty."""

    def edge_index_entries(self) -> tuple[IndexEntry | None, IndexEntry | None]:
        """The first and the last stored entry in :attr:`edge_order`."""

    def stored_entries(self, clientid: str | None = None, after: int = 0) -> Iterator[tuple[str, int, int, int]]:
        """(clientid, seqno, publish ms, payload bytes) of every stored entry, each queue's in seqno order (the lag
        index's scan); with ``clientid``, only that queue's entries with seqno > ``after``. Run it inside
        :meth:`run` (it iterates)."""

    def run(self, func: Callable[..., T], *args: Any) -> T:
        """``func(*args)`` while the store cannot be reopened under it: every read goes through here."""

    def reopen_if_space(self) -> bool:
        """After a failed commit: once the disk has room, reopen and accept commits again; returns True when
        it did. Blocks until no read or commit runs. Raises :class:`StoreError` when the reopen fails."""

    def verify(self) -> tuple[int, float]:
        """Read everything stored with checksums on; returns (rows, seconds). Raises :class:`StoreError`."""

    def close(self) -> None:
        """Close the store; committed writes are kept."""


def stored_pages(store: QueueStore, clientid: str, size: int) -> Iterator[list[Message]]:
    """Every stored entry of ``clientid`` in seqno order, as pages of at most ``size`` entries (one
    :meth:`QueueStore.read_after` each, a blocking read; raises what it raises)."""
    after = 0
    while page := store.read_after(clientid, after, size):
        yield page
        after = page[-1].seqno
