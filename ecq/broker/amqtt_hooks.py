"""Every place where ECQ owns amqtt 0.12.1's behaviour, and every use of its internals (one module on purpose).

:func:`install` wraps amqtt's methods once per process, one line per correction. Each wrapper finds the
ECQ plugin in the broker's or handler's own PluginManager, so several brokers in one process work
independently and a broker without the ECQ plugin behaves exactly as stock amqtt. Each correction's
docstring names the amqtt behaviour it replaces. The sections, in file order:

1. ECQ's own paths. Plugin events cannot do what SPEC.md section 1 asks, because in stock amqtt:
   ``ProtocolHandler.handle_publish`` PUBACKs a QoS 1 PUBLISH before anything is stored, so a PUBLISH
   under ``$ECQ/`` goes to :meth:`EcqPlugin.handle_ecq_publish`, which stores, then acknowledges (MQTT
   3.1.1 section 4.3.2); ``topic_filtering`` plugins do not see a SUBSCRIBE's QoS, so
   ``Broker.add_subscription`` asks the plugin to grant QoS 1 or refuse (0x80, section 3.9.3);
   ``PublishVariableHeader`` refuses ``+``/``#`` mid-decode and desynchronises the stream, so for
   ``$ECQ/`` topics ECQ refuses such a write itself and keeps the publisher connected. ECQ's own packets
   (write PUBACKs, deliveries) leave through :func:`send_soon`, one socket write per connection and
   event-loop iteration (issue 5: one ``send`` per packet was 14 % of the loop); amqtt's
   ``PACKET_SENT`` event is not fired for them.
2. An acknowledged message stays acknowledged (issue 10, points 4 and 9): a PUBACK counts the moment it
   is decoded, also when the client resets the connection right after it; a persistent-session takeover
   closes only the old connection.
3. Bad clients (issue 10, points 6, 7, 8, 10): sockets closed on every path, CONNECT timeout, packet size
   and protocol checks before a body is read, ``$``-topics no longer end a client's loop, a bounded log of
   accept failures.
4. Nothing reaches ``$ECQ/<clientid>/...`` but ECQ's delivery (issue 10, point 1): Wills, broadcasts,
   retained messages.
5. MQTT 3.1.1 for ordinary topics (issue 15): persistent sessions, retained messages, QoS of a fan-out,
   resend on reconnect, keepalive, with per-session bounds.
6. Start-up failures are reported, not hidden (issue 10, point 11).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import os
import socket
import struct
import time
import weakref
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from amqtt.adapters import StreamWriterAdapter
from amqtt.broker import Broker, BrokerContext
from amqtt.codecs_amqtt import decode_packet_id, read_or_raise
from amqtt.contexts import Action
from amqtt.errors import AMQTTError, MQTTError, NoDataError
from amqtt.events import BrokerEvents, MQTTEvents
from amqtt.mqtt.connack import NOT_AUTHORIZED, ConnackPacket
from amqtt.mqtt.constants import QOS_0, QOS_1
from amqtt.mqtt.packet import PUBLISH, MQTTFixedHeader, MQTTVariableHeader
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.puback import PubackPacket
from amqtt.mqtt.pubcomp import PubcompPacket
from amqtt.mqtt.publish import PublishPacket, PublishVariableHeader
from amqtt.mqtt.pubrec import PubrecPacket
from amqtt.mqtt.subscribe import SubscribePayload
from amqtt.plugins.manager import PluginManager
from amqtt.session import OUTGOING, OutgoingApplicationMessage, Session

from ecq.queue.topics import is_ecq_topic

if TYPE_CHECKING:
    from ecq.broker.plugin import EcqPlugin

log = logging.getLogger(__name__)

SUBACK_FAILURE = 0x80
_QOS2_PUBREL_TIMEOUT_S = 10.0
_plugin_class: type | None = None
_unsent: dict[BrokerProtocolHandler, list[bytes]] = {}  # packets queued by send_soon, per connection


def install(plugin_class: type) -> None:
    """Wrap the amqtt methods once per process; ``plugin_class`` is the class to dispatch to."""
    global _plugin_class
    if _plugin_class is not None:
        return
    _plugin_class = plugin_class
    original_publish = BrokerProtocolHandler.handle_publish
    original_subscribe = Broker.add_subscription
    original_header_init = PublishVariableHeader.__init__

    async def handle_publish(handler: BrokerProtocolHandler, packet: PublishPacket) -> None:
        plugin = _find_plugin(handler.plugins_manager)
        if plugin is None or packet.topic_name is None or not is_ecq_topic(packet.topic_name):
            return await original_publish(handler, packet)
        return await plugin.handle_ecq_publish(handler, packet)

    async def add_subscription(broker: Broker, subscription: tuple[str, int], session: Any) -> int:
        plugin = _find_plugin(broker.plugins_manager)
        topic_filter, qos = subscription
        if plugin is not None and is_ecq_topic(topic_filter):
            granted = plugin.grant_subscription(session.client_id, topic_filter, qos)
            if granted is None:
                return SUBACK_FAILURE
            subscription = (topic_filter, granted)
        return await original_subscribe(broker, subscription, session)

    def header_init(header: PublishVariableHeader, topic_name: str, packet_id: int | None = None) -> None:
        if not is_ecq_topic(topic_name):
            return original_header_init(header, topic_name, packet_id)
        MQTTVariableHeader.__init__(header)
        header.topic_name, header.packet_id = topic_name, packet_id

    BrokerProtocolHandler.handle_publish = handle_publish
    Broker.add_subscription = add_subscription
    PublishVariableHeader.__init__ = header_init
    BrokerProtocolHandler.handle_puback = handle_puback_at_once
    _read_to_the_end_after_a_reset()
    _keep_the_new_connection_on_persistent_takeover()
    _close_abandoned_connections()
    _time_limit_connect()
    _check_fixed_headers()
    _check_publish_headers()
    _check_subscribe_payloads()
    _keep_serving_after_reserved_topics()
    _limit_accept_error_log()
    _refuse_forbidden_wills()
    _keep_ecq_out_of_broadcasts()
    _keep_ecq_out_of_retained_store()
    _keep_persistent_sessions()
    _retained_only_for_new_subscriptions()
    _offline_messages_not_retained()
    _conformant_fan_out()
    _resend_unacked_on_reconnect()
    _enforce_keepalive()
    raise_pre_start_failure()
    quiet_start_failure_traceback()


def _find_plugin(plugins_manager: Any) -> EcqPlugin | None:
    for plugin in plugins_manager.plugins:
        if isinstance(plugin, _plugin_class):
            return plugin
    return None


def client_id(handler: BrokerProtocolHandler) -> str | None:
    """The clientid of the connection served by ``handler``."""
    return handler.session.client_id if handler.session else None


def live_connection(context: BrokerContext, clientid: str) -> BrokerProtocolHandler | None:
    """The handler of the newest connection of ``clientid`` (amqtt keeps it in ``Broker.sessions``)."""
    return context._broker_instance.sessions.get(clientid, (None, None))[1]


def connection_is_open(handler: BrokerProtocolHandler | None) -> bool:
    """True until the handler's reader loop has stopped (disconnect, takeover, broker shutdown)."""
    return handler is not None and handler.writer is not None and not handler._reader_stopped.is_set()


async def close_connection(handler: BrokerProtocolHandler) -> None:
    """Close a client connection the way amqtt closes the old one on a session takeover."""
    await handler.handle_connection_closed()
    await handler.stop()


async def acknowledge(handler: BrokerProtocolHandler, qos: int, packet_id: int | None) -> None:
    """Finish an incoming PUBLISH's QoS flow: PUBACK for QoS 1; PUBREC, wait PUBREL, PUBCOMP for QoS 2.

    Raises TimeoutError when a QoS 2 PUBREL does not come within 10 s.
    """
    if qos == QOS_1:
        send_soon(handler, PubackPacket.build(packet_id).to_bytes())
    elif qos == 2:
        pubrel = asyncio.get_running_loop().create_future()
        handler._pubrel_waiters[packet_id] = pubrel
        try:
            await handler._send_packet(PubrecPacket.build(packet_id))
            await asyncio.wait_for(pubrel, _QOS2_PUBREL_TIMEOUT_S)
        finally:
            handler._pubrel_waiters.pop(packet_id, None)
        await handler._send_packet(PubcompPacket.build(packet_id))


async def publish_qos1(handler: BrokerProtocolHandler, topic: str, payload: bytes) -> None:
    """Send a QoS 1 PUBLISH on ``handler`` and wait for its PUBACK for as long as the connection lives.

    amqtt's own ``mqtt_publish`` gives up after a fixed 5 s and forgets the packet id, so under load a
    late PUBACK was lost and the resend added more load. MQTT 3.1.1 section 4.4 resends unacknowledged
    PUBLISHes only when the client reconnects, which is what ECQ's redelivery does.
    Raises ConnectionError when the connection is closed or closes before the PUBACK.
    """
    if not connection_is_open(handler):
        raise ConnectionError("connection closed")
    session = handler.session
    packet_id = session.next_packet_id
    message = OutgoingApplicationMessage(packet_id, topic, QOS_1, payload, False)
    puback = asyncio.get_running_loop().create_future()
    session.inflight_out[packet_id] = message  # keeps the packet id taken until the PUBACK
    handler._puback_waiters[packet_id] = puback  # amqtt's handle_puback resolves it; stop() cancels it
    try:
        send_soon(handler, message.build_publish_packet().to_bytes())
        await puback
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise
        raise ConnectionError("connection closed while waiting for PUBACK") from None
    finally:
        handler._puback_waiters.pop(packet_id, None)
        session.inflight_out.pop(packet_id, None)


def send_soon(handler: BrokerProtocolHandler, packet: bytes) -> None:
    """Queue one encoded MQTT packet for ``handler``'s connection; it is written, together with every other
    packet queued for that connection in the same event-loop iteration, at the end of the iteration.

    Packets keep their order. A connection that closed meanwhile drops them (a delivery not acked is sent
    again on reconnect; a write not acked is resent by the publisher, MQTT 3.1.1 section 4.4).
    """
    queued = _unsent.get(handler)
    if queued is None:
        _unsent[handler] = [packet]
        asyncio.get_running_loop().call_soon(_write_queued, handler)
    else:
        queued.append(packet)


def _write_queued(handler: BrokerProtocolHandler) -> None:
    packets = _unsent.pop(handler)
    if handler.writer is not None:
        handler.writer.write(b"".join(packets))


def set_listen_backlog(context: BrokerContext, backlog: int) -> int:
    """Set the accept queue of every TCP listener of the broker to ``backlog`` connections; returns how many
    sockets were changed. amqtt opens them through ``asyncio.start_server`` with its default of 100, so
    2,000 clients connecting at once lost thousands of SYNs and retried for up to 14 s (issue 5 storm).
    Linux applies a second ``listen`` to a listening socket and caps it at ``net.core.somaxconn``."""
    changed = 0
    for server in context._broker_instance._servers.values():
        for listening in getattr(server.instance, "sockets", None) or ():
            if listening.type == socket.SOCK_STREAM:
                with socket.socket(fileno=os.dup(listening.fileno())) as same_socket:
                    same_socket.listen(backlog)
                changed += 1
    return changed


# --- an acknowledged message stays acknowledged; a takeover keeps the new connection (issue 10: points 4, 9) ---


def handle_puback_at_once(handler: BrokerProtocolHandler, puback: PubackPacket) -> Coroutine[Any, Any, None]:
    """Resolve the waiter of an incoming PUBACK while the reader loop decodes it, not in a task of its own.

    amqtt 0.12.1's reader loop runs ``handle_puback`` in a new task and cancels every such task still
    pending when the stream ends, so a PUBACK that arrived together with DISCONNECT or the end of the
    connection (``mosquitto_sub -C 1``) was dropped and ECQ redelivered an acknowledged message. Here the
    waiter is resolved before the reader reads the next packet; what amqtt schedules is a finished no-op.
    """
    packet_id = puback.packet_id
    waiter = handler._puback_waiters.get(packet_id)
    if waiter is None or waiter.done():
        log.warning("PUBACK for unknown packet id %s from %s", packet_id, client_id(handler))
    else:
        waiter.set_result(puback)
    return _nothing()


def _read_to_the_end_after_a_reset() -> None:
    """When a TCP connection fails, its StreamReader ends the stream after the bytes already received, as a
    normal close does.

    asyncio's ``StreamReader.set_exception`` makes every later read raise at once, even while the bytes
    received before the failure are still buffered. A client that closes with unread data in its socket
    makes its kernel send RST instead of FIN (``mosquitto_sub -C 1`` with more messages in flight): the
    PUBACK it sent just before was in the buffer, amqtt 0.12.1's reader loop never decoded it, and ECQ
    redelivered an acknowledged message (issue 10, point 4). The error itself is only logged (debug).
    """
    original = Broker.stream_connected

    async def stream_connected(broker: Broker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                               listener_name: str) -> None:
        def end_of_stream(exc: BaseException) -> None:
            log.debug("connection error %r: the stream ends after the bytes already received", exc)
            reader.feed_eof()

        reader.set_exception = end_of_stream
        return await original(broker, reader, writer, listener_name)

    Broker.stream_connected = stream_connected


async def _nothing() -> None:
    return None


def _keep_the_new_connection_on_persistent_takeover() -> None:
    """Keep the newest connection of a persistent session up when it takes over an older one.

    On a takeover amqtt 0.12.1 hands the one Session object of a clean-session-off client to the new
    connection and stops the old connection's handler; the old message loop then ends in
    ``Broker._handle_disconnect``, which marks that shared session disconnected, fires
    CLIENT_DISCONNECTED and publishes the session's Will (by then the new CONNECT's). The session monitor
    later deletes the "disconnected" session and closes the new connection too (issue 10, point 9:
    EOF 0.7 s after a takeover). MQTT 3.1.1 section 3.1.4 closes only the existing connection. So the
    handler being replaced is noted before amqtt's takeover starts, and its end only stops that handler.
    """
    original_session = Broker._handle_client_session
    original_disconnect = Broker._handle_disconnect
    taken_over: weakref.WeakSet[BrokerProtocolHandler] = weakref.WeakSet()

    async def handle_client_session(broker: Broker, reader: Any, writer: Any, session: Session,
                                    handler: BrokerProtocolHandler, *args: Any) -> None:
        _, previous = broker._sessions.get(session.client_id, (None, None))
        if previous is not None and previous is not handler and previous.session is session:
            taken_over.add(previous)
        return await original_session(broker, reader, writer, session, handler, *args)

    async def handle_disconnect(broker: Broker, session: Session, handler: BrokerProtocolHandler,
                                disconnect_waiter: asyncio.Future) -> None:
        if handler in taken_over:
            await broker._stop_handler(handler)
            return
        await original_disconnect(broker, session, handler, disconnect_waiter)

    Broker._handle_client_session = handle_client_session
    Broker._handle_disconnect = handle_disconnect


# --- bad clients (issue 10: points 6, 7, 8 and 10) -----------------------------------------------------------
# Each function below corrects one amqtt 0.12.1 (or asyncio) behaviour and is installed by one line in install().
# The connection hooks act only on brokers that run the ECQ plugin: their connections are in _connections, by reader.

ACCEPT_ERROR_LOG_INTERVAL_S = 10.0
_ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's message (selector_events._accept_connection)
_PACKET_NAMES = ("RESERVED", "CONNECT", "CONNACK", "PUBLISH", "PUBACK", "PUBREC", "PUBREL", "PUBCOMP", "SUBSCRIBE",
                 "SUBACK", "UNSUBSCRIBE", "UNSUBACK", "PINGREQ", "PINGRESP", "DISCONNECT", "RESERVED")


class ProtocolViolation(Exception):
    """A packet that MQTT 3.1.1 answers by closing the network connection, raised while it is decoded.

    It is deliberately not an amqtt ``MQTTError``: amqtt's reader loop skips those and reads on from the
    middle of the packet; any other exception ends the loop, which then closes the connection.
    """


@dataclass
class _Connection:
    """What the packet checks know about one connection: peer ``host:port``, limits, clientid once known."""

    peer: str
    max_packet_bytes: int
    connect_timeout_s: float
    client_id: str | None = None

    def __str__(self) -> str:
        if self.client_id is None:
            return f"{self.peer} (before CONNECT)"
        return f"client {self.client_id!r} ({self.peer})"


_connections: dict[Any, _Connection] = {}  # by amqtt ReaderAdapter, while amqtt serves the connection


def _violation(reader: Any, reason: str) -> ProtocolViolation:
    """Log why the connection read by ``reader`` is closed; return the exception that makes amqtt close it."""
    log.warning("ECQ closing the connection of %s: %s", _connections[reader], reason)
    return ProtocolViolation(reason)


def _abort(writer: Any) -> None:
    """Close a TCP connection's socket now, unless amqtt already closes it (unsent bytes are dropped)."""
    if isinstance(writer, StreamWriterAdapter):
        transport = writer._writer.transport
        if not transport.is_closing():
            writer.is_closed = True
            transport.abort()


def _close_abandoned_connections() -> None:
    """Correct amqtt 0.12.1 ``Broker._client_connected``, which leaves the socket open when it stops serving a
    connection on any path but a handler stop: a CONNECT that does not decode, an EOF before or during CONNECT
    (``_initialize_client_session`` raises without closing the writer), an exception it does not expect.
    Every such connection kept its file descriptor: 2,500 connect-and-close cycles under ``ulimit -n 1024``
    left the broker unable to accept anyone (issue 10 point 6). Now the socket is closed once amqtt returns.
    Also registers the connection in ``_connections`` for the packet checks below.
    """
    original = Broker._client_connected

    async def client_connected(broker: Broker, listener_name: str, reader: Any, writer: Any) -> None:
        plugin = _find_plugin(broker.plugins_manager)
        if plugin is None:
            return await original(broker, listener_name, reader, writer)
        peer = writer.get_peer_info()
        _connections[reader] = _Connection(f"{peer[0]}:{peer[1]}" if peer else "unknown peer",
                                           plugin.settings.effective_max_packet_bytes(),
                                           plugin.settings.connect_timeout)
        try:
            await original(broker, listener_name, reader, writer)
        finally:
            del _connections[reader]
            _abort(writer)

    Broker._client_connected = client_connected


def _time_limit_connect() -> None:
    """Correct amqtt 0.12.1 ``BrokerProtocolHandler.init_from_connect``, which waits for the first packet
    forever: a socket that never sends a whole CONNECT held its file descriptor (issue 10 point 6). Now it
    is closed after ``connect_timeout`` (EMQX does the same after its ``idle_timeout``). An unexpected
    exception while reading the CONNECT becomes an ``AMQTTError``, so amqtt logs it and releases the
    listener's slot instead of ending the connection's task with it.
    """
    original = BrokerProtocolHandler.init_from_connect.__func__

    async def init_from_connect(cls: type[BrokerProtocolHandler], reader: Any, writer: Any, *args: Any,
                                **kwargs: Any) -> tuple[BrokerProtocolHandler, Any]:
        connection = _connections.get(reader)
        if connection is None:
            return await original(cls, reader, writer, *args, **kwargs)
        try:
            handler, session = await asyncio.wait_for(original(cls, reader, writer, *args, **kwargs),
                                                      connection.connect_timeout_s)
        except TimeoutError:
            raise AMQTTError(f"no CONNECT from {connection.peer} within {connection.connect_timeout_s:g} s: "
                             "connection closed") from None
        except (AMQTTError, MQTTError, NoDataError):
            raise
        except Exception as exc:
            raise AMQTTError(f"CONNECT from {connection.peer} refused: {exc}") from exc
        connection.client_id = session.client_id
        return handler, session

    BrokerProtocolHandler.init_from_connect = classmethod(init_from_connect)


def _check_fixed_headers() -> None:
    """Correct amqtt 0.12.1 ``MQTTFixedHeader.from_stream``, after which amqtt reads any packet body in full,
    whatever its announced length: one 200 MB PUBLISH took the broker from 135 to 726 MB RSS (issue 10 point 7).
    Now a packet announcing a remaining length above ``max_packet_bytes`` closes the connection before its
    body is read (MQTT 3.1.1 has no other answer), and so does a PUBLISH with QoS 3 (section 3.3.1.2).
    """
    original = MQTTFixedHeader.from_stream.__func__

    async def from_stream(cls: type[MQTTFixedHeader], reader: Any) -> MQTTFixedHeader | None:
        header = await original(cls, reader)
        connection = _connections.get(reader)
        if header is None or connection is None:
            return header
        if header.remaining_length > connection.max_packet_bytes:
            raise _violation(reader, f"{_PACKET_NAMES[header.packet_type]} packet announces "
                                     f"{header.remaining_length} bytes, above max_packet_bytes "
                                     f"{connection.max_packet_bytes}")
        if header.packet_type == PUBLISH and header.flags & 0x06 == 0x06:
            raise _violation(reader, "PUBLISH with QoS 3 [MQTT-3.3.1-4]")
        return header

    MQTTFixedHeader.from_stream = classmethod(from_stream)


async def _read_utf8(reader: Any, what: str) -> str:
    """One MQTT UTF-8 string (2-byte length, then the bytes); raises ProtocolViolation for invalid UTF-8.

    amqtt's ``decode_string`` turns invalid UTF-8 into the text ``"b'...'"`` and carries on with it.
    """
    raw = await read_or_raise(reader, struct.unpack("!H", await read_or_raise(reader, 2))[0])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _violation(reader, f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start}) [MQTT-1.5.3-1]")


def _check_publish_headers() -> None:
    """Correct amqtt 0.12.1 ``PublishVariableHeader.from_stream``: a topic of invalid UTF-8 is taken as the
    text ``"b'...'"`` (section 1.5.3), packet id 0 is taken at QoS 1 and 2 (section 2.3.1), and a wildcard
    topic raises an ``MQTTError`` that leaves the payload to be read as the next packet. An empty topic
    (section 4.7.3) passed decoding and then ended the client's message loop with the connection left open
    (issue 10 point 8). Each now closes the connection with its reason logged, for ``$ECQ/`` writes too
    (nothing is stored); wildcards in ``$ECQ/`` topics stay ECQ's to refuse (see ``install``).
    """
    original = PublishVariableHeader.from_stream.__func__

    async def from_stream(cls: type[PublishVariableHeader], reader: Any, fixed_header: MQTTFixedHeader) -> Any:
        if reader not in _connections:
            return await original(cls, reader, fixed_header)
        topic = await _read_utf8(reader, "PUBLISH topic")
        packet_id = await decode_packet_id(reader) if fixed_header.flags & 0x06 else None
        if not topic:
            raise _violation(reader, "PUBLISH to an empty topic [MQTT-4.7.3-1]")
        if ("+" in topic or "#" in topic) and not is_ecq_topic(topic):
            raise _violation(reader, f"PUBLISH to {topic!r}, a topic with a wildcard [MQTT-3.3.2-2]")
        if packet_id == 0:
            raise _violation(reader, f"PUBLISH to {topic!r} with packet id 0 [MQTT-2.3.1-1]")
        return cls(topic, packet_id)

    PublishVariableHeader.from_stream = classmethod(from_stream)


def _check_subscribe_payloads() -> None:
    """Correct amqtt 0.12.1 ``SubscribePayload.from_stream``, which accepts a SUBSCRIBE without any topic
    filter (MQTT 3.1.1 section 3.8.3), takes invalid UTF-8 as the text ``"b'...'"`` and then miscounts the
    bytes left (section 1.5.3), and takes an empty filter (4.7.3) or a requested QoS above 2 (3.8.3-4).
    Each now closes the connection with its reason logged. Returns amqtt's payload for a valid packet.
    """
    original = SubscribePayload.from_stream.__func__

    async def from_stream(cls: type[SubscribePayload], reader: Any, fixed_header: MQTTFixedHeader,
                          variable_header: Any) -> SubscribePayload:
        if reader not in _connections:
            return await original(cls, reader, fixed_header, variable_header)
        left = fixed_header.remaining_length - variable_header.bytes_length
        filters: list[tuple[str, int]] = []
        while left > 0:
            topic_filter = await _read_utf8(reader, "SUBSCRIBE topic filter")
            qos = (await read_or_raise(reader, 1))[0]
            left -= 2 + len(topic_filter.encode()) + 1
            if not topic_filter:
                raise _violation(reader, "SUBSCRIBE with an empty topic filter [MQTT-4.7.3-1]")
            if qos > 2:
                raise _violation(reader, f"SUBSCRIBE to {topic_filter!r} with QoS byte {qos} [MQTT-3.8.3-4]")
            filters.append((topic_filter, qos))
        if left < 0:
            raise _violation(reader, "SUBSCRIBE whose topic filters overrun its remaining length")
        if not filters:
            raise _violation(reader, "SUBSCRIBE without a topic filter [MQTT-3.8.3-3]")
        return cls(filters)

    SubscribePayload.from_stream = classmethod(from_stream)


def _keep_serving_after_reserved_topics() -> None:
    """Correct amqtt 0.12.1 ``Broker._handle_message_delivery``, which ends the client's message loop after
    a PUBLISH to a topic starting with ``$`` (other than ECQ's) while the connection stays open and answers
    PINGREQ: the client's later SUBSCRIBEs were never answered (issue 10 point 8). MQTT 3.1.1 section 4.7.2
    only keeps such topics for the server, so the message is dropped with a log line and the loop goes on.
    """
    original = Broker._handle_message_delivery

    async def handle_message_delivery(broker: Broker, session: Any, handler: Any, wait_deliver: Any) -> bool:
        message = wait_deliver.result()
        if message is not None and message.topic.startswith("$") and _find_plugin(broker.plugins_manager):
            log.warning("ECQ dropped a PUBLISH of %r to %r: topics starting with $ are the broker's "
                        "(MQTT 3.1.1 section 4.7.2)", session.client_id, message.topic)
            return True
        return await original(broker, session, handler, wait_deliver)

    Broker._handle_message_delivery = handle_message_delivery


class _AcceptErrorLogLimit(logging.Filter):
    """Lets one asyncio "socket.accept() out of system resource" record through per ``interval_s``,
    without its traceback and with the count of those held back; other records pass unchanged."""

    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self._interval_s = interval_s
        self._next_at = float("-inf")
        self._held_back = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or not record.msg.startswith(_ACCEPT_ERROR):
            return True
        now = time.monotonic()
        if now < self._next_at:
            self._held_back += 1
            return False
        error = record.exc_info[1] if record.exc_info else None
        record.msg = (f"{_ACCEPT_ERROR}: {error}; new connections wait until descriptors are free "
                      f"({self._held_back} more such errors since the last report; "
                      f"reported at most every {self._interval_s:g} s)")
        record.args, record.exc_info, record.exc_text = (), None, None
        self._next_at, self._held_back = now + self._interval_s, 0
        return True


def _limit_accept_error_log() -> None:
    """Correct the log flood of accept failures: when the process runs out of file descriptors, CPython 3.11's
    ``BaseSelectorEventLoop._accept_connection`` logs "socket.accept() out of system resource" with a traceback
    up to ``backlog`` (100, amqtt's) times per attempt and retries every second, which wrote hundreds of MB
    (issue 10 point 6). Now one line per ``ACCEPT_ERROR_LOG_INTERVAL_S`` is logged."""
    logging.getLogger("asyncio").addFilter(_AcceptErrorLogLimit(ACCEPT_ERROR_LOG_INTERVAL_S))


# --- issue 10: nothing reaches $ECQ/<clientid>/... except ECQ's delivery -----------------------------------


def _refuse_forbidden_wills() -> None:
    """Refuse a CONNECT whose Will the ECQ plugin forbids with CONNACK 0x05 (MQTT 3.1.1 section 3.2.2.3).

    amqtt 0.12.1 accepts any Will topic and, on an abnormal disconnect, broadcasts the Will (and with the
    Will Retain flag stores it) without asking the topic filters: a Will on ``$ECQ/<victim>/<key>`` reached
    the victim as a forged queue delivery. The check runs right after amqtt read the CONNECT, before it
    touches any existing session of that clientid, the way amqtt refuses a bad protocol level: CONNACK,
    close, and MQTTError, which amqtt logs and which ends the connection.
    """
    original = BrokerProtocolHandler.init_from_connect.__func__

    async def init_from_connect(cls: type[BrokerProtocolHandler], reader: Any, writer: Any, plugins_manager: Any,
                                loop: asyncio.AbstractEventLoop | None = None) -> tuple[BrokerProtocolHandler, Any]:
        handler, session = await original(cls, reader, writer, plugins_manager, loop)
        plugin = _find_plugin(plugins_manager)
        reason = plugin.will_refusal(session) if plugin is not None and session.will_flag else None
        if reason is not None:
            connack = ConnackPacket.build(0, NOT_AUTHORIZED)
            await plugins_manager.fire_event(MQTTEvents.PACKET_SENT, packet=connack)
            await connack.to_stream(writer)
            await writer.close()
            raise MQTTError(f"CONNECT refused with 0x05: {reason}")
        return handler, session

    BrokerProtocolHandler.init_from_connect = classmethod(init_from_connect)


def _keep_ecq_out_of_broadcasts() -> None:
    """Drop, with a warning, any amqtt broadcast to an ``$ECQ/`` topic.

    amqtt 0.12.1's ``Broker._broadcast_message`` sends a topic to every matching subscription: a Will,
    ``BrokerContext.broadcast_message`` of any plugin, or ``internal_message_broadcast`` would reach the
    subscription ``$ECQ/<clientid>/#`` as if ECQ delivered it (or wait in an offline session's queue).
    ECQ's delivery does not go through it (see :func:`publish_qos1`).
    """
    original = Broker._broadcast_message

    async def broadcast_message(broker: Broker, session: Any, topic: str | None, data: Any,
                                force_qos: int | None = None) -> None:
        if topic is not None and is_ecq_topic(topic) and _find_plugin(broker.plugins_manager) is not None:
            log.warning("ECQ dropped an amqtt broadcast to %r from %s: only ECQ delivers under $ECQ/",
                        topic, session.client_id if session else "the broker")
            return
        await original(broker, session, topic, data, force_qos)

    Broker._broadcast_message = broadcast_message


def _keep_ecq_out_of_retained_store() -> None:
    """Never store (nor clear) an ``$ECQ/`` topic in amqtt's retained messages; log a warning instead.

    amqtt 0.12.1's ``Broker.retain_message`` keeps the last retained message of a topic (from a Will with
    Will Retain, a PUBLISH with RETAIN, or a plugin) and replays it on every SUBSCRIBE that matches, so a
    retained ``$ECQ/<clientid>/<key>`` would come back on each re-subscribe to the queue. ECQ writes with
    RETAIN are stored as ordinary writes by ECQ and never reach this method.
    """
    original = Broker.retain_message

    async def retain_message(broker: Broker, source_session: Any, topic_name: str, data: Any,
                             qos: int | None = None) -> None:
        if is_ecq_topic(topic_name) and _find_plugin(broker.plugins_manager) is not None:
            log.warning("ECQ did not retain a message on %r from %s: amqtt never retains under $ECQ/",
                        topic_name, source_session.client_id if source_session else "the broker")
            return
        await original(broker, source_session, topic_name, data, qos)

    Broker.retain_message = retain_message


# --- MQTT 3.1.1 for ordinary topics (issue 15) ------------------------------------------------------------
# Each function below corrects one amqtt 0.12.1 behaviour on a broker that runs the ECQ plugin; a broker
# without it keeps stock amqtt. ``$ECQ/`` topics are ECQ's own and never reach these paths except where said.

_PUBLISH_QOS: contextvars.ContextVar[int | None] = contextvars.ContextVar("ecq_publish_qos", default=None)
_closing: set[asyncio.Task] = set()  # keepalive closes in progress (a reference keeps each task alive)


def _keep_persistent_sessions() -> None:
    """amqtt 0.12.1's AnonymousAuthPlugin marks every session ``is_anonymous``, and ``Broker._session_monitor``
    deletes such a session about 1 s after it disconnects, while ``_run_broadcast`` queues no message for it:
    a CleanSession=0 client lost its subscriptions and offline messages and got CONNACK session-present 0.
    MQTT 3.1.1 section 3.1.2.4 keeps the session whatever the authentication, so a persistent session is
    not marked anonymous (amqtt uses the mark only for those two decisions and its contrib persistence).
    How long it is kept is ``session_expiry`` (:func:`set_session_expiry`)."""
    original = Broker._authenticate

    async def authenticate(broker: Broker, session: Any, listener: Any) -> bool:
        authenticated = await original(broker, session, listener)
        if _find_plugin(broker.plugins_manager) is not None and session.clean_session is False:
            session.is_anonymous = False
        return authenticated

    Broker._authenticate = authenticate


def set_session_expiry(context: BrokerContext, seconds: float) -> None:
    """Forget a disconnected persistent session after ``seconds`` (amqtt's ``session_expiry_interval``,
    checked by its session monitor every second; EMQX calls it session expiry, default 2 h there)."""
    config = context._broker_instance.config
    if config.session_expiry_interval is not None and config.session_expiry_interval != math.ceil(seconds):
        log.warning(
            "amqtt's session_expiry_interval %s is replaced by ECQ's session_expiry %s s",
            config.session_expiry_interval, math.ceil(seconds))
    config.session_expiry_interval = math.ceil(seconds)


def _retained_only_for_new_subscriptions() -> None:
    """amqtt 0.12.1's ``Broker._handle_client_session`` sends a connecting client every retained message that
    matches *any* client's subscription filter, at QoS 0; and ``_publish_retained_messages_for_subscription``
    sends a QoS 0 retained message at the subscription's QoS. MQTT 3.1.1 section 3.3.1.3: a retained message
    goes to a new subscription that matches it, RETAIN=1, at min(granted QoS, message QoS); a reconnect is
    no new subscription. So the SUBSCRIBE handling is taken over and the connect-time loop sends nothing."""
    original_handle = Broker._handle_subscription
    original_send = Broker._publish_retained_messages_for_subscription

    async def handle_subscription(broker: Broker, session: Any, handler: BrokerProtocolHandler,
                                  waiter: asyncio.Future) -> None:
        if _find_plugin(broker.plugins_manager) is None:
            return await original_handle(broker, session, handler, waiter)
        return await _handle_subscribe(broker, session, handler, waiter.result())

    async def send_on_connect(broker: Broker, subscription: tuple[str, int], session: Any) -> None:
        if _find_plugin(broker.plugins_manager) is None:
            await original_send(broker, subscription, session)

    Broker._handle_subscription = handle_subscription
    Broker._publish_retained_messages_for_subscription = send_on_connect


async def _handle_subscribe(broker: Broker, session: Any, handler: BrokerProtocolHandler, subscribe: Any) -> None:
    """amqtt's SUBSCRIBE handling (grant each filter, SUBACK, CLIENT_SUBSCRIBED) with conformant retained sends."""
    granted = [await broker.add_subscription(subscription, session) for subscription in subscribe.topics]
    await handler.mqtt_acknowledge_subscription(subscribe.packet_id, granted)
    for (topic_filter, requested_qos), qos in zip(subscribe.topics, granted, strict=True):
        if qos == SUBACK_FAILURE:
            continue
        await broker.plugins_manager.fire_event(BrokerEvents.CLIENT_SUBSCRIBED, client_id=session.client_id,
                                                topic=topic_filter, qos=requested_qos)
        sends = [handler.mqtt_publish(message.topic, message.data, qos if message.qos is None else min(qos, message.qos),
                                      retain=True)
                 for topic, message in list(broker.retained_messages.items()) if broker._matches(topic, topic_filter)]
        await asyncio.gather(*sends, return_exceptions=True)


def _offline_messages_not_retained() -> None:
    """amqtt 0.12.1's ``Broker._publish_session_retained_messages`` sends the messages queued for a
    disconnected session with RETAIN=1. They were not published retained, and MQTT 3.1.1 section 3.3.1.3
    sets RETAIN only on a retained message sent for a new subscription: they go out with RETAIN=0."""
    original = Broker._publish_session_retained_messages

    async def publish_queued(broker: Broker, session: Any) -> None:
        if _find_plugin(broker.plugins_manager) is None:
            return await original(broker, session)
        handler = broker._get_handler(session)
        sends = []
        while handler is not None and not session.retained_messages.empty():
            message = session.retained_messages.get_nowait()
            sends.append(handler.mqtt_publish(message.topic, message.data, message.qos, retain=False))
        await asyncio.gather(*sends, return_exceptions=True)

    Broker._publish_session_retained_messages = publish_queued


def _conformant_fan_out() -> None:
    """amqtt 0.12.1's ``Broker._run_broadcast`` sends a message once per matching filter of a client (twice
    to a client subscribed to ``a/#`` and ``a/+``), at the subscription's QoS whatever the PUBLISH's QoS, and
    keeps nothing for an anonymous session. MQTT 3.1.1 sections 3.3.5 and 3.8.4: one delivery per client at
    min(PUBLISH QoS, highest granted QoS of its matching subscriptions); a disconnected CleanSession=0 session
    gets its QoS 1 and 2 messages queued (section 3.1.2.4), within ``session_max_queued``.

    amqtt does not put the PUBLISH's QoS in its broadcast, so ``_handle_message_delivery`` records it for
    ``_broadcast_message`` (same task) in a context variable. A broadcast with a QoS (the Will, a plugin's)
    is capped at that QoS; without one at QoS 2, i.e. by the subscription only.
    """
    original_delivery = Broker._handle_message_delivery
    original_broadcast = Broker._broadcast_message
    original_run = Broker._run_broadcast

    async def handle_message_delivery(broker: Broker, session: Any, handler: Any, waiter: asyncio.Future) -> bool:
        message = waiter.result()
        token = _PUBLISH_QOS.set(message.qos if message is not None else None)
        try:
            return await original_delivery(broker, session, handler, waiter)
        finally:
            _PUBLISH_QOS.reset(token)

    async def broadcast_message(broker: Broker, session: Any, topic: str | None, data: Any,
                                force_qos: int | None = None) -> None:
        if force_qos is None and _find_plugin(broker.plugins_manager) is not None:
            force_qos = _PUBLISH_QOS.get()
        await original_broadcast(broker, session, topic, data, force_qos)

    async def run_broadcast(broker: Broker, running_tasks: Any) -> None:
        plugin = _find_plugin(broker.plugins_manager)
        if plugin is None:
            return await original_run(broker, running_tasks)
        await _fan_out(broker, plugin, await broker._broadcast_queue.get(), running_tasks)

    Broker._handle_message_delivery = handle_message_delivery
    Broker._broadcast_message = broadcast_message
    Broker._run_broadcast = run_broadcast


def _subscribers(broker: Broker, topic: str) -> dict[str, tuple[Any, int]]:
    """client id -> (session, highest granted QoS among its filters matching ``topic``)."""
    found: dict[str, tuple[Any, int]] = {}
    for topic_filter, subscriptions in broker.subscriptions.items():
        if broker._matches(topic, topic_filter):
            for session, qos in subscriptions:
                if session.client_id not in found or qos > found[session.client_id][1]:
                    found[session.client_id] = (session, qos)
    return found


async def _fan_out(broker: Broker, plugin: EcqPlugin, broadcast: dict[str, Any], running_tasks: Any) -> None:
    topic, publish_qos = broadcast["topic"], broadcast.get("qos", 2)
    if publish_qos is None:
        publish_qos = 2
    for session, granted in _subscribers(broker, topic).values():
        qos = min(publish_qos, granted)
        if not await broker._topic_filtering(session, topic=topic, action=Action.RECEIVE):
            continue
        if session.transitions.state != "connected":
            if not session.clean_session and qos > QOS_0:
                _make_room(session.retained_messages, plugin, session.client_id)
                await broker._retain_broadcast_message(broadcast, qos, session)
            continue
        if (handler := broker._get_handler(session)) is not None:
            running_tasks.append(asyncio.ensure_future(handler.mqtt_publish(topic, broadcast["data"], qos, False)))


def _make_room(queue: asyncio.Queue, plugin: EcqPlugin, clientid: str) -> None:
    """Drop the oldest messages of a disconnected session's queue until one more fits ``session_max_queued``."""
    while queue.qsize() >= plugin.settings.session_max_queued:
        dropped = queue.get_nowait()
        plugin.session_message_dropped(clientid, dropped.topic, "queue_full")


def _resend_unacked_on_reconnect() -> None:
    """amqtt 0.12.1 takes an outgoing QoS 1/2 message out of ``session.inflight_out`` when its flow ends
    without the acknowledgement (the connection closed, or 5 s passed), so ``_retry_deliveries`` never
    resends it (amqtt issue #401). MQTT 3.1.1 section 4.4: on reconnect with CleanSession=0 the server
    resends unacknowledged PUBLISHes (DUP=1, same packet id) and PUBRELs. So such a message is put back
    for a persistent session, at most ``session_max_inflight`` per session (the oldest is dropped).
    ``$ECQ/`` deliveries are excluded: ECQ redelivers its queues itself (:func:`publish_qos1`).
    A PUBACK that comes after amqtt's 5 s gave up now settles the kept message."""
    original_flow = BrokerProtocolHandler._handle_message_flow
    original_retry = BrokerProtocolHandler._retry_deliveries
    original_puback = BrokerProtocolHandler.handle_puback

    async def handle_message_flow(handler: BrokerProtocolHandler, message: Any) -> None:
        try:
            await original_flow(handler, message)
        except (asyncio.CancelledError, Exception):
            _keep_for_resend(handler, message)
            raise

    async def retry_deliveries(handler: BrokerProtocolHandler) -> None:
        if _find_plugin(handler.plugins_manager) is None:
            return await original_retry(handler)
        session = handler.session
        messages = [*session.inflight_in.values(),
                    *(m for m in session.inflight_out.values() if not is_ecq_topic(m.topic))]
        await asyncio.gather(*(asyncio.wait_for(handler._handle_message_flow(m), _RESEND_TIMEOUT_S) for m in messages),
                             return_exceptions=True)

    def handle_puback(handler: BrokerProtocolHandler, puback: PubackPacket) -> Coroutine[Any, Any, None]:
        # not a coroutine function: like handle_puback_at_once, it acts while the reader loop decodes the PUBACK
        packet_id = puback.variable_header.packet_id if puback.variable_header else None
        late = handler.session.inflight_out.get(packet_id) if handler.session else None
        if (packet_id in handler._puback_waiters or late is None or late.qos != QOS_1 or is_ecq_topic(late.topic)
                or _find_plugin(handler.plugins_manager) is None):
            return original_puback(handler, puback)
        late.puback_packet = puback
        del handler.session.inflight_out[packet_id]
        return _nothing()

    BrokerProtocolHandler._handle_message_flow = handle_message_flow
    BrokerProtocolHandler._retry_deliveries = retry_deliveries
    BrokerProtocolHandler.handle_puback = handle_puback


_RESEND_TIMEOUT_S = 10  # amqtt's own bound on one resend at connect (its _retry_deliveries)


def _keep_for_resend(handler: BrokerProtocolHandler, message: Any) -> None:
    session = handler.session
    plugin = _find_plugin(handler.plugins_manager)
    if (plugin is None or session is None or session.clean_session is not False or message.direction != OUTGOING
            or message.qos not in (QOS_1, 2) or is_ecq_topic(message.topic)
            or (message.puback_packet if message.qos == QOS_1 else message.pubcomp_packet) is not None):
        return
    session.inflight_out.setdefault(message.packet_id, message)
    waited = handler._puback_waiters.keys() | handler._pubrec_waiters.keys() | handler._pubcomp_waiters.keys()
    kept = [pid for pid, m in session.inflight_out.items() if pid not in waited and not is_ecq_topic(m.topic)]
    for packet_id in kept[:max(0, len(kept) - plugin.settings.session_max_inflight)]:
        plugin.session_message_dropped(session.client_id, session.inflight_out.pop(packet_id).topic, "inflight_full")


def _enforce_keepalive() -> None:
    """amqtt 0.12.1 reads with a timeout of the keepalive but its ``BrokerProtocolHandler.handle_read_timeout``
    does nothing: a silent client stays connected forever and its Will is never published. MQTT 3.1.1
    section 3.1.2.10: after 1.5 x keepalive without a packet the server closes the connection (and, as
    for any close without DISCONNECT, publishes the Will, section 3.1.2.5). The reader's timeout is
    ``session.keep_alive`` (amqtt adds its ``timeout-disconnect-delay`` to it), so that becomes 1.5 x the
    CONNECT's keepalive, and the timeout closes the connection."""
    original_init = BrokerProtocolHandler.init_from_connect
    original_timeout = BrokerProtocolHandler.handle_read_timeout

    async def init_from_connect(cls: type, reader: Any, writer: Any, plugins_manager: Any,
                                loop: Any = None) -> tuple[BrokerProtocolHandler, Any]:
        handler, session = await original_init(reader, writer, plugins_manager, loop)
        if _find_plugin(plugins_manager) is not None:
            session.keep_alive = session.keep_alive * 1.5
        return handler, session

    def handle_read_timeout(handler: BrokerProtocolHandler) -> None:
        if _find_plugin(handler.plugins_manager) is None:
            return original_timeout(handler)
        log.info("closing %s: no packet within 1.5 x its keepalive", client_id(handler))
        task = asyncio.get_running_loop().create_task(close_connection(handler))
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    BrokerProtocolHandler.init_from_connect = classmethod(init_from_connect)
    BrokerProtocolHandler.handle_read_timeout = handle_read_timeout


# --- start-up failures are reported, not hidden (issue 10) ---------------------------------------------

def raise_pre_start_failure() -> None:
    """Make ``Broker.start`` raise the failure of the ECQ plugin's ``on_broker_pre_start``.

    amqtt 0.12.1's ``PluginManager.fire_event(PRE_START, wait=True)`` runs each plugin's handler in a task
    and only waits for it: an exception stays in the task, and ``Broker.start`` goes on to open the
    listeners, so a broker whose store, writers and admin API never started logged "running". The plugin
    keeps its failure in ``start_error``; this wrapper raises it before any listener is opened.
    """
    original_fire_event = PluginManager.fire_event

    async def fire_event(manager: PluginManager, event_name: Any, *, wait: bool = False, **kwargs: Any) -> None:
        await original_fire_event(manager, event_name, wait=wait, **kwargs)
        if event_name == BrokerEvents.PRE_START and (plugin := _find_plugin(manager)) and plugin.start_error:
            raise plugin.start_error

    PluginManager.fire_event = fire_event


class _NoStartFailureTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Broker startup failed"


def quiet_start_failure_traceback() -> None:
    """Drop amqtt 0.12.1's ``logger.exception("Broker startup failed")`` in ``Broker.start``: it prints a
    traceback for an ordinary failure such as a port in use, which ``ecq broker`` reports in one line."""
    logging.getLogger("amqtt.broker").addFilter(_NoStartFailureTraceback())
