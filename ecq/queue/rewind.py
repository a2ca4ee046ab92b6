"""Where a rewind puts a queue: a :class:`ecq.queue.topics.RewindPoint` turned into the acked seqno to store.

Built on :class:`ecq.store.protocol.QueueStore` reads only, so it works on every backend. Seqnos are never
assumed contiguous (on JetStream they are stream sequence numbers shared by the queues of a shard): the point
"before entry E" is ``E.seqno - 1``, which no other entry of the queue can hold.

A seqno above the queue's last one is refused: the writes that follow would take seqnos at or below it, count as
acked, and never be delivered.
"""

from __future__ import annotations

from ecq.store.protocol import AckState, QueueStore, stored_pages
from ecq.queue.topics import BadWrite, RewindPoint, is_position_id, queue_of_position

PAGE = 256  # entries per read while looking for the first entry published at or after a time


class UnknownQueue(LookupError):
    """A rewind asked for a queue the store knows nothing of: no seqno assigned (or, on a store that only knows
    stored entries, none stored) and no consumer state; or for an SCQ reader with no stored position."""


def rewind_seqno(store: QueueStore, clientid: str, point: RewindPoint, must_exist: bool = False) -> int:
    """The acked seqno that makes ``point`` the next delivery of the queue of ``clientid`` (a blocking read); for an
    SCQ reader's position id (ecq.queue.topics.position_id), the next delivery of that SCQ to that reader.

    ``seqno``: N itself, at most the queue's last seqno. ``earliest``: one below the first stored entry (0 when the
    queue is empty). ``latest``: the last seqno (0 when nothing is stored on a store that only knows stored
    entries). ``since``: one below the first stored entry published at or after ``point.value`` ms; when there is
    none, as ``latest``. Raises BadWrite ``bad_rewind`` for a seqno above the last one, UnknownQueue when
    ``must_exist`` and the queue is unknown (see :func:`queue_known`), ValueError for another kind, and what the
    store's reads raise (StoreReadError, TimeoutError, StoreError).
    """
    if point.kind not in ("seqno", "earliest", "latest", "since"):
        raise ValueError(f"unknown rewind point kind {point.kind!r}")
    if must_exist and not queue_known(store, clientid):
        raise UnknownQueue(f"no stored position of the SCQ reader {clientid!r}: it never acked an entry"
                           if is_position_id(clientid) else
                           f"no queue for clientid {clientid!r}: it never had a write nor a consumer state")
    queue = queue_of_position(clientid)
    if point.kind == "seqno":
        return _at_most_last(store, queue, point.value)
    if point.kind == "earliest":
        first = store.read_after(queue, 0, 1)
        return first[0].seqno - 1 if first else 0
    if point.kind == "since":
        for page in stored_pages(store, queue, PAGE):
            for message in page:
                if message.ts_ms >= point.value:
                    return message.seqno - 1
    return store.last_seqno(queue)


def queue_known(store: QueueStore, clientid: str) -> bool:
    """True when the store has a seqno or a consumer state for ``clientid`` (what ``ecq inspect`` shows)."""
    return store.last_seqno(clientid) > 0 or store.ack_state(clientid) != AckState()


def _at_most_last(store: QueueStore, clientid: str, seqno: int) -> int:
    last = store.last_seqno(clientid)
    if seqno > last:
        raise BadWrite("bad_rewind", f"refused rewind of the queue of {clientid!r} to seqno {seqno}: above its last "
                                     f"seqno {last}, so every later write would count as acked and never be "
                                     "delivered ('latest' skips everything stored)")
    return seqno
