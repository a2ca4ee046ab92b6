"""The broker's queue engine observers besides metrics: the queue event stream (recorded to a ReplayQ
buffer, exported to the Parquet lake), started and stopped with the broker.

Events are optional (``events: false``) and must never stop writes: when the recorder cannot start,
the broker runs without it.
"""

from __future__ import annotations

import logging
from typing import Any

from ecq.config import EcqSettings
from ecq.queue.clock import now_ms
from ecq.store.protocol import Append, Appended, ExpiredRow, Message
from ecq.queue.topics import SCQ_PREFIX, RewindPoint, queue_of_position

log = logging.getLogger(__name__)

GC_EVENTS_PENDING = 2048  # GC waits while more events than this wait for the recorder's thread


def lake_file_bytes(settings: EcqSettings) -> int:
    """The byte bound of a lake file: ``lake_file_bytes``, at most a quarter of ``events_max_bytes`` so that
    waiting for a file never holds GC (see `QueueEvents.lagging`) nor drops events for overload."""
    return min(settings.lake_file_bytes, settings.events_max_bytes // 4)


def event_owner(stored_id: str | None) -> tuple[str | None, str, str | None]:
    """(clientid, kind, reader) columns of an event about the queue or SCQ reader's position ``stored_id``: an ECQ
    queue's clientid, ``ecq``, None; for an SCQ, its queue id ``$SCQ/<queue>``, ``scq`` and, for a reader's position
    (ecq.queue.topics.position_id), the reader (a client id or ``$share/<group>``), else None."""
    if stored_id is None or not stored_id.startswith(SCQ_PREFIX):
        return stored_id, "ecq", None
    queue_id = queue_of_position(stored_id)
    return queue_id, "scq", stored_id[len(queue_id) + 1:] or None


class QueueEvents:
    """Records one queue event per append, compaction, expiry, send, PUBACK and rewind, and refused writes
    (a queue engine observer). ``recorder`` is an ``ecq.events.EventRecorder``."""

    def __init__(self, settings: EcqSettings) -> None:
        from ecq.events import EventRecorder, LakeExporter  # pyarrow is imported only when events are on

        self._max_bytes = settings.events_max_bytes
        self.recorder = EventRecorder(settings.events_dir(), max_buffer_bytes=settings.events_max_bytes)
        self._exporter = LakeExporter(self.recorder, settings.effective_lake_dir(), settings.lake_file_rows,
                                      settings.export_interval, batch_bytes=lake_file_bytes(settings),
                                      max_age_s=settings.lake_file_age)

    async def start(self) -> bool:
        """Start recording and exporting; on failure log it and return False (run without events)."""
        try:
            await self.recorder.start()
            await self._exporter.start()
        except Exception as exc:
            log.error("ECQ queue events disabled: cannot start the event buffer or lake export: %s", exc)
            return False
        return True

    async def close(self) -> None:
        """Export what is buffered and close the recorder."""
        await self._exporter.close()
        await self.recorder.close()

    def stats(self) -> dict[str, Any]:
        """The recorder's counters."""
        return self.recorder.stats()

    def lagging(self) -> bool:
        """True while GC must wait for the recorder: its thread has not taken in the events GC made (the
        in-memory deque drops its oldest beyond its bound) or the buffer is over half its bound."""
        stats = self.recorder.stats()
        return stats["pending_items"] > GC_EVENTS_PENDING or stats["buffered_bytes"] > self._max_bytes // 2

    def refused(self, clientid: str | None, reason: str, topic: str) -> None:
        """A PUBLISH under ``$ECQ/`` or ``$SCQ/`` was refused (the topic says which kind)."""
        self.recorder.record("refused", ts_ms=now_ms(), clientid=clientid, reason=reason, topic=topic,
                             kind="scq" if topic.startswith(SCQ_PREFIX) else "ecq")

    def appended(self, op: Append, result: Appended) -> None:
        """An ``appended`` event, and one ``compacted`` event per value the append replaced."""
        record, ts_ms, (clientid, kind, _) = self.recorder.record, now_ms(), event_owner(op.clientid)
        record("appended", ts_ms=ts_ms, clientid=clientid, key=op.key, seqno=result.seqno, publish_ts_ms=op.ts_ms,
               payload_bytes=len(op.payload), kind=kind)
        for old in result.replaced:
            record("compacted", ts_ms=now_ms(), clientid=clientid, key=op.key, seqno=result.seqno,
                   publish_ts_ms=op.ts_ms, replaced_seqno=old, kind=kind)

    def expired(self, clientid: str, rows: tuple[ExpiredRow, ...], reason: str = "retention") -> None:
        """One ``expired`` event per row, ``reason`` saying why (see ecq.store.protocol.Expire), or ``evicted`` for
        rows the queue quota deleted (reason ``quota``); GC makes them by the million, so with the least per-row
        work."""
        record, ts_ms, type_ = self.recorder.record, now_ms(), "evicted" if reason == "quota" else "expired"
        clientid, kind, _ = event_owner(clientid)
        for seqno, key, publish_ts_ms, size in rows:
            record(type_, ts_ms=ts_ms, clientid=clientid, key=key, seqno=seqno, publish_ts_ms=publish_ts_ms,
                   payload_bytes=size, reason=reason, kind=kind)

    def delivered(self, clientid: str, message: Message, attempt: int) -> None:
        """A ``delivered`` event (an SCQ's says to which reader)."""
        clientid, kind, reader = event_owner(clientid)
        self.recorder.record("delivered", ts_ms=now_ms(), clientid=clientid, key=message.key, seqno=message.seqno,
                             publish_ts_ms=message.ts_ms, payload_bytes=len(message.payload), attempt=attempt,
                             kind=kind, reader=reader)

    def acked(self, clientid: str, message: Message, sent_monotonic: float) -> None:
        """An ``acked`` event (an SCQ's says by which reader)."""
        clientid, kind, reader = event_owner(clientid)
        self.recorder.record("acked", ts_ms=now_ms(), clientid=clientid, key=message.key, seqno=message.seqno,
                             publish_ts_ms=message.ts_ms, payload_bytes=len(message.payload), kind=kind, reader=reader)

    def rewound(self, clientid: str, point: RewindPoint, acked: int) -> None:
        """A ``rewound`` event: ``seqno`` is the new acked seqno, ``reason`` the point as asked (an SCQ's: whose
        position)."""
        clientid, kind, reader = event_owner(clientid)
        self.recorder.record("rewound", ts_ms=now_ms(), clientid=clientid, seqno=acked, reason=str(point), kind=kind,
                             reader=reader)

    def skipped(self, clientid: str, message: Message, reason: str) -> None:
        """Not an event (the entry is delivered later, or never: the ``delivered`` events tell)."""

    def store_error(self, op: str, exc: Exception) -> None:
        """Not an event."""

    def forgotten(self, clientid: str) -> None:
        """Not an event: state GC deletes no entry."""

    def gc_started(self) -> None:
        """Not an event."""
