"""What the queue engine tells the rest of ECQ (metrics, queue events): the :class:`QueueObserver` protocol."""

from __future__ import annotations

from typing import Protocol

from ecq.store.protocol import Append, Appended, ExpiredRow, Message
from ecq.queue.topics import RewindPoint


class QueueObserver(Protocol):
    """Told of what the engine did, on the event loop; each method must return at once and never raise."""

    def appended(self, op: Append, result: Appended) -> None:
        """``op`` was committed as ``result.seqno`` (``result.replaced``: the seqnos compaction deleted)."""

    def expired(self, clientid: str, rows: tuple[ExpiredRow, ...], reason: str = "retention") -> None:
        """``rows`` of the queue of ``clientid`` were deleted; ``reason`` is ``retention`` or ``tombstone_retention``
        (GC), ``tombstone_acked`` (a tombstone's PUBACK), ``purge`` (see ecq.store.protocol.Expire) or ``quota``
        (evicted by the queue quota to make room for an append)."""

    def delivered(self, clientid: str, message: Message, attempt: int) -> None:
        """``message`` was sent; ``attempt`` is 1 for its first send, 2+ for each send again."""

    def acked(self, clientid: str, message: Message, sent_monotonic: float) -> None:
        """The PUBACK of ``message`` came; it was sent at ``sent_monotonic`` (time.monotonic seconds)."""

    def skipped(self, clientid: str, message: Message, reason: str) -> None:
        """``message`` was not sent to the consumer's connection and stays pending; ``reason``: ``packet_too_large``
        (above the connection's Maximum Packet Size, MQTT 5.0 section 3.1.2.11.4)."""

    def store_error(self, op: str, exc: Exception) -> None:
        """A store ``op`` failed: ``"write"`` (a commit) or ``"read"`` (a damaged block)."""

    def gc_started(self) -> None:
        """A GC pass begins."""

    def forgotten(self, clientid: str) -> None:
        """State GC deleted the seqno counter and ack state of the (empty) queue of ``clientid``."""

    def rewound(self, clientid: str, point: RewindPoint, acked: int) -> None:
        """The queue of ``clientid`` was rewound to ``point``: its acked seqno is now ``acked`` (stored)."""
