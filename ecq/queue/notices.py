"""How the engine of a cluster broker hears what every broker did: the :class:`ecq.store.protocol.StoreListener`
given to a shared store's ``watch``.

Every append of every broker arrives as a notice carrying the entry (ecq.store.jetstream_notices). This broker's
own appends go to every observer (metrics, queue events, the lag index), so compaction and each event are
counted once in the cluster, by the broker that took the write; other brokers' appends go to the lag index
only. Each notice is told to the queue's consumer here; one told in order (every earlier entry of its shard was
told) carries the payload, so a consumer that read everything takes it without a store read, as on LevelDB.
Deletions and ack saves of other brokers keep the lag index current; an SCQ reader's position saved elsewhere may
free a tombstone waiting here for it (``position_saved``); after lost notices the queues that changed are read
again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from ecq.queue.topics import is_position_id, queue_of_position
from ecq.store.protocol import AckState, Append, Appended, AppendNotice, ExpiredRow

if TYPE_CHECKING:
    from ecq.queue.delivery import Consumer
    from ecq.queue.lag import LagIndex

log = logging.getLogger(__name__)


class ClusterNotices:
    """The notices of a shared store, handed over from the store's thread to the engine's event loop ``loop``, and
    there to what the engine gave: ``noticed(op, result, own, in_order)`` and ``deleted(clientid, rows, reason,
    own)`` (its commit fan-out), its ``consumers`` by clientid, its ``lag`` index and ``count_stored(refresh=True)``
    (its stored totals read again), and ``position_saved(queue)``, told the SCQ queue id whose reader's position
another broker saved (ecq.queue.tombstones.ReaderTombstones.check_soon)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, noticed: Callable[[Append, Appended, bool, bool], None],
                 deleted: Callable[[str, tuple[ExpiredRow, ...], str, bool], None], consumers: Mapping[str, Consumer],
                 lag: LagIndex, count_stored: Callable[..., Awaitable[None]],
                 position_saved: Callable[[str], None] = lambda queue: None) -> None:
        self._loop, self._noticed, self._deleted, self._position_saved = loop, noticed, deleted, position_saved
        self._consumers, self._lag, self._count_stored = consumers, lag, count_stored
        self._resyncs: set[asyncio.Task] = set()

    # --- the store's thread -------------------------------------------------------------------------

    def appended(self, notices: list[AppendNotice]) -> None:
        """Entries stored by any broker (StoreListener)."""
        self._loop.call_soon_threadsafe(self._appended, notices)

    def deleted(self, clientid: str, rows: tuple[ExpiredRow, ...], reason: str) -> None:
        """Entries another broker deleted (StoreListener)."""
        self._loop.call_soon_threadsafe(self._deleted, clientid, rows, reason, False)

    def ack_saved(self, clientid: str, state: AckState) -> None:
        """An ack state another broker saved (StoreListener)."""
        self._loop.call_soon_threadsafe(self._ack_saved, clientid, state)

    def resynced(self, clientids: set[str]) -> None:
        """Queues changed by notices this broker lost (StoreListener)."""
        self._loop.call_soon_threadsafe(self._resynced, clientids)

    # --- the engine's loop --------------------------------------------------------------------------

    def _appended(self, notices: list[AppendNotice]) -> None:
        for op, result, own, in_order in notices:
            self._noticed(op, result, own, in_order)

    def _ack_saved(self, clientid: str, state: AckState) -> None:
        consumer = self._consumers.get(clientid)
        if consumer is not None and consumer.online:  # a takeover in progress: this broker's own acks count
            return
        self._lag.saved_elsewhere(clientid, state)  # an SCQ reader's position too: the index follows it
        if is_position_id(clientid):
            self._position_saved(queue_of_position(clientid))

    def _resynced(self, clientids: set[str]) -> None:
        for clientid in clientids:
            if (consumer := self._consumers.get(clientid)) is not None and consumer.online:
                consumer.poll()
        for job in (self._lag.resync(clientids), self._count_stored(refresh=True)):
            task = self._loop.create_task(job, name="ecq-resync")
            self._resyncs.add(task)
            task.add_done_callback(self._resyncs.discard)
