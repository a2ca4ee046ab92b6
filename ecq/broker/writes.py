"""Writes under ``$ECQ/``: a PUBLISH checked (topic grammar, payload size, ACL), stored through the queue
engine, then acknowledged. A rewind (``$ECQ/ctl/<clientid>/rewind`` from the owner) takes the same path: checked,
done by the engine, then acknowledged."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable

from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.publish import PublishPacket

from ecq.broker import amqtt_hooks as hooks
from ecq.broker.access import AccessControl
from ecq.broker.observers import QueueEvents
from ecq.config import EcqSettings
from ecq.ops.metrics import EcqMetrics
from ecq.queue.engine import QueueEngine
from ecq.queue.throttle import LogThrottle
from ecq.queue.topics import BadWrite, is_ctl_topic, parse_rewind_point, parse_rewind_target, parse_target, parse_write
from ecq.queue.writer import PoolClosed

log = logging.getLogger(__name__)
FAILURE_LOG_INTERVAL_S = 30.0  # while the store fails every write, one line per interval


class EcqWrites:
    """Takes the ``$ECQ/`` PUBLISHes of a broker; ``events()`` is the event stream, None while it is off."""

    def __init__(self, settings: EcqSettings, engine: QueueEngine, access: AccessControl, metrics: EcqMetrics,
                 events: Callable[[], QueueEvents | None]) -> None:
        self._max_payload_bytes = settings.max_payload_bytes
        self._engine, self._access, self._metrics, self._events = engine, access, metrics, events
        self._failure_log = LogThrottle(FAILURE_LOG_INTERVAL_S)
        # a full queue or store refuses every write until it drains: one line per interval, not one per write
        self._full_log = {reason: LogThrottle(FAILURE_LOG_INTERVAL_S) for reason in ("quota_exceeded", "store_full")}
        self._order = ArrivalOrder()
        self._closing: set[asyncio.Task] = set()  # publishers being disconnected after a failed fast-path write

    async def publish(self, handler: BrokerProtocolHandler, packet: PublishPacket) -> None:
        """Take a PUBLISH under ``$ECQ/`` that amqtt decoded (in a task of its own): store a valid write, then
        acknowledge it; refuse the rest.

        A refused PUBLISH is logged with its reason and still acknowledged at its QoS, so the publisher
        stays connected (MQTT 3.1.1 has no negative PUBACK). A write that cannot be stored within
        ``write_timeout`` is not acknowledged; the publisher's connection is closed so it sends it again.
        Acknowledgements leave in the order the PUBLISHes arrived (MQTT 3.1.1 section 4.6), see ArrivalOrder.
        """
        topic, payload, qos, packet_id = packet.topic_name, bytes(packet.data), packet.qos, packet.packet_id
        if qos == 0:
            await self._store(handler, topic, payload, qos, packet_id)
            return
        slot, acknowledge = self._order.enter(handler), None
        try:
            acknowledge = await self._store(handler, topic, payload, qos, packet_id)
        finally:
            self._order.done(handler, slot, acknowledge)

    def take_qos1(self, handler: BrokerProtocolHandler, topic: str, packet_id: int, payload: bytes) -> None:
        """Take a QoS 1 PUBLISH under ``$ECQ/`` straight from the packet reader (``amqtt_hooks.framer``): the same
        checks and outcomes as :meth:`publish`, without a task: the PUBACK is sent from the commit's callback,
        in arrival order (the slot is taken here, while the reader is on this packet)."""
        slot, received = self._order.enter(handler), time.monotonic()
        try:
            future = self._start(handler, topic, payload)
        except BadWrite as exc:
            self._refuse(handler, topic, exc)
            self._order.done(handler, slot, functools.partial(hooks.acknowledge_soon, handler, 1, packet_id))
            return
        except PoolClosed:
            log.warning("ECQ write to %r not taken: broker is shutting down", topic)
            self._order.done(handler, slot, None)
            return
        except Exception:  # the reader closes the connection; later writes must not wait for this slot
            self._order.done(handler, slot, None)
            raise
        future.add_done_callback(functools.partial(self._committed, handler, slot, topic, packet_id, received))

    def _committed(self, handler: BrokerProtocolHandler, slot: _Slot, topic: str, packet_id: int, received: float,
                   future: asyncio.Future) -> None:
        if self._outcome(handler, topic, received, future):
            self._order.done(handler, slot, functools.partial(hooks.acknowledge_soon, handler, 1, packet_id))
            return
        closing = asyncio.ensure_future(self._disconnect_publisher(handler, slot))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def _disconnect_publisher(self, handler: BrokerProtocolHandler, slot: _Slot) -> None:
        """Close the connection of a publisher whose write failed; its later writes get no PUBACK on it."""
        try:
            await hooks.close_connection(handler)
        finally:
            self._order.done(handler, slot, None)

    async def _store(self, handler: BrokerProtocolHandler, topic: str, payload: bytes, qos: int,
                     packet_id: int | None) -> Callable[[], None] | None:
        """Store or refuse one PUBLISH; returns what sends its acknowledgement (None: none is due, the write
        failed and the publisher's connection is closed)."""
        received = time.monotonic()
        try:
            future = self._start(handler, topic, payload)
        except BadWrite as exc:
            self._refuse(handler, topic, exc)
            return lambda: hooks.acknowledge_soon(handler, qos, packet_id)
        except PoolClosed:
            log.warning("ECQ write to %r not taken: broker is shutting down", topic)
            return None
        try:
            await future
        except Exception:  # judged by _outcome
            pass
        if self._outcome(handler, topic, received, future):
            return lambda: hooks.acknowledge_soon(handler, qos, packet_id)
        await hooks.close_connection(handler)
        return None

    def _start(self, handler: BrokerProtocolHandler, topic: str, payload: bytes) -> asyncio.Future:
        """Check a PUBLISH under ``$ECQ/`` and start its write or rewind; the future resolves once it is stored.
        Raises BadWrite (refused: the topic, payload size, ACL, rewind payload, ``store_full``) or PoolClosed."""
        if is_ctl_topic(topic):
            return self._rewind(handler, topic, payload)
        write = parse_write(topic, len(payload), self._max_payload_bytes)
        self._check_acl(handler, topic, "write to")
        return self._engine.write(write.clientid, write.key, payload)

    def _outcome(self, handler: BrokerProtocolHandler, topic: str, received: float, future: asyncio.Future) -> bool:
        """For the done future of :meth:`_start`: True when the PUBLISH is to be acknowledged (stored, or refused
        by the queue quota in its commit), False when it failed (logged; its publisher is to be disconnected)."""
        exc = asyncio.CancelledError() if future.cancelled() else future.exception()
        if exc is None:
            if not is_ctl_topic(topic):
                self._metrics.append_latency.observe(time.monotonic() - received)
            return True
        if isinstance(exc, BadWrite):  # the queue quota refused it in its commit (QuotaExceeded)
            self._refuse(handler, topic, exc)
            return True
        if (held_back := self._failure_log.due()) is not None:
            log.error("ECQ write to %r failed (%s); closing publisher %s so it resends (%d more failed "
                      "writes since the last such line)", topic, exc or type(exc).__name__,
                      hooks.client_id(handler), held_back)
        return False

    def _check_acl(self, handler: BrokerProtocolHandler, topic: str, what: str) -> None:
        if not self._access.allows(handler.session, "publish", topic):
            raise BadWrite("acl_denied", f"refused {what} {topic!r}: denied by the ACL")

    def _rewind(self, handler: BrokerProtocolHandler, topic: str, payload: bytes) -> asyncio.Future:
        """Start the rewind a PUBLISH to ``$ECQ/ctl/<clientid>/rewind`` asks for; the future resolves once it is
        stored. Raises BadWrite: ``not_owner`` (the publisher is not ``<clientid>``), ``acl_denied``,
        ``bad_rewind`` (a malformed payload), or a topic reason (see parse_rewind_target)."""
        clientid = parse_rewind_target(topic, hooks.client_id(handler) or "")
        self._check_acl(handler, topic, "rewind")
        point = parse_rewind_point(payload)
        return asyncio.ensure_future(self._engine.rewind(clientid, point))

    def _refuse(self, handler: BrokerProtocolHandler, topic: str, exc: BadWrite) -> None:
        self._metrics.writes_refused.labels(exc.reason).inc()
        throttle = self._full_log.get(exc.reason)
        if throttle is None:
            log.warning("ECQ %s (publisher %s, reason %s)", exc, hooks.client_id(handler), exc.reason)
        elif (held_back := throttle.due()) is not None:
            log.warning("ECQ %s (publisher %s, reason %s; %d more such refusals since the last such line)", exc,
                        hooks.client_id(handler), exc.reason, held_back)
        if events := self._events():
            events.refused(parse_target(topic), exc.reason, topic)


class ArrivalOrder:
    """Per connection, its QoS 1/2 writes in arrival order, so that a PUBACK (or PUBREC) leaves only after every
    earlier write of that connection was acknowledged, refused or failed (MQTT 3.1.1 section 4.6), while writes
    of different connections, and the commits of one connection's writes to different writer agents, still run
    side by side.

    amqtt starts one task per PUBLISH in the order the packets were read; :meth:`enter` is called before that
    task's first await, so the order of the slots is the arrival order. :meth:`done` sends, at once and in
    order, every acknowledgement at the head of the queue that is ready: acknowledgements that come due together
    leave in one socket write (``send_soon``) and no write waits an extra event-loop iteration.
    """

    def __init__(self) -> None:
        self._slots: weakref.WeakKeyDictionary[BrokerProtocolHandler, deque[_Slot]] = weakref.WeakKeyDictionary()

    def enter(self, handler: BrokerProtocolHandler) -> _Slot:
        """A place in the connection's queue for a write that has just arrived."""
        slot = _Slot()
        self._slots.setdefault(handler, deque()).append(slot)
        return slot

    def done(self, handler: BrokerProtocolHandler, slot: _Slot, acknowledge: Callable[[], None] | None) -> None:
        """The write of ``slot`` is stored or refused (``acknowledge`` sends its acknowledgement) or failed
        (None); send every acknowledgement now due, oldest first."""
        slot.acknowledge, slot.ready = acknowledge, True
        queue = self._slots.get(handler)
        while queue and queue[0].ready:
            head = queue.popleft()
            if head.acknowledge is not None:
                head.acknowledge()
        if queue is not None and not queue:
            del self._slots[handler]


class _Slot:
    __slots__ = ("acknowledge", "ready")

    def __init__(self) -> None:
        self.acknowledge: Callable[[], None] | None = None
        self.ready = False
