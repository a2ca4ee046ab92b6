"""Where a rewind puts a queue: a :class:`ecq.queue.topics.RewindPoint` turned into the acked seqno to store.

Built on :class:`ecq.queue.store.QueueStore` reads only, so it works on every backend. Seqnos are never
assumed contiguous (on JetStream they are stream sequence numbers shared by the queues of a shard): the point
"before entry E" is ``E.seqno - 1``, which no other entry of the queue can hold.
"""

from __future__ import annotations

from ecq.queue.store import QueueStore, stored_pages
from ecq.queue.topics import RewindPoint

PAGE = 256  # entries per read while looking for the first entry published at or after a time


def rewind_seqno(store: QueueStore, clientid: str, point: RewindPoint) -> int:
    """The acked seqno that makes ``point`` the next delivery of the queue of ``clientid`` (a blocking read).

    ``seqno``: N itself. ``earliest``: one below the first stored entry (0 when the queue is empty).
    ``latest``: the last seqno (0 when nothing is stored on a store that only knows stored entries).
    ``since``: one below the first stored entry published at or after ``point.value`` ms; when there is none,
    as ``latest``. Raises ValueError for another kind, and what the store's reads raise (StoreReadError,
    TimeoutError, StoreError).
    """
    if point.kind not in ("seqno", "earliest", "latest", "since"):
        raise ValueError(f"unknown rewind point kind {point.kind!r}")
    if point.kind == "seqno":
        return point.value
    if point.kind == "earliest":
        first = store.read_after(clientid, 0, 1)
        return first[0].seqno - 1 if first else 0
    if point.kind == "since":
        for page in stored_pages(store, clientid, PAGE):
            for message in page:
                if message.ts_ms >= point.value:
                    return message.seqno - 1
    return store.last_seqno(clientid)
