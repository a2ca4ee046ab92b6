"""Nothing unbounded in flow: what one connection may hold in a broker that runs the ECQ plugin, outgoing and
incoming, corrected from amqtt 0.12.1.

- Outgoing (:func:`send_or_drop`, called by ``conformance``'s fan-out): amqtt starts one ``mqtt_publish`` task per
  message and subscriber, each waiting for the connection's write lock and drain, so a subscriber that never reads
  held every message sent to it (150,000 x 2 KB QoS 0 messages added 819 MB). A connection's sends not yet done
  (written, and for QoS 1/2 acknowledged) are counted, with the bytes of its transport's write buffer; a message to a
  connection at ``max_queued_messages`` or ``max_queued_bytes`` is dropped and counted, whatever its QoS (Mosquitto's
  ``max_queued_messages``/``max_queued_bytes``, EMQX's ``max_mqueue_len``), and a connection that stays at the bound
  for ``stuck_subscriber_timeout`` is closed (v5: DISCONNECT 0x97 Quota exceeded first), its socket aborted.
- Shutdown: amqtt's broadcast loop cancelled every send task still waiting at shutdown, waited for them up to 5 s,
  and logged a traceback for each (74,000 on one SIGTERM with a stuck subscriber). The sends above are ECQ's
  tasks, not the broadcast loop's: they end with their connection, quietly (:func:`_send`).
- Incoming (:class:`Inbound`): amqtt and ECQ's framer read a connection as fast as it sends, whatever is still to be
  routed: 150,000 unpaced 2 KB QoS 0 PUBLISHes grew the broker by 390 MB. The PUBLISHes of ordinary topics read from
  a connection are counted until their fan-out is done; above ``inbound_max_messages`` or ``inbound_max_bytes`` the
  connection is not read until half of them are routed (the socket then fills, and TCP slows the sender); a PINGREQ
  is answered once the PUBLISHes read before it are routed (:func:`answer_pings_after_routing`).
- Log floods: a failed send and amqtt's acknowledgement timeouts are logged at most once per 10 s, with a count
  (:func:`limit_ack_timeout_log`).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import socket
import struct
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from amqtt.adapters import StreamWriterAdapter
from amqtt.broker import BrokerContext
from amqtt.errors import AMQTTError, ProtocolHandlerError
from amqtt.mqtt.constants import QOS_0, QOS_1
from amqtt.mqtt.packet import MQTTFixedHeader
from amqtt.mqtt.pingreq import PingReqPacket
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.publish import PublishPacket

from ecq.broker.amqtt_hooks import stored_sends
from ecq.broker.amqtt_hooks.ecq_paths import client_id
from ecq.broker.amqtt_hooks.mqtt5_sessions import tell
from ecq.broker.amqtt_hooks.seam import kept_on, replace, step
from ecq.broker.amqtt_hooks.target import EcqHooksTarget, find_target
from ecq.queue.throttle import LogThrottle
from ecq.queue.topics import is_ecq_topic

log = logging.getLogger(__name__)

QUOTA_EXCEEDED = 0x97  # MQTT 5.0 section 3.14.2.1
_ROUTING_KEY = "_ecq_routing"  # a broadcast's entry: the _Routing of the PUBLISH it came from
LOG_INTERVAL_S = 10.0  # at most one line per this for a failed send, and one for acknowledgement timeouts
_ACK_TIMEOUT = "Timeout waiting for PUB"  # amqtt's warning per outgoing QoS 1/2 message not acknowledged in 5 s
_send_failures = LogThrottle(LOG_INTERVAL_S)
_ROUTING: contextvars.ContextVar[_Routing | None] = contextvars.ContextVar("ecq_routing", default=None)


class Outbound:
    """What ECQ's fan-out has handed to one connection and is not done: send tasks and their bytes (topic and
    payload); ``full_since``: when a send first found the connection at its bound (time.monotonic), None below it;
    ``closed``: the connection was closed as stuck (nothing more is sent to it)."""

    def __init__(self) -> None:
        self.sends: dict[asyncio.Task, int] = {}
        self.bytes = 0
        self.full_since: float | None = None
        self.closed = False

    def add(self, task: asyncio.Task, size: int) -> None:
        self.sends[task] = size
        self.bytes += size

    def done(self, task: asyncio.Task) -> None:
        """Forget the send ``task``: called by the task itself as it ends (a done callback would cost the event loop
        one more callback per message)."""
        self.bytes -= self.sends.pop(task, 0)

    def cancel(self) -> None:
        """Cancel every send not done (each ends quietly, see :func:`_send`)."""
        for task in list(self.sends):
            task.cancel()


def _outbound(handler: BrokerProtocolHandler) -> Outbound:
    return kept_on(handler, "_ecq_outbound", Outbound)


def _transport(handler: BrokerProtocolHandler) -> asyncio.Transport | None:
    """The transport under ``handler``'s writer: TCP/TLS (amqtt's StreamWriterAdapter) or WebSocket."""
    writer = handler.writer
    if isinstance(writer, StreamWriterAdapter):
        return writer._writer.transport
    protocol = getattr(writer, "_protocol", None)
    return getattr(protocol, "transport", None)


def send_or_drop(handler: BrokerProtocolHandler, plugin: EcqHooksTarget, topic: str, data: Any, qos: int,
                 stored: Any = None) -> None:
    """Send ``data`` on ``topic`` at ``qos`` to ``handler``'s connection (amqtt's ``mqtt_publish`` in a task of
    ECQ's), unless the connection holds ``max_queued_messages`` sends not done, or ``max_queued_bytes`` with its
    write buffer: then the message is dropped and counted (``ecq_messages_dropped_total{reason="queue_full"}``), and a
    connection at its bound for ``stuck_subscriber_timeout`` seconds is closed (:func:`_close_stuck`). ``stored``:
    the key of the message's copy in the session store (``stored_sends``), deleted when it is dropped."""
    settings, outbound = plugin.settings, _outbound(handler)
    if outbound.closed:
        stored_sends.settle(handler, [stored])
        return
    transport = _transport(handler)
    buffered = transport.get_write_buffer_size() if transport is not None else 0
    if len(outbound.sends) < settings.max_queued_messages and outbound.bytes + buffered < settings.max_queued_bytes:
        outbound.full_since = None
        size = len(topic) + len(data or b"")
        outbound.add(asyncio.ensure_future(_send(handler, outbound, topic, data, qos, stored)), size)
        return
    stored_sends.settle(handler, [stored])
    plugin.outgoing_message_dropped(client_id(handler), topic)
    now = time.monotonic()
    if outbound.full_since is None:
        outbound.full_since = now
    elif now - outbound.full_since >= settings.stuck_subscriber_timeout:
        plugin.stuck_subscriber_closed(client_id(handler), len(outbound.sends), outbound.bytes + buffered)
        _close_stuck(handler, transport)


async def _send(handler: BrokerProtocolHandler, outbound: Outbound, topic: str, data: Any, qos: int,
                stored: Any) -> None:
    """amqtt's ``mqtt_publish`` of one fan-out message (its stored copy ``stored``, see ``stored_sends``); a send the
    connection's end cut short, or whose acknowledgement timed out (amqtt's own warning,
    :func:`limit_ack_timeout_log`), ends quietly (amqtt's broadcast loop logged each with a traceback); any other
    failure is logged at most once per :data:`LOG_INTERVAL_S`."""
    if stored is not None:
        stored_sends.sending(stored)
    try:
        await handler.mqtt_publish(topic, data, qos, False)
    except (AMQTTError, ProtocolHandlerError, ConnectionError, TimeoutError) as exc:
        log.debug("a send to %s on %r ended: %r", client_id(handler), topic, exc)
    except Exception as exc:
        if (held_back := _send_failures.due()) is not None:
            log.warning("ECQ could not send %r to %s (%d more such failures since the last report, reported at "
                        "most every %g s)", topic, client_id(handler), held_back, LOG_INTERVAL_S, exc_info=exc)
    finally:
        outbound.done(asyncio.current_task())
        if stored is not None:
            stored_sends.sent(handler, stored)


def _close_stuck(handler: BrokerProtocolHandler, transport: asyncio.Transport | None) -> None:
    """Close a connection that stopped reading: DISCONNECT 0x97 on v5 (MQTT 5.0 section 3.14.2.1; a client that
    reads nothing will not see it), its sends cancelled and its socket aborted (a close would wait for the client
    to read what is buffered) with a reset, which frees the kernel's send buffer too. Its reader then ends the
    connection as after a network failure (the Will is sent)."""
    tell(handler, QUOTA_EXCEEDED)
    outbound = _outbound(handler)
    outbound.closed = True
    outbound.cancel()
    if transport is None:
        return
    if isinstance(handler.writer, StreamWriterAdapter):
        handler.writer.is_closed = True
    if (raw := transport.get_extra_info("socket")) is not None:  # a reset: the kernel's unsent bytes go too
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


@dataclass
class _Routing:
    """One PUBLISH of an ordinary topic read from a connection, on its way to the fan-out: its ``inbound``, its
    number there, and whether a broadcast carries it (then the fan-out ends its routing)."""

    inbound: Inbound
    seq: int
    queued: bool = False


class Inbound:
    """The PUBLISHes of ordinary topics read from one connection and not yet routed (their fan-out done, or dropped
    before it): seq -> bytes (payload and topic), in the order read. ``max_messages`` and ``max_bytes`` bound what
    the connection's reader reads ahead (:meth:`room`)."""

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        self.max_messages, self.max_bytes = max_messages, max_bytes
        self._unrouted: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._bytes = 0
        self.last_read = 0
        self._room: asyncio.Future | None = None  # the reader, waiting below half of the bounds
        self._routed: list[tuple[int, asyncio.Future]] = []  # (seq, PINGREQ waiting for it to be routed)

    def read(self, size: int) -> int:
        """Count a PUBLISH of ``size`` bytes just read; returns its seq."""
        self.last_read += 1
        self._unrouted[self.last_read] = size
        self._bytes += size
        return self.last_read

    def routed(self, seq: int) -> None:
        """The PUBLISH ``seq`` was routed: wake the reader below half of the bounds, and the PINGREQs waiting."""
        self._bytes -= self._unrouted.pop(seq, 0)
        if (self._room is not None and len(self._unrouted) <= self.max_messages // 2
                and self._bytes <= self.max_bytes // 2):
            _resolve(self._room)
        oldest = next(iter(self._unrouted), self.last_read + 1)
        while self._routed and self._routed[0][0] < oldest:
            _resolve(self._routed.pop(0)[1])

    async def room(self) -> None:
        """Return once the reader may read on: at once within the bounds, else when half of them are routed."""
        if len(self._unrouted) <= self.max_messages and self._bytes <= self.max_bytes:
            return
        self._room = asyncio.get_running_loop().create_future()
        try:
            await self._room
        finally:
            self._room = None

    async def routed_up_to(self, seq: int) -> None:
        """Return once every PUBLISH counted up to ``seq`` was routed."""
        if next(iter(self._unrouted), seq + 1) > seq:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._routed.append((seq, waiter))
        await waiter

    def all_routed(self) -> bool:
        """True when every PUBLISH counted so far was routed."""
        return not self._unrouted

    def when_routed(self, seq: int, then: Callable[[], None]) -> None:
        """Call ``then()`` once every PUBLISH counted up to ``seq`` was routed (at once if they are), in the order
        of ``seq``: call it as the PUBLISH ``seq`` is read."""
        if next(iter(self._unrouted), seq + 1) > seq:
            then()
            return
        waiter = asyncio.get_running_loop().create_future()
        waiter.add_done_callback(lambda _done: then())
        self._routed.append((seq, waiter))


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def all_routed(reader: Any) -> bool:
    """True when every PUBLISH of an ordinary topic read on the connection of amqtt reader adapter ``reader`` was
    routed (or none was counted): a PINGREQ read now may be answered at once (:func:`answer_pings_after_routing`)."""
    inbound = _inbound(reader)
    return inbound is None or inbound.all_routed()


def _inbound(reader: Any, plugin: EcqHooksTarget | None = None) -> Inbound | None:
    """The Inbound of the connection read by amqtt reader adapter ``reader``; made when ``plugin`` is given."""
    inbound = getattr(reader, "_ecq_inbound", None)
    if inbound is None and plugin is not None:
        inbound = reader._ecq_inbound = Inbound(plugin.settings.inbound_max_messages, plugin.settings.inbound_max_bytes)
    return inbound


def count_publishes_read() -> None:
    """Count each PUBLISH of an ordinary topic as amqtt's ``BrokerProtocolHandler.handle_publish`` is called for it
    (every reader calls it as it reads the packet), if amqtt will route it: QoS 0 (not DUP, which amqtt drops,
    MQTT-3.3.1-2) and QoS 1. A QoS 2 message is routed at its PUBREL, which the reader must be free to read.
    A plain function, as the method's body it runs before (``ecq_paths.take_ecq_publishes``): it counts the PUBLISH
    as the reader reads it."""

    def count_the_publish(handler: BrokerProtocolHandler, packet: PublishPacket) -> None:
        plugin = find_target(handler.plugins_manager)
        topic, data = packet.topic_name, packet.data
        if (plugin is not None and topic is not None and data is not None and not is_ecq_topic(topic)
                and (packet.qos == QOS_1 or (packet.qos == QOS_0 and not packet.dup_flag))):
            inbound = _inbound(handler.reader, plugin)
            packet._ecq_routing = _Routing(inbound, inbound.read(len(topic) + len(data)))

    step(BrokerProtocolHandler, "handle_publish", before=count_the_publish)


async def room_to_read(reader: Any) -> None:
    """Wait until the connection read by ``reader`` may be read on (``Inbound.room``); ECQ's framer calls it."""
    if (inbound := _inbound(reader)) is not None:
        await inbound.room()


def routing_of(message: Any) -> _Routing | None:
    """The routing of an amqtt ``IncomingApplicationMessage`` counted by :func:`count_publishes_read`, or None."""
    return getattr(message.publish_packet, "_ecq_routing", None) if message is not None else None


def delivering(routing: _Routing | None) -> None:
    """Mark the PUBLISH that ``Broker._handle_message_delivery`` handles (in this task) until :func:`delivered`."""
    _ROUTING.set(routing)


def delivered() -> None:
    """``Broker._handle_message_delivery`` is done: a PUBLISH it did not broadcast (refused, dropped) is routed."""
    routing = _ROUTING.get()
    _ROUTING.set(None)
    if routing is not None and not routing.queued:
        routing.inbound.routed(routing.seq)


def fanned_out(broadcast: dict[str, Any]) -> None:
    """The fan-out of ``broadcast`` is done: the PUBLISH it came from is routed."""
    if (routing := broadcast.get(_ROUTING_KEY)) is not None:
        routing.inbound.routed(routing.seq)


class _RoutedQueue(asyncio.Queue):
    """amqtt's broadcast queue, whose broadcasts carry the :class:`_Routing` of the PUBLISH being delivered."""

    def put_nowait(self, item: Any) -> None:
        routing = _ROUTING.get()
        if routing is not None and not routing.queued and isinstance(item, dict):
            item[_ROUTING_KEY], routing.queued = routing, True
        super().put_nowait(item)


def count_routed_publishes(context: BrokerContext) -> None:
    """Give the broker (before it starts) a broadcast queue whose broadcasts say which PUBLISH they came from."""
    broker = context._broker_instance
    broker._broadcast_queue = _RoutedQueue()


def pace_amqtt_readers() -> None:
    """amqtt 0.12.1's ``ProtocolHandler._reader_loop`` (``fast_path: false``, WebSocket 3.1.1) reads each packet's
    fixed header with ``MQTTFixedHeader.from_stream``: before it, the reader waits for room (``Inbound.room``)."""

    async def wait_for_room(cls: type[MQTTFixedHeader], reader: Any) -> None:
        await room_to_read(reader)

    step(MQTTFixedHeader, "from_stream", before=wait_for_room)


def answer_pings_after_routing() -> None:
    """amqtt 0.12.1's ``BrokerProtocolHandler.handle_pingreq`` answers at once, ahead of the PUBLISHes read before
    the PINGREQ and not yet routed: a client took the PINGRESP as a sign they were. It now answers once they are.
    Not a coroutine function: the PUBLISHes to wait for are those counted when the PINGREQ is read."""
    original = BrokerProtocolHandler.handle_pingreq

    def handle_pingreq(handler: BrokerProtocolHandler, ping: PingReqPacket) -> Coroutine[Any, Any, None]:
        inbound = _inbound(handler.reader) if find_target(handler.plugins_manager) is not None else None
        if inbound is None:
            return original(handler, ping)
        return _pong_after(handler, ping, original, inbound, inbound.last_read)

    replace(BrokerProtocolHandler, "handle_pingreq", handle_pingreq)


async def _pong_after(handler: BrokerProtocolHandler, ping: PingReqPacket, original: Any, inbound: Inbound,
                      seq: int) -> None:
    await inbound.routed_up_to(seq)
    await original(handler, ping)


class _AckTimeoutLogLimit(logging.Filter):
    """Lets one of amqtt's "Timeout waiting for PUBACK/PUBREC/PUBCOMP" records through per :data:`LOG_INTERVAL_S`,
    with the count of those held back; other records pass unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self._throttle = LogThrottle(LOG_INTERVAL_S)

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or not record.msg.startswith(_ACK_TIMEOUT):
            return True
        if (held_back := self._throttle.due()) is None:
            return False
        record.msg = (f"{record.msg} ({held_back} more acknowledgement timeouts since the last report, reported at "
                      f"most every {LOG_INTERVAL_S:g} s)")
        return True


def limit_ack_timeout_log() -> None:
    """amqtt 0.12.1's ``ProtocolHandler._handle_qos1_message_flow`` (and QoS 2's) logs a WARNING for each outgoing
    message not acknowledged within 5 s: a QoS 1 subscriber that stopped reading wrote one per message (with a
    traceback from the broadcast loop each, 105 MB for ~100,000 messages). Now one line per
    :data:`LOG_INTERVAL_S` says how many there were."""
    logging.getLogger("amqtt.mqtt.protocol.handler").addFilter(_AckTimeoutLogLimit())
