"""Sends again of one queue's entries, across the connections of its consumer, and their DUP flag.

A send again carries ``dup`` (MQTT 3.1.1 section 4.4, MQTT-4.4.0-1: DUP=1 "might be re-delivery"): an entry this
consumer sent before, and up to one window of entries a consumer it does not know of may have sent without their
PUBACK (before a broker restart, on another cluster node): which entries were sent is not stored. The window is the
consumer's reach: ``reader_batch_size``, an SCQ group's the sum of its members' windows (ecq.queue.groups), the
largest it had since it was loaded, as the members join again.
"""

from __future__ import annotations

from ecq.store.protocol import Message


class Resends:
    """``attempts``: sends so far of each unacked seqno, across connections. ``sent_before_ms``: entries stored at or
    before this time (Unix ms; 0: none) may have been sent by a consumer of this queue that this one does not know
    of, up to a window of them (at most a window was in flight): ``window``, or the larger ``reach`` a send is
    given."""

    __slots__ = ("attempts", "_sent_before_ms", "_sent_before_window", "_sent_before_sent")  # one per queue

    def __init__(self, sent_before_ms: int, window: int) -> None:
        self.attempts: dict[int, int] = {}
        self._sent_before_ms = sent_before_ms
        self._sent_before_window = window  # first sends that may be sends again: the largest reach so far
        self._sent_before_sent = 0         # first sends so far of entries stored by sent_before_ms

    def send(self, message: Message, reach: int) -> tuple[int, bool]:
        """Count a send of ``message`` by a consumer that takes ``reach`` deliveries in flight at most now (a window
        per member of an SCQ group): (its attempt, 1 for its first send and 2+ for each send again; its DUP)."""
        self._sent_before_window = max(self._sent_before_window, reach)
        attempt = self.attempts[message.seqno] = self.attempts.get(message.seqno, 0) + 1
        return attempt, attempt > 1 or self._maybe_sent_before(message)

    def acked(self, seqno: int) -> None:
        """The PUBACK of ``seqno`` came: it is sent no more."""
        self.attempts.pop(seqno, None)

    def forget_through(self, acked: int) -> None:
        """Drop the counts of seqnos up to ``acked`` (compaction or GC removed them before their PUBACK)."""
        self.attempts = {seqno: n for seqno, n in self.attempts.items() if seqno > acked}

    def clear(self) -> None:
        """Forget every count (a rewind: what comes next is sent as new)."""
        self.attempts.clear()

    def _maybe_sent_before(self, message: Message) -> bool:
        """True when a consumer of this queue that this one does not know of (before a restart, on another node)
        may have sent ``message`` without its PUBACK: one of the first window of first sends, of an entry stored by
        ``sent_before_ms`` (MQTT 3.1.1 section 4.4 allows DUP=1 on a send that might be a re-delivery)."""
        if self._sent_before_sent < self._sent_before_window and message.ts_ms <= self._sent_before_ms:
            self._sent_before_sent += 1
            return True
        return False
