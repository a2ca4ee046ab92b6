"""The queue engine: exclusive compacted queues without any MQTT library.

:class:`QueueEngine` owns the store, the writer pool, the batched reader and one
:class:`ecq.queue.delivery.Consumer` per queue, and runs the heartbeat, GC and store-recovery loops. A
write flows one way: :meth:`QueueEngine.write` -> writer agent -> store commit -> the commit fan-out tells
the queue's consumer and every :class:`QueueObserver` (metrics, queue events) -> delivery through the
injected ``publish`` coroutine -> PUBACK -> ack state saved through the writer. The broker adapter turns
MQTT events into one engine call each and hands the engine opaque connection objects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from ecq.config import EcqSettings
from ecq.queue.census import Census
from ecq.queue.clock import now_ms
from ecq.queue.deadlines import SharedDeadline
from ecq.queue.delivery import Consumer, Fits, Publish
from ecq.queue.groups import GroupDispatch
from ecq.queue.lag import LagIndex
from ecq.queue.notices import ClusterNotices
from ecq.queue.observer import QueueObserver
from ecq.queue.readers import BatchedReader
from ecq.queue import upkeep
from ecq.queue.rewind import rewind_seqno
from ecq.queue.snapshots import ConsumerSnapshot, EngineSnapshot, Totals, consumer_snapshot
from ecq.store.protocol import (AckState, Append, Appended, Expire, ExpiredRow, ForgetQueue, Message, Op, QueueStore,
                             StoreReadError)
from ecq.queue.tombstones import ReaderTombstones, TombstonesOff, stored_rows
from ecq.queue.topics import BadWrite, RewindPoint, is_position_id, queue_of_position
from ecq.queue.writer import WriterPool

log = logging.getLogger(__name__)

QUEUE_COUNT_INTERVAL_S = 60.0    # a shared store's queue count lists every stored key: re-read at most this often
ACK_SETTLE_S = 5.0               # on close, how long to wait for consumers' last ack states to reach the writer


class QueueEngine:
    """Queues of one broker over ``store``, opened by the caller (``ecq.store.backends.open_store``).

    ``publish(connection, topic, payload)`` sends one QoS 1 PUBLISH on a connection given to :meth:`attach`
    and returns once its PUBACK came (raising ConnectionError when the connection is gone). ``gc_lagging()``
    True makes GC wait between steps (an observer has not caught up).
    """

    def __init__(self, settings: EcqSettings, store: QueueStore, publish: Publish, *,
                 gc_lagging: Callable[[], bool] = lambda: False) -> None:
        self.store = store
        self.settings = settings
        self.observers: list[QueueObserver] = []
        self.consumers: dict[str, Consumer] = {}  # by the id its ack state is saved under (see Consumer)
        # SCQ queue id -> {position id: Consumer} of the readers in self.consumers: a write is handed to each
        self.readers: dict[str, dict[str, Consumer]] = {}
        self.census = Census()  # what totals() and heartbeat() need of the consumers, without a walk over them
        self.pool = WriterPool(store, settings.effective_pool_size(), self._on_commit, on_error=self._commit_failed)
        self._publish = publish
        self._reader = BatchedReader(threads=4)
        self._read_deadline = SharedDeadline(settings.read_timeout, "ECQ store read")
        self._write_deadline = SharedDeadline(settings.write_timeout, "ECQ write commit")
        self._queues = self._stored_entries = self._stored_bytes = 0
        self._queues_counted_at = float("-inf")
        self.traffic = 0  # appends and PUBACKs so far: GC paces itself slower while it grows
        self.gc_lock = asyncio.Lock()
        self.loading: dict[str, int] = {}  # clientid -> ack-state loads under way
        # entries stored by then may have been sent by an earlier broker process, unacked (DUP=1 when sent again);
        # later ones only by this broker's consumers, which forget a queue only once nothing is unacked (heartbeat).
        # On a shared store any broker may have sent any entry: a consumer there takes the time it was made.
        self._started_ms = now_ms()
        self.forgetting: dict[str, asyncio.Future] = {}  # clientid -> its ForgetQueue, until committed
        self._tasks: list[asyncio.Task] = []
        self.closing = False
        self.lag = LagIndex(store, self.read, self.consumers)  # pending entries per queue (ecq top, metrics)
        self.observers.append(self.lag)
        self.reader_tombstones = ReaderTombstones(self.pool, self.lag)  # an SCQ's, deleted once every reader acked
        self._collector = upkeep.Collector(settings, store, self.read, self.pool, self.observers, self.gc_lock,
                                           traffic=lambda: self.traffic, running=lambda: not self.closing,
                                           lagging=gc_lagging, consumers=self.consumers, loading=self.loading,
                                           forgetting=self.forgetting)

    # --- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Count what is stored, start the writer agents and the GC, heartbeat and store-recovery loops; on a
        shared store, listen to the appends other brokers make."""
        if self.store.shared:  # first: an append made while the lag index scans is told, and recounted; and
            loop = asyncio.get_running_loop()  # a shared store counts from the view the watch builds
            notices = ClusterNotices(loop, noticed=self.noticed, deleted=self.deleted, consumers=self.consumers,
                                     lag=self.lag, count_stored=self.count_stored,
                                     position_saved=self.reader_tombstones.check_soon)
            await loop.run_in_executor(None, self.store.watch, notices)
        await self.count_stored()
        await self.lag.rebuild()  # before any commit of this broker
        self.pool.start()
        self._tasks = [asyncio.create_task(upkeep.every(self.settings.gc_interval, self.run_gc), name="ecq-gc"),
                       asyncio.create_task(upkeep.every(self.settings.heartbeat_interval, self.heartbeat),
                                           name="ecq-heartbeat"),
                       asyncio.create_task(upkeep.every(upkeep.STORE_RECOVERY_INTERVAL_S, self.recover_store),
                                           name="ecq-store-recovery")]

    def stop_delivering(self) -> None:
        """Detach every consumer and end a running GC pass; unacked messages stay stored for the next run."""
        self.closing = True
        for consumer in self.consumers.values():
            consumer.detach()

    async def close(self) -> None:
        """Stop the loops, save the consumers' last ack states, commit every queued op, close the store."""
        self.stop_delivering()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._settle_ack_saves(self.consumers.values())
        await self.pool.close()
        self._reader.shutdown()  # reads still running in threads must end before the store closes
        self.store.close()

    @staticmethod
    async def _settle_ack_saves(consumers: Iterable[Consumer]) -> None:
        """Return once no consumer of ``consumers`` has an ack-state save in flight or due (at most ACK_SETTLE_S)."""
        deadline = asyncio.get_running_loop().time() + ACK_SETTLE_S
        while any(c.saving for c in consumers) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)

    # --- writes -------------------------------------------------------------------------------------

    def write(self, clientid: str, key: str, payload: bytes, expiry_s: int = 0) -> asyncio.Future:
        """Append ``payload`` under ``key`` to the queue of ``clientid``, stamped now; with ``expiry_s`` (an MQTT 5
        Message Expiry Interval in seconds, MQTT 5.0 section 3.3.2.3.3; 0: none) it expires that long after.

        Synchronous so that writes keep their arrival order; the returned future resolves with
        :class:`Appended` once committed, or fails with TimeoutError after ``write_timeout``, with
        :class:`ecq.store.protocol.QuotaExceeded` (the queue quota refused it) or with the commit's error.
        Raises :class:`ecq.queue.writer.PoolClosed` once the engine is closing, and BadWrite ``store_full`` while
        the stored payload bytes and this payload would exceed ``max_store_bytes`` (an empty payload, which only
        deletes, is always taken).
        """
        limit = self.settings.max_store_bytes
        if limit and payload and self._stored_bytes + len(payload) > limit:
            raise BadWrite("store_full", f"refused a write of {len(payload)} bytes to the queue of {clientid!r}: "
                                         f"the store holds {self._stored_bytes} payload bytes "
                                         f"(max_store_bytes {limit})")
        ts_ms = now_ms()
        expires_ms = ts_ms + expiry_s * 1000 if expiry_s else 0
        future = self.pool.submit(clientid, Append(clientid, key, payload, ts_ms, expires_ms))
        return self._write_deadline.watch(future)

    async def delete(self, clientid: str, key: str, stored_only: bool = False) -> Appended | None:
        """Write a tombstone for ``key`` in the queue of ``clientid`` (an empty payload through :meth:`write`);
        returns its :class:`Appended` once committed. With ``stored_only``, None and nothing written when the
        queue stores no value of ``key`` (never written, or deleted or expired since). Raises TombstonesOff when
        ``tombstones`` is false, and what :meth:`write` and the store's reads raise."""
        if not self.settings.tombstones:
            raise TombstonesOff("tombstones are off on this broker (tombstones: false): an empty payload is an "
                                "ordinary value, so a key cannot be deleted")
        if stored_only and not await self.read(self.store.key_bytes, clientid, key):
            return None
        return await self.write(clientid, key, b"")

    async def purge(self, clientid: str) -> int:
        """Delete every stored entry of the queue of ``clientid``; returns how many. Its seqno counter and ack
        state stay, so the next write gets a new seqno and nothing is delivered twice. Raises TimeoutError,
        PoolClosed, or what the store's reads and commits raise."""
        pages = await self.read(stored_rows, self.store, clientid)
        deleted = await asyncio.gather(*(self._write_deadline.watch(
            self.pool.submit(clientid, Expire(clientid, rows, "purge"))) for rows in pages))
        return sum(map(len, deleted))

    def _on_commit(self, ops: Sequence[Op], results: Sequence[object]) -> None:
        observers = self.observers
        for op, result in zip(ops, results, strict=True):
            if isinstance(op, Append):
                if isinstance(result, Appended):
                    self.traffic += 1
                    if not self.store.shared:  # a shared store tells every append, this broker's too, by notice
                        self.noticed(op, result, own=True, in_order=True)
                    if result.evicted:
                        self.deleted(op.clientid, result.evicted, "quota")
            elif isinstance(op, Expire) and result:
                self.deleted(op.clientid, result, op.reason)
            elif isinstance(op, ForgetQueue) and result:
                self._queues -= not is_position_id(op.clientid)
                for observer in observers:
                    observer.forgotten(op.clientid)
                if is_position_id(op.clientid):  # a tombstone it held back may go now
                    self.reader_tombstones.check_soon(queue_of_position(op.clientid))

    def deleted(self, clientid: str, rows: tuple[ExpiredRow, ...], reason: str, own: bool = True) -> None:
        """``rows`` of ``clientid`` were deleted, by this broker (``own``: every observer is told) or by another
        one of a cluster (only the lag index is)."""
        self._stored_entries -= len(rows)
        self._stored_bytes -= sum(row.size for row in rows)
        seqnos = {row.seqno for row in rows}
        self.reader_tombstones.gone(clientid, seqnos)
        for consumer in self._consumers_of(clientid):
            consumer.forget(seqnos)
        for observer in self.observers if own else (self.lag,):
            observer.expired(clientid, rows, reason)

    def noticed(self, op: Append, result: Appended, own: bool, in_order: bool) -> None:
        """``op`` was stored as ``result``: by this broker (``own``: every observer is told) or by another one of
        a cluster (only the lag index is). ``in_order`` (every earlier entry of its queue was told) lets an online
        consumer that read everything take the entry without a store read."""
        self._queues += result.seqno == 1
        self._stored_entries += 1 - len(result.replaced)
        self._stored_bytes += len(op.payload) - result.replaced_bytes
        if result.replaced:
            self.reader_tombstones.gone(op.clientid, result.replaced)
        if online := [consumer for consumer in self._consumers_of(op.clientid) if consumer.online]:
            message = Message(result.seqno, op.key, op.payload, op.ts_ms, op.expires_ms) if in_order else None
            for consumer in online:  # an SCQ's readers share the one Message
                consumer.appended(result.seqno, op.key, message)
        for observer in self.observers if own else (self.lag,):
            observer.appended(op, result)

    def _consumers_of(self, queue: str) -> Iterable[Consumer]:
        """The consumers in memory that read the queue id ``queue``: an SCQ's readers, or an ECQ queue's consumer."""
        if (readers := self.readers.get(queue)) is not None:
            return readers.values()
        consumer = self.consumers.get(queue)
        return () if consumer is None else (consumer,)

    async def count_stored(self, refresh: bool = False) -> None:
        """Read the queue, entry and byte counts from the store. They are then kept up to date by this broker's
        commits, and on a shared store by every broker's notices; there the heartbeat re-reads them every
        QUEUE_COUNT_INTERVAL_S, and so does a resync after lost notices (``refresh``: a failed read, NATS being
        away, keeps the last figures instead of raising)."""
        try:
            if not refresh or time.monotonic() - self._queues_counted_at >= QUEUE_COUNT_INTERVAL_S:
                self._queues = await self.read(self.store.count_queues)
                self._queues_counted_at = time.monotonic()
            self._stored_entries, self._stored_bytes = await self.read(self.store.stored_totals)
        except Exception as exc:
            if not refresh:
                raise
            log.debug("ECQ store totals not refreshed: %s", exc)

    def _commit_failed(self, exc: Exception) -> None:
        for observer in self.observers:
            observer.store_error("write", exc)

    # --- consumers ----------------------------------------------------------------------------------

    async def attach(self, clientid: str, connection: Any, still_current: Callable[[], bool] = lambda: True,
                     receive_maximum: int | None = None, fits: Fits | None = None, queue: str | None = None) -> None:
        """Deliver the queue of ``clientid`` to ``connection`` (loading its ack state first), at most
        min(``reader_batch_size``, ``receive_maximum``) deliveries in flight (None: ``reader_batch_size``), an SCQ
        group's (``connection`` an ecq.queue.groups.GroupDispatch) the sum of its members' windows when the state
        is loaded; an entry ``fits`` refuses (too large for the connection; a group's: for every member) is skipped
        for it (see ``Consumer.attach``). An SCQ reader: ``queue`` is the SCQ's queue id and ``clientid`` the
        reader's position id (ecq.queue.topics.position_id); a first attach, with no stored position, starts at the
        queue's oldest entry.

        ``still_current()`` is asked after that load: an unsubscribe, disconnect or takeover may have
        happened meanwhile, and then nothing is attached. A connection already attached is detached first.
        """
        if self.closing:
            return
        if self.store.shared and (cached := self.consumers.get(clientid)) and not cached.online \
                and not cached.saving:  # another broker may have moved its acks on (or rewound it): read them
            self._drop_consumer(clientid)
        if clientid not in self.consumers:
            state = await self._load_ack_state(clientid, still_current)
            if state is None:
                return
            self._consumer(clientid, state, queue)
        if not self.closing and still_current():
            if isinstance(connection, GroupDispatch):
                self.consumers[clientid].attach(connection, connection.capacity, connection.fits,
                                                windows=len(connection.members))
            else:
                self.consumers[clientid].attach(connection, receive_maximum, fits)

    def _consumer(self, clientid: str, state: AckState, queue: str | None = None) -> Consumer:
        """The consumer of ``clientid`` (reading ``queue``, see :meth:`attach`); a new one from ``state`` unless one
        was made meanwhile (an attach and a rewind may both have been loading the state)."""
        if (consumer := self.consumers.get(clientid)) is not None:
            return consumer
        consumer = self.consumers[clientid] = Consumer(
            clientid, state, store=self.store, pool=self.pool, publish=self._send, observer=self,
            read=self._read_soon, window=self.settings.reader_batch_size, read_deadline=self._read_deadline,
            retention_s=self.settings.data_retention, tombstones=self.settings.tombstones,
            sent_before_ms=now_ms() if self.store.shared else self._started_ms, census=self.census, queue=queue,
            reader_saved=self.reader_tombstones.saved)
        if consumer.queue != clientid:
            self.readers.setdefault(consumer.queue, {})[clientid] = consumer
        return consumer

    def _send(self, connection: Any, *delivery: Any) -> Awaitable[None]:
        """The injected ``publish`` on ``connection``, or, for an SCQ group's consumer, on one of its members
        (ecq.queue.groups.GroupDispatch)."""
        if isinstance(connection, GroupDispatch):
            return connection.publish(self._publish, *delivery)
        return self._publish(connection, *delivery)

    def _drop_consumer(self, clientid: str) -> None:
        """Forget the consumer of ``clientid`` (its state is in the store), and it as a reader of its queue."""
        consumer = self.consumers.pop(clientid)
        if (readers := self.readers.get(consumer.queue)) is not None and readers.pop(clientid, None) \
                and not readers:
            del self.readers[consumer.queue]

    async def rewind(self, clientid: str, point: RewindPoint, *, must_exist: bool = False) -> int:
        """Rewind the queue of ``clientid`` (or an SCQ reader's position, by its position id) to ``point``; returns
        the new acked seqno once it is stored.

        The next delivery is the first stored entry with a seqno above it (see ecq.queue.rewind for each
        kind of point); entries compaction or GC removed are not brought back. An online consumer's inflight
        sends are forgotten and its delivery restarts from there at once; an offline one resumes from there on
        its next attach. The state is saved through the queue's writer agent behind the consumer's own saves.
        With ``must_exist`` (an operator's rewind) a queue with no consumer here and nothing in the store is not
        created. Raises BadWrite ``bad_rewind`` (a seqno above the queue's last one), UnknownQueue (``must_exist``),
        TimeoutError (not stored within ``write_timeout``), PoolClosed (shutting down), or what the store's reads
        and commits raise; nothing is changed when it raises before the save.
        """
        must_exist = must_exist and clientid not in self.consumers
        acked = await self.read(rewind_seqno, self.store, clientid, point, must_exist)
        if clientid not in self.consumers:
            state = await self._load_ack_state(clientid, lambda: True)
            self._consumer(clientid, state, queue_of_position(clientid))
        await self._write_deadline.watch(self.consumers[clientid].rewind(acked))
        log.info("ECQ rewound the queue of %s to %s: acked seqno %d", clientid, point, acked)
        for observer in self.observers:
            observer.rewound(clientid, point, acked)
        return acked

    async def _load_ack_state(self, clientid: str, still_current: Callable[[], bool]) -> AckState | None:
        """The stored ack state of ``clientid``, read again every ``read_timeout`` while the store cannot answer
        (a NATS outage, a JetStream leader election); None once the connection is no longer current. State GC
        leaves a queue alone while its state loads, and a load waits for a state GC of the queue already
        under way: a consumer made from a state GC then deletes would take new seqnos as acked."""
        self.loading[clientid] = self.loading.get(clientid, 0) + 1
        try:
            if forgetting := self.forgetting.get(clientid):
                await asyncio.wait([forgetting])
            return await self._read_ack_state(clientid, still_current)
        finally:
            if (loads := self.loading.pop(clientid)) > 1:
                self.loading[clientid] = loads - 1

    async def _read_ack_state(self, clientid: str, still_current: Callable[[], bool]) -> AckState | None:
        while True:
            try:
                return await self.read(self.store.ack_state, clientid)
            except StoreReadError:
                raise
            except Exception as exc:
                log.warning("ECQ cannot read the ack state of %s yet (%s); retrying in %.1fs",
                            clientid, exc or type(exc).__name__, self.settings.read_timeout)
            await asyncio.sleep(self.settings.read_timeout)
            if self.closing or not still_current():
                return None

    def detach(self, clientid: str) -> None:
        """Stop delivering to ``clientid``; what was sent and not acked is delivered again on the next attach."""
        if consumer := self.consumers.get(clientid):
            consumer.detach()

    def forget_if_idle(self, clientid: str) -> None:
        """Forget ``clientid``'s consumer when it is offline with nothing to keep in memory (no ack save under way,
        nothing sent and unacked, whose sends its DUP counts): its ack state is in the store, read again at its next
        attach."""
        consumer = self.consumers.get(clientid)
        if consumer is not None and not consumer.online and not consumer.saving and not consumer.resends.attempts:
            self._drop_consumer(clientid)

    def stop_sending(self, clientid: str) -> None:
        """``clientid`` unsubscribed from its queue: start no new delivery to it, but complete those in flight
        (their PUBACKs are taken and saved; see :meth:`Consumer.stop_sending`)."""
        if consumer := self.consumers.get(clientid):
            consumer.stop_sending()

    async def release(self, clientid: str) -> None:
        """Stop delivering to ``clientid`` and return once the acks it sent are saved (at most ACK_SETTLE_S):
        another broker of the cluster is taking the queue over and reads the saved position next (and an attach
        here later reads it again too, see :meth:`attach`)."""
        if (consumer := self.consumers.get(clientid)) is None:
            return
        consumer.detach()
        await self._settle_ack_saves([consumer])

    def connection_of(self, clientid: str) -> Any:
        """The connection ``clientid``'s queue is delivered to, or None."""
        consumer = self.consumers.get(clientid)
        return consumer.connection if consumer else None

    def delivered(self, clientid: str, message: Message, attempt: int) -> None:
        """Delivery observer: a send, passed on to the observers."""
        for observer in self.observers:
            observer.delivered(clientid, message, attempt)

    def acked(self, clientid: str, message: Message, sent_monotonic: float) -> None:
        """Delivery observer: a PUBACK, counted as traffic for GC pacing and passed on to the observers."""
        self.traffic += 1
        for observer in self.observers:
            observer.acked(clientid, message, sent_monotonic)

    def skipped(self, clientid: str, message: Message, reason: str) -> None:
        """Delivery observer: an entry not sent to the attached connection, passed on to the observers."""
        for observer in self.observers:
            observer.skipped(clientid, message, reason)

    async def heartbeat(self) -> None:
        """Wake idle online consumers that may have unread appends (a lost wake-up delays, never loses)
        and forget idle offline ones. Waking every idle consumer cost one store read each: with 1,000
        consumers that stalled delivery for ~400 ms every heartbeat. On a shared store, lost notices are found
        by the store (ecq.store.jetstream_notices) and the consumers of the queues they changed are polled then,
        so an idle cluster reads nothing here. Then the lag index re-reads its dirty queues.

        Only the consumers woken or detached since (``census.unsettled``) are looked at, not every consumer: one
        stays unsettled while it has deliveries in flight, is behind or has an ack save to finish."""
        unsettled = self.census.unsettled
        for consumer in list(unsettled):
            if self.consumers.get(consumer.clientid) is not consumer:
                unsettled.discard(consumer)
            elif consumer.online:
                if consumer.inflight:
                    continue
                if consumer.behind:
                    consumer.wake()
                else:
                    unsettled.discard(consumer)  # until its next wake-up: an append, an ack, a rewind, a poll
            elif not consumer.saving:
                unsettled.discard(consumer)
                self.forget_if_idle(consumer.clientid)  # kept while it has sends to DUP; a rewind wakes it
        if self.store.shared and time.monotonic() - self._queues_counted_at >= QUEUE_COUNT_INTERVAL_S:
            await self.count_stored(refresh=True)  # notices keep the counts between two reads
        await self.lag.refresh()

    # --- garbage collection and store health --------------------------------------------------------

    async def run_gc(self) -> int:
        """One GC pass and a state GC (ecq.queue.upkeep.Collector.run_gc); returns how many entries it deleted."""
        return await self._collector.run_gc()

    async def recover_store(self) -> None:
        """After failed commits, reopen the store once it can take writes again (ecq.queue.upkeep)."""
        await upkeep.recover_store(self.store)

    def health(self) -> dict[str, str]:
        """``{"status": "ok"}``, or ``{"status": "degraded", "reason": ...}`` while commits to the store fail
        (writes get no PUBACK, ack positions are not saved)."""
        if self.store.write_error:
            return {"status": "degraded", "reason": f"store writes fail: {self.store.write_error}"}
        return {"status": "ok"}

    # --- reads and snapshots ------------------------------------------------------------------------

    async def read(self, func: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking store read ``func(*args)`` in the reader threads (drained before the store closes)."""
        return await self._read_soon(func, *args)

    def _read_soon(self, func: Callable[..., Any], *args: Any) -> asyncio.Future:
        future = self.store.read_async(func, *args) or self._reader.read(self.store.run, func, *args)
        future.add_done_callback(self._count_read_error)
        return future

    def _count_read_error(self, future: asyncio.Future) -> None:
        if not future.cancelled() and isinstance(exc := future.exception(), StoreReadError):
            for observer in self.observers:
                observer.store_error("read", exc)

    def totals(self) -> Totals:
        """Counts kept since start: queues, stored entries and payload bytes, inflight sends, online consumers."""
        return Totals(self._queues, self._stored_entries, self._stored_bytes, self.census.inflight, self.census.online)

    def snapshot(self) -> EngineSnapshot:
        """An immutable copy of the totals and of every known consumer's state (call on the event loop)."""
        return EngineSnapshot(self.totals(), {cid: consumer_snapshot(c) for cid, c in self.consumers.items()})

    def readers_snapshot(self) -> EngineSnapshot:
        """The totals and immutable copies of the SCQ readers in memory, by position id, not of the ECQ consumers
        (call on the event loop): what ``ecq status`` needs at a cost of the SCQ readers, not of the whole fleet;
        the few consumers it lists are :meth:`consumer_snapshot`'s."""
        return EngineSnapshot(self.totals(), {cid: consumer_snapshot(c) for readers in self.readers.values()
                                              for cid, c in readers.items()})

    def reader_snapshots(self, queue: str) -> dict[str, ConsumerSnapshot]:
        """Immutable copies of the states of the SCQ ``queue``'s (a queue id) readers in memory, by position id."""
        return {cid: consumer_snapshot(c) for cid, c in self.readers.get(queue, {}).items()}

    def consumer_snapshot(self, clientid: str) -> ConsumerSnapshot | None:
        """An immutable copy of one consumer's state, or None when it has no consumer in memory."""
        consumer = self.consumers.get(clientid)
        return consumer_snapshot(consumer) if consumer else None

