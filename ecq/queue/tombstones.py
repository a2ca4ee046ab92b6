"""Deleting keys and whole queues, built on QueueStore operations every backend has (no backend code).

A tombstone is an :class:`ecq.store.protocol.Append` with an empty payload (option ``tombstones``): it takes the
next seqno and compacts away the older values of its key like any write, is delivered once as an empty
PUBLISH, and is then deleted on its PUBACK (ecq.queue.delivery) or by GC after ``tombstone_retention``
(ecq.queue.engine.QueueEngine.run_gc). A purge deletes every stored entry of a queue with Expire ops; the
seqno counter and the ack state are left alone, so nothing acked is ever delivered again.
"""

from __future__ import annotations

from ecq.store.protocol import ExpiredRow, QueueStore, stored_pages

PURGE_PAGE = 512  # entries read, and deleted in one Expire op, at a time


class TombstonesOff(ValueError):
    """``ecq delete`` on a broker running with ``tombstones: false`` (an empty payload is a value there)."""


def stored_rows(store: QueueStore, clientid: str) -> list[tuple[ExpiredRow, ...]]:
    """Every stored entry of ``clientid`` as GC rows (seqno, key, publish ms, payload bytes), in pages of at most
    PURGE_PAGE, oldest first (a blocking read; raises what ``store.read_after`` raises)."""
    return [tuple(ExpiredRow(m.seqno, m.key, m.ts_ms, len(m.payload)) for m in page)
            for page in stored_pages(store, clientid, PURGE_PAGE)]
