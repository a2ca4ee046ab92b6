"""Writes under ``$ECQ/`` and ``$SCQ/`` (an SCQ's ``$SCQ/w/<queue>/<key>``, stored under its queue id by the same
path): a PUBLISH checked (topic grammar, payload size, ACL), stored through the queue engine, then acknowledged.
A rewind (``$ECQ/ctl/<clientid>/rewind`` from the owner) takes the same path: checked, done by the engine, then
acknowledged."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable

from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

from ecq.broker import amqtt_hooks as hooks
from ecq.broker.access import AccessControl
from ecq.broker.observers import QueueEvents
from ecq.config import EcqSettings
from ecq.ops.metrics import EcqMetrics
from ecq.queue.engine import QueueEngine
from ecq.queue.throttle import LogThrottle
from ecq.queue.topics import (BadWrite, is_ctl_topic, is_scq_topic, parse_rewind_point, parse_rewind_target,
                              parse_scq_rewind_target, parse_target, parse_write)
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
        self._in_flight: set[asyncio.Future] = set()  # writes and rewinds taken and not yet stored or failed

    def take(self, handler: BrokerProtocolHandler, topic: str, qos: int, packet_id: int | None,
             payload: bytes, expiry_s: int = 0) -> None:
        """Take a PUBLISH under ``$ECQ/`` as the packet reader reads it (ECQ's framer, or amqtt's reader through
        ``amqtt_hooks.take_ecq_publishes``): check it and start its write or rewind now, before the next packet is
        read, so that every PUBLISH read before a DISCONNECT or the end of the stream is processed, in order
        (MQTT 3.1.1 section 3.14.4), whatever its QoS.

        Its acknowledgement (PUBACK for QoS 1, PUBREC for QoS 2; none for QoS 0) is sent once it is stored, and
        only after every earlier PUBLISH of the connection was acknowledged (section 4.6, see ArrivalOrder). A
        refused PUBLISH is logged with its reason and still acknowledged at its QoS, so the publisher stays
        connected (MQTT 3.1.1 has no negative acknowledgement). A write that cannot be stored within
        ``write_timeout`` is not acknowledged; the publisher's connection is closed so that it sends it again.
        A QoS 2 PUBLISH whose packet id awaits its PUBREL is a retransmit, not a new message (section 4.3.3): it
        gets the first one's PUBREC and is not stored again (``amqtt_hooks.qos2_receipts``). ``expiry_s``: an
        MQTT 5 write's Message Expiry Interval in seconds (0: none), stored with the entry (MQTT 5.0 section
        3.3.2.3.3).
        """
        receipts = hooks.qos2_receipts(handler) if qos == 2 else None
        if receipts is not None and packet_id in receipts:
            self._retransmitted(handler, packet_id, receipts[packet_id])
            return
        write = _Write(handler, topic, qos, packet_id, self._order.enter(handler) if qos else None)
        if receipts is not None:
            write.receipt = receipts[packet_id] = asyncio.get_running_loop().create_future()
        try:
            future = self._start(handler, topic, payload, expiry_s)
        except BadWrite as exc:
            self._refuse(handler, topic, exc)
            write.refusal = (exc.reason, str(exc))
            self._acknowledge(write)
            return
        except PoolClosed:
            log.warning("ECQ write to %r not taken: broker is shutting down", topic)
            self._fail(write)
            return
        except Exception:  # the reader closes the connection; later writes must not wait for this one
            self._fail(write)
            raise
        self._in_flight.add(future)
        future.add_done_callback(self._in_flight.discard)
        future.add_done_callback(functools.partial(self._committed, write))

    @property
    def in_flight(self) -> int:
        """Writes (and rewinds) taken from clients and not yet stored or failed."""
        return len(self._in_flight)

    async def settle(self, timeout: float) -> int:
        """Wait at most ``timeout`` seconds until every write taken so far is stored or failed; returns how many
        are still pending then (each one's publisher gets no PUBACK for it and resends it)."""
        if self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=timeout)
        return len(self._in_flight)

    def hold_acknowledgement(self, handler: BrokerProtocolHandler) -> Callable[[Callable[[], None] | None], None]:
        """A place in the connection's arrival order for a PUBLISH ECQ does not store (a plain QoS 1 or 2 one);
        call what is returned with what sends its PUBACK (once routed) or PUBREC (at once), None when none is due."""
        return functools.partial(self._order.done, handler, self._order.enter(handler))

    def _retransmitted(self, handler: BrokerProtocolHandler, packet_id: int, first: asyncio.Future) -> None:
        """A QoS 2 retransmit: PUBREC in its turn once the first PUBLISH's outcome is known; disconnected if the
        first one failed (the client resends it on its next connection, which stores it)."""
        write = _Write(handler, "", 2, packet_id, self._order.enter(handler))

        def settle(outcome: asyncio.Future) -> None:
            if outcome.result():
                self._acknowledge(write)
            else:
                self._disconnect(write)

        if first.done():
            settle(first)
        else:
            first.add_done_callback(settle)

    def _committed(self, write: _Write, future: asyncio.Future) -> None:
        if self._outcome(write, future):
            self._acknowledge(write)
        else:
            self._disconnect(write)

    def _acknowledge(self, write: _Write) -> None:
        if write.receipt is not None:
            write.receipt.set_result(True)
        if write.slot is not None:
            self._order.done(write.handler, write.slot, functools.partial(
                hooks.acknowledge_soon, write.handler, write.qos, write.packet_id, write.refusal))

    def _fail(self, write: _Write) -> None:
        """The write was not taken: no acknowledgement, and a QoS 2 packet id is free again for its resend."""
        if write.receipt is not None:
            hooks.qos2_receipts(write.handler).pop(write.packet_id, None)
            write.receipt.set_result(False)
        if write.slot is not None:
            self._order.done(write.handler, write.slot, None)

    def _disconnect(self, write: _Write) -> None:
        """Close the connection of a publisher whose write failed; its later writes get no acknowledgement on it."""
        closing = asyncio.ensure_future(hooks.close_connection(write.handler))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        closing.add_done_callback(lambda _closed: self._fail(write))

    def _start(self, handler: BrokerProtocolHandler, topic: str, payload: bytes, expiry_s: int) -> asyncio.Future:
        """Check a PUBLISH under ``$ECQ/`` and start its write or rewind; the future resolves once it is stored.
        Raises BadWrite (refused: the topic, payload size, ACL, rewind payload, ``store_full``) or PoolClosed."""
        if is_ctl_topic(topic):
            return self._rewind(handler, topic, payload)
        write = parse_write(topic, len(payload), self._max_payload_bytes)
        self._check_acl(handler, topic, "write to")
        return self._engine.write(write.clientid, write.key, payload, expiry_s)

    def _outcome(self, write: _Write, future: asyncio.Future) -> bool:
        """For the done future of :meth:`_start`: True when the PUBLISH is to be acknowledged (stored, or refused
        by the queue quota in its commit: ``write.refusal`` set), False when it failed (logged; its publisher is to
        be disconnected)."""
        handler, topic, received = write.handler, write.topic, write.received
        exc = asyncio.CancelledError() if future.cancelled() else future.exception()
        if exc is None:
            if not is_ctl_topic(topic):
                self._metrics.append_latency.observe(time.monotonic() - received)
            return True
        if isinstance(exc, BadWrite):  # the queue quota refused it in its commit (QuotaExceeded)
            self._refuse(handler, topic, exc)
            write.refusal = (exc.reason, str(exc))
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
        """Start the rewind a PUBLISH to ``$ECQ/ctl/<clientid>/rewind`` asks for (or to ``$SCQ/ctl/<queue>/rewind``:
        the publisher's own position in that SCQ); the future resolves once it is stored. Raises BadWrite:
        ``not_owner`` (the publisher is not ``<clientid>``), ``acl_denied``, ``bad_rewind`` (a malformed payload),
        or a topic reason (see parse_rewind_target, parse_scq_rewind_target)."""
        publisher = hooks.client_id(handler) or ""
        clientid = (parse_scq_rewind_target(topic, publisher) if is_scq_topic(topic)
                    else parse_rewind_target(topic, publisher))
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
    """Per connection, its QoS 1/2 PUBLISHes in arrival order (``$ECQ/`` writes and plain QoS 1/2 PUBLISHes), so that
    a PUBACK or PUBREC leaves only after every earlier PUBLISH of that connection was acknowledged, refused or
    failed (MQTT 3.1.1 section 4.6, MQTT-4.6.0-2 and -3), while writes of different connections, and the commits
    of one connection's writes to different writer agents, still run side by side.

    :meth:`enter` is called while the packet reader is on the PUBLISH, so the order of the slots is the arrival
    order. :meth:`done` sends, at once and in order, every acknowledgement at the head of the queue that is
    ready: acknowledgements that come due together leave in one socket write (``send_soon``) and no write waits
    an extra event-loop iteration.
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


class _Write:
    """One PUBLISH under ``$ECQ/`` on its way: where it came from, its place in the arrival order (None at QoS 0),
    for QoS 2 the future its retransmits wait on (see ``amqtt_hooks.qos2_receipts``), and once refused its
    ``BadWrite`` (reason, message), told to an MQTT 5 publisher in its acknowledgement."""

    __slots__ = ("handler", "packet_id", "qos", "receipt", "received", "refusal", "slot", "topic")

    def __init__(self, handler: BrokerProtocolHandler, topic: str, qos: int, packet_id: int | None,
                 slot: _Slot | None) -> None:
        self.handler, self.topic, self.qos, self.packet_id, self.slot = handler, topic, qos, packet_id, slot
        self.received = time.monotonic()
        self.receipt: asyncio.Future | None = None
        self.refusal: tuple[str, str] | None = None
