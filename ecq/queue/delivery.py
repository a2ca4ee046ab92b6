"""Delivery of one queue to its one online consumer.

A :class:`Consumer` is attached to the live MQTT connection of ``<clientid>`` while that connection holds the
``$ECQ/<clientid>/#`` subscription. It keeps at most ``window`` (``reader_batch_size``) unacked QoS 1 PUBLISHes in
flight (an SCQ group's consumer a window per member, ecq.queue.groups). Each PUBACK marks its seqno acked; ``acked``
advances to the highest seqno below which every message handed to the connection is acked, and is saved through the
writer pool. Seqnos acked out of order are saved too, so a reconnect never redelivers them. Detaching (disconnect,
takeover) drops the inflight window; the next attach resumes after ``acked``: what was sent but not acked is
delivered again (MQTT 3.1.1 section 4.4). An unsubscribe (:meth:`Consumer.stop_sending`) starts no new delivery but
completes those in flight (MQTT 3.1.1 section 3.10.4): their PUBACKs still count and are saved, and the consumer
detaches once none is left.

Nothing new is sent to a consumer while one of its PUBACKs is not yet stored: an ack is committed to LevelDB before
the next delivery to that consumer leaves, so after a crash only acks received after the last message the consumer
was sent can be lost, and only those messages are delivered again. A failed save (disk full) is retried every
``SAVE_RETRY_S`` and holds delivery meanwhile.

The consumer reads up to two windows ahead of what is in flight and asks for the next window before the last
one is used up (one read in flight, beside the deliveries): a read's round trip (a thread hop; on JetStream a
request) overlaps the sends, and one read serves about one window of PUBACKs. PUBACKs that arrive together are
saved together (:meth:`Consumer._save_soon`). A read-ahead message that compaction superseded meanwhile is
dropped, one that expired is skipped. A consumer that has read everything stored (the realtime case) takes a
new append straight from its commit (:meth:`Consumer.appended` with the message), without a store read:
Kafka's consumers read the tail of a log from the page cache for the same reason.

With ``tombstones`` on, an acked entry with an empty payload (a tombstone) is deleted once the save holding
its ack is committed: an Expire op with reason ``tombstone_acked`` through the queue's writer agent. An SCQ
reader's committed save is told to ``reader_saved`` instead, with the tombstones it acked: they go once every
reader of the SCQ acked them (ecq.queue.tombstones.ReaderTombstones).

A rewind (:meth:`Consumer.rewind`) sets ``acked`` to a chosen seqno and forgets everything in flight; its
save queues behind the consumer's own save, so a late ack save cannot overwrite it.

An entry whose PUBLISH would exceed what the attached connection takes (an MQTT 5 consumer's Maximum Packet Size:
the ``fits`` given to :meth:`Consumer.attach`) is skipped for that connection, a gap ``acked`` does not pass while
the entry is stored (:mod:`ecq.queue.oversize`). A send again carries ``dup`` (:mod:`ecq.queue.resends`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ecq.queue import oversize
from ecq.queue.census import Census
from ecq.queue.clock import now_ms, retention_cutoff_ms
from ecq.queue.deadlines import SharedDeadline
from ecq.queue.resends import Resends
from ecq.queue.tombstones import delete_acked
from ecq.store.protocol import AckState, ExpiredRow, Message, QueueStore, SaveAck, StoreReadError
from ecq.queue.topics import delivery_topic
from ecq.queue.writer import PoolClosed, WriterPool

log = logging.getLogger(__name__)

_UNKNOWN = 2**64  # above every seqno: "the stored tail is not known"
SAVE_RETRY_S = 1.0  # after a failed ack-state save (disk full, I/O error), try again this much later

# publish(connection, topic, payload, seqno, ts_ms, expires_ms (publish and expiry time, Unix ms, expiry 0: none; for
# MQTT 5's properties), dup (True: a send again, DUP=1), topic_filter=None (an SCQ group's: the subscription the
# delivery answers, for its MQTT 5 Subscription Identifier)) -> awaits the PUBACK; raises ConnectionError when the
# connection is gone, oversize.NoConnectionTakes when no connection it may send on takes the entry.
Publish = Callable[..., Awaitable[None]]
# fits(topic, message) -> False when the PUBLISH of ``message`` would exceed what the connection takes (its size).
Fits = Callable[[str, Message], bool]
# read(func, *args) -> a future of the blocking store read func(*args), run off the event loop.
Read = Callable[..., asyncio.Future]


class DeliveryObserver(Protocol):
    """Told of each send and each PUBACK (metrics, queue events); must return at once and never raise."""

    def delivered(self, clientid: str, message: Message, attempt: int) -> None:
        """``message`` was sent; ``attempt`` is 1 for its first send, 2+ for each send again."""

    def acked(self, clientid: str, message: Message, sent_monotonic: float) -> None:
        """The PUBACK of ``message`` came; it was sent at ``sent_monotonic`` (time.monotonic seconds)."""

    def skipped(self, clientid: str, message: Message, reason: str) -> None:
        """``message`` was not sent to the attached connection, and stays pending; ``reason``: ``packet_too_large``."""


class Consumer:
    """Delivery state of the queue of ``clientid``; at most one attached connection at a time. An SCQ reader's
    consumer reads the queue id ``queue`` (``$SCQ/<queue>``) and saves its position as the ack state of
    ``clientid`` (``$SCQ/<queue>/<reader>``, see ecq.queue.topics.position_id)."""

    __slots__ = ("clientid", "queue", "state", "connection", "_sending", "inflight", "saves_pending", "_save_due",
                 "_rewinds", "_rewind_waiters", "_store", "_pool", "_publish", "_observer", "_read_store", "resends",
                 "_read_deadline", "_window", "_reach", "_retention_s", "_inflight_max", "_tombstones",
                 "_acked_tombstones",
                 "_read_cursor", "_ready", "_newest", "_handed", "_told", "_reading", "_deleted_in_read", "_unreadable",
                 "_pump_due", "_fits", "skipped", "_retry_due", "_census", "_reader_saved")  # one per queue: no dict

    def __init__(self, clientid: str, state: AckState, *, store: QueueStore, pool: WriterPool, publish: Publish,
                 observer: DeliveryObserver, read: Read, read_deadline: SharedDeadline, window: int,
                 retention_s: float, tombstones: bool = False, sent_before_ms: int = 0,
                 census: Census | None = None, queue: str | None = None,
                 reader_saved: Callable[[str, list[ExpiredRow]], None] | None = None) -> None:
        """``sent_before_ms``: entries stored at or before this time (Unix ms; 0: none) may have been sent by a
        consumer of this queue that this one does not know of (see the module's docstring on ``dup``). ``census``:
        the engine's counts of its consumers, told of this one's changes (None: its own, for a consumer alone).
        ``queue``: the queue id read (None: ``clientid``, an ECQ consumer). ``reader_saved(queue, rows)``: told,
        for an SCQ reader, of each committed save and the tombstones (rows) it acked, which this consumer does not
        delete itself (others read them too; None: GC deletes them, after ``tombstone_retention``)."""
        self.clientid = clientid
        self.queue = queue or clientid
        self.state = state
        self.connection: Any = None
        self._sending = False               # attached and subscribed: new deliveries may start
        self.inflight: dict[int, asyncio.Task] = {}
        self.saves_pending = 0              # SaveAck ops submitted and not yet committed (0 or 1)
        self._save_due = False              # the state changed while a save was in flight
        self._rewinds = 0                   # rewinds so far; each save notes how many its snapshot includes
        self._rewind_waiters: list[tuple[int, asyncio.Future]] = []  # (rewinds, resolved once such a save commits)
        self._store, self._pool, self._publish, self._observer = store, pool, publish, observer
        self._read_store = read
        self.resends = Resends(sent_before_ms, window)  # sends so far of each unacked seqno, their DUP
        self._read_deadline = read_deadline
        self._window, self._retention_s = window, retention_s
        self._reach = window                # the windows the attached connection takes: window x their number
        self._inflight_max = window         # the attached connection's bound: _reach, or less if it asked for less
        self._tombstones = tombstones
        self._reader_saved = reader_saved
        self._acked_tombstones: list[ExpiredRow] = []  # acked, to delete once a save holding their ack commits
        self._read_cursor = state.acked     # highest seqno read from the store for this connection
        self._ready: deque[Message] | tuple[()] = ()  # read ahead, not yet handed out (at most two windows)
        self._newest = state.acked          # highest seqno known to be stored (appends tell it)
        self._handed: deque[int] | tuple[()] = ()  # seqnos handed to this connection, oldest first, not yet folded
        self._told = 0                      # highest seqno told since the read in flight started (_UNKNOWN: polled)
        self._reading: asyncio.Task | None = None   # the read-ahead in flight
        self._deleted_in_read: set[int] = set()     # seqnos deleted while it was in flight: not to be sent
        self._unreadable = False            # a read found damaged data: delivery stops (StoreReadError)
        self._pump_due: asyncio.Handle | None = None  # the pump's run at the loop's next turn, once woken
        self._fits: Fits | None = None      # the attached connection's size bound (None: none)
        self.skipped: dict[int, Message] = {}  # seqno -> entries skipped for this connection: gaps in _handed
        self._retry_due = False             # attached again: the skipped entries may fit now
        self._census = census if census is not None else Census()

    @property
    def online(self) -> bool:
        """True while a connection is attached."""
        return self.connection is not None

    def attach(self, connection: Any, receive_maximum: int | None = None, fits: Fits | None = None,
               windows: int = 1) -> None:
        """Start delivering to ``connection`` (detaching another one first), at most min(``windows`` x window,
        ``receive_maximum``) in flight on it (MQTT 5.0 section 3.1.2.11.3; None: no bound of its own), reading
        ahead up to twice that; ``windows`` is 1 but for an SCQ group's consumer (ecq.queue.groups: one window per
        member). An entry ``fits`` refuses is skipped for it (see the module's docstring; None: every entry fits)."""
        self._reach = self._window * windows
        self._inflight_max = min(self._reach, receive_maximum) if receive_maximum else self._reach
        self._fits = fits
        self._newest = self._told = _UNKNOWN  # appends made while detached were not told: read to a short read
        if connection is self.connection:
            self._sending, self._retry_due = True, bool(self.skipped)
            self.wake()
            return
        self.detach()
        self.connection, self._sending = connection, True
        self._census.online += 1
        self.wake()

    def detach(self) -> None:
        """Stop delivering; unacked inflight messages will be delivered again on the next attach."""
        if self._pump_due is not None:
            self._pump_due.cancel()
            self._pump_due = None
        self._cancel_read()
        self._cancel_inflight()
        self._handed, self._ready = (), ()
        self.skipped.clear()
        self._read_cursor = self.state.acked
        if self.connection is not None:
            self._census.online -= 1
        self.connection, self._sending, self._unreadable = None, False, False
        self._census.unsettled.add(self)  # the heartbeat forgets it once nothing of it is left to save

    def stop_sending(self) -> None:
        """The consumer unsubscribed: start no new delivery, but complete those in flight (MQTT 3.1.1 section
        3.10.4, MQTT-3.10.4-3): their PUBACKs are folded into the ack state and saved like any other. Detaches
        once no delivery is left in flight (at once when there is none), or when the connection closes first.
        A later :meth:`attach` of the same connection (a new SUBSCRIBE) resumes sending."""
        self._sending = False
        if not self.inflight:
            self.detach()

    def rewind(self, acked: int) -> asyncio.Future:
        """Move the queue's position to ``acked``: the next delivery is the first stored entry with a seqno above it.

        Inflight sends are forgotten (their PUBACKs, if any come, count for nothing), the read-ahead, the
        handed-out seqnos, the send counts and the seqnos acked out of order are cleared; when a connection is
        attached, delivery restarts from ``acked`` at once (after the save below, like any ack). The new state is
        saved through the writer pool after any save of this consumer already in flight, so an older snapshot
        cannot overwrite it. Returns a future resolved once a save holding this rewind is committed; it fails
        with PoolClosed when the broker is shutting down. A consumer that unsubscribed and was waiting only for
        the PUBACKs of its last deliveries is detached: nothing is left for it to wait for.
        """
        if self.connection is not None and not self._sending:
            self.detach()
        self._cancel_inflight()
        self._handed, self._ready = (), ()
        self.skipped.clear()
        self.resends.clear()
        self.state = AckState(acked, self.state.last_ack_ms, set())
        self._read_cursor = acked
        self._newest = self._told = _UNKNOWN  # read until a short read
        self._cancel_read()  # a read in progress would bring back entries after the old cursor
        self._rewinds += 1
        stored = asyncio.get_running_loop().create_future()
        self._rewind_waiters.append((self._rewinds, stored))
        self._save()
        self.wake()
        return stored

    @property
    def saving(self) -> bool:
        """True while an ack-state save is in flight or due."""
        return bool(self.saves_pending) or self._save_due

    @property
    def behind(self) -> bool:
        """True when an append newer than what was handed out may still be unread (the heartbeat's test)."""
        return self._newest > self._read_cursor

    def wake(self) -> None:
        """Ask the pump to look for new messages (after an ack or a heartbeat) at the event loop's next turn, once
        however often it is woken in this one; the next heartbeat looks at it."""
        if self._pump_due is None and self.connection is not None:
            self._pump_due = asyncio.get_running_loop().call_soon(self._pump)
        self._census.unsettled.add(self)

    def poll(self) -> None:
        """Appends may have been made without :meth:`appended` being called (a shared store's notices were
        lost): read the store until a short read, as after an attach."""
        self._newest = self._told = _UNKNOWN  # a read in flight now does not end the unknown
        self.wake()

    def forget(self, seqnos: set[int]) -> None:
        """Entries ``seqnos`` were deleted (purge, GC, quota eviction): drop them from the read-ahead so they are
        not sent; an entry skipped for this connection no longer holds ``acked`` back."""
        self._ready = deque(m for m in self._ready if m.seqno not in seqnos) or ()
        if self._reading is not None:  # the read may have found them before their delete committed
            self._deleted_in_read |= seqnos
        self._close_gaps([seqno for seqno in self.skipped if seqno in seqnos])

    def appended(self, seqno: int, key: str, message: Message | None = None) -> None:
        """Message ``seqno`` was just committed to this queue under ``key``, replacing its older values
        (compaction): deliver it, and drop an older value of ``key`` read ahead, so a superseded value is not sent.

        ``message`` is the committed entry itself. It is given only by a store whose appends are told in seqno
        order (this broker's own commits of an embedded store). When every stored entry before it was read, it
        joins the read-ahead directly and no store read is made for it.
        """
        if self._ready:
            self._ready = deque(m for m in self._ready if m.key != key or m.seqno >= seqno) or ()
        self._close_gaps(oversize.superseded(self.skipped, key, seqno))
        if message is not None and self._takes_from_commit(seqno):
            self._add_ready([message])
            self._read_cursor = seqno
        self._newest = max(self._newest, seqno)
        self._told = max(self._told, seqno)
        self.wake()

    def _close_gaps(self, seqnos: list[int]) -> None:
        """Skipped entries ``seqnos`` were deleted: ``acked`` may pass them (see ecq.queue.oversize.close_gaps)."""
        if oversize.close_gaps(self.skipped, self.state, seqnos):
            self.wake()

    def _takes_from_commit(self, seqno: int) -> bool:
        """True when entry ``seqno``, just committed, is the next one this connection would read: everything
        stored up to the read cursor was read (``_newest`` is the cursor, never true while a read is in flight,
        since a read starts only behind) and the read-ahead has room."""
        return self.online and self._newest == self._read_cursor < seqno and len(self._ready) < self._reach

    def _pump(self) -> None:
        """One round of delivery, run by :meth:`wake` (a callback, not a task: an attached consumer holds no task
        and no coroutine frame while its queue is empty): fold the PUBACKs come, save them, then hand out."""
        self._pump_due = None
        if self._unreadable or not self._sending:
            return
        self._read_ahead()
        if self._fold_acked():
            self._save()
        if not self.saving:  # every PUBACK received so far is stored before anything more is sent
            self._retry_skipped()
            self._hand_out_ready()
            self._read_ahead()

    def _read_ahead(self) -> None:
        """Start a read, up to two windows ahead, when less than one is read ahead and the store may hold more."""
        if self._reading is None and self.behind and len(self._ready) < self._reach:
            limit = 2 * self._reach - len(self._ready)
            self._reading = asyncio.create_task(self._read_into_ready(limit), name=f"ecq-read-{self.clientid}")

    def _cancel_read(self) -> None:
        if self._reading is not None:
            self._reading, reading = None, self._reading
            self._deleted_in_read = set()
            reading.cancel()

    async def _read_into_ready(self, limit: int) -> None:
        self._told = 0  # after a failed read this task stays the read in flight until its retry is due
        try:
            messages = await self._read(limit)
        except StoreReadError as exc:  # a damaged block stays damaged: stop rather than retry forever
            log.error("ECQ delivery of %s stopped: cannot read its queue: %s; stop the broker and run `ecq repair`",
                      self.clientid, exc)
            self._unreadable = True
            self.wake()
            return
        except Exception as exc:  # timeout or LevelDB error: a later round retries, nothing is skipped
            log.warning("ECQ read for %s failed (%s); retrying in %.1fs",
                        self.clientid, exc or type(exc).__name__, self._read_deadline.timeout_s)
            await asyncio.sleep(self._read_deadline.timeout_s)
            messages = None
        self._reading, deleted, self._deleted_in_read = None, self._deleted_in_read, set()
        self.wake()
        if messages is None:
            return
        self._add_ready([m for m in messages if m.seqno not in deleted])
        self._read_cursor = messages[-1].seqno if messages else self._read_cursor
        if len(messages) < limit:  # everything stored was read, but what was appended meanwhile
            self._newest = max(self._read_cursor, self._told)

    async def _read(self, limit: int) -> list[Message]:
        min_ts = retention_cutoff_ms(self._retention_s, now := now_ms())
        return await self._read_deadline.watch(
            self._read_store(self._store.read_after, self.queue, self._read_cursor, limit, min_ts,
                             None if self._newest == _UNKNOWN else self._newest, now))

    def _hand_out_ready(self) -> None:
        """Hand read-ahead messages to the connection while the window has room; skip any that expired
        since they were read, by ``data_retention`` or their own expiry (an expired entry is never delivered)."""
        oldest_live_ms = retention_cutoff_ms(self._retention_s, now := now_ms())
        while self._ready and len(self.inflight) < self._inflight_max:
            message = self._ready.popleft()
            if message.ts_ms >= oldest_live_ms and not message.lapsed(now):
                self._hand_out(message)
        if not self._ready:
            self._ready = ()

    def _add_ready(self, messages: list[Message]) -> None:
        """Append ``messages`` to the read-ahead (kept as ``()`` while empty, as ``_handed`` is: an empty deque is
        760 bytes, and most consumers of a fleet wait with nothing read ahead or in flight)."""
        if not messages:
            return
        if self._ready:
            self._ready.extend(messages)
        else:
            self._ready = deque(messages)

    def _hand_out(self, message: Message) -> None:
        if not self._handed:
            self._handed = deque()
        self._handed.append(message.seqno)
        if message.seqno in self.state.above:
            return
        topic = delivery_topic(self.queue, message.key)
        if self._fits is not None and not self._fits(topic, message):
            oversize.skip(self.skipped, self.clientid, message, self._observer)
            return
        self._start_delivery(topic, message)

    def _start_delivery(self, topic: str, message: Message) -> None:
        task = asyncio.create_task(self._deliver(topic, message), name=f"ecq-send-{self.clientid}-{message.seqno}")
        self.inflight[message.seqno] = task
        self._census.inflight += 1

    def _retry_skipped(self) -> None:
        """When the attached connection may take more than before (attached again: an SCQ group's new member), send
        the skipped entries it now takes, still gaps in ``_handed`` until their PUBACKs."""
        if not self._retry_due:
            return
        self._retry_due = False
        for seqno, message in sorted(self.skipped.items()):
            topic = delivery_topic(self.queue, message.key)
            if seqno not in self.inflight and (self._fits is None or self._fits(topic, message)):
                del self.skipped[seqno]
                self._start_delivery(topic, message)

    def _done_inflight(self, seqno: int) -> None:
        if self.inflight.pop(seqno, None) is not None:
            self._census.inflight -= 1

    def _cancel_inflight(self) -> None:
        for task in self.inflight.values():
            task.cancel()
        self._census.inflight -= len(self.inflight)
        self.inflight.clear()

    async def _deliver(self, topic: str, message: Message) -> None:
        connection = self.connection
        attempt, dup = self.resends.send(message, self._reach)
        self._observer.delivered(self.clientid, message, attempt)
        sent = time.monotonic()
        try:
            await self._publish(connection, topic, message.payload, message.seqno, message.ts_ms, message.expires_ms,
                                dup)
        except ConnectionError as exc:
            log.info("ECQ delivery to %s stopped: %s", self.clientid, exc)
            self._done_inflight(message.seqno)
            if connection is self.connection:
                self.detach()
            return
        except oversize.NoConnectionTakes:
            self._done_inflight(message.seqno)
            if connection is self.connection:
                oversize.skip(self.skipped, self.clientid, message, self._observer)
                self.wake()
            return
        self._done_inflight(message.seqno)
        self.resends.acked(message.seqno)
        self._observer.acked(self.clientid, message, sent)
        self.state.above.add(message.seqno)
        if oversize.drop_past_bound(self.skipped, self.state, self.clientid, self._observer):
            self.wake()
        self.state.last_ack_ms = now_ms()
        if self._tombstones and not message.payload:
            self._acked_tombstones.append(ExpiredRow(message.seqno, message.key, message.ts_ms, 0))
        self._fold_acked()
        self._save_soon()
        if self._sending:
            self.wake()
        elif not self.inflight:  # the last delivery in flight when the consumer unsubscribed is complete
            self.detach()

    def _fold_acked(self) -> bool:
        """Advance ``acked`` over the contiguous acked head of what was handed out; True if it moved."""
        advanced = False
        while self._handed and self._handed[0] in self.state.above:
            self.state.acked = self._handed.popleft()
            self.state.above.discard(self.state.acked)
            advanced = True
        if not self._handed:
            self._handed = ()
        if advanced:
            self.resends.forget_through(self.state.acked)
        return advanced

    def _save(self) -> None:
        """Save the ack state through the writer pool; while a save is in flight, only mark that another is due.
        Saving each PUBACK would put one store op per delivery on the writer agent; a snapshot supersedes every
        older one, so one save in flight at a time loses nothing."""
        if self.saves_pending:
            self._save_due = True
            return
        self._save_due = False
        snapshot = AckState(self.state.acked, self.state.last_ack_ms, set(self.state.above))
        try:
            future = self._pool.submit(self.queue, SaveAck(self.clientid, snapshot))
        except PoolClosed as exc:
            log.warning("ECQ broker shutting down: ack state of %s up to seqno %d not saved", self.clientid, snapshot.acked)
            self._settle_rewinds(self._rewinds, exc)
            return
        self.saves_pending += 1
        rewinds, tombstones = self._rewinds, self._acked_tombstones
        self._acked_tombstones = []
        future.add_done_callback(lambda done: self._saved(done, rewinds, tombstones))

    def _save_soon(self) -> None:
        """:meth:`_save` once the loop has run what is ready: the PUBACKs read together resume their deliveries
        in this iteration, and one save holds them all (``saving`` is true meanwhile: nothing is sent)."""
        if not self._save_due:
            self._save_due = True
            asyncio.get_running_loop().call_soon(self._save_if_due)

    def _save_if_due(self) -> None:
        if self._save_due and not self.saves_pending:
            self._save()

    def _saved(self, future: asyncio.Future, rewinds: int, tombstones: list[ExpiredRow]) -> None:
        self.saves_pending -= 1
        if not future.cancelled() and future.exception():
            self._acked_tombstones[:0] = tombstones
            log.error("ECQ saving the state of consumer %s failed: %s; delivery to it waits and the save is "
                      "retried in %.1fs", self.clientid, future.exception(), SAVE_RETRY_S)
            self._save_due = True
            asyncio.get_running_loop().call_later(SAVE_RETRY_S, self._save_if_due)
            return
        self._settle_rewinds(rewinds)
        if self.queue != self.clientid:
            if self._reader_saved is not None:
                self._reader_saved(self.queue, tombstones)
        elif tombstones:
            delete_acked(self._pool, self.queue, tombstones)
        if self._save_due:
            self._save()
        else:
            self.wake()  # the acks are stored: delivery may go on

    def _settle_rewinds(self, rewinds: int, error: Exception | None = None) -> None:
        """Resolve the futures of the rewinds up to number ``rewinds`` (their state is committed), or fail them."""
        settled = [future for number, future in self._rewind_waiters if number <= rewinds]
        self._rewind_waiters = [(number, future) for number, future in self._rewind_waiters if number > rewinds]
        for future in (f for f in settled if not f.done()):
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
