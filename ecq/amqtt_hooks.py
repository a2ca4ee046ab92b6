"""The two places where ECQ must own amqtt 0.12.1's behaviour, and every use of its internals.

Plugin events cannot do what SPEC.md section 1 asks, because in stock amqtt 0.12.1:

1. ``ProtocolHandler.handle_publish`` queues an incoming QoS 1 PUBLISH and sends its PUBACK at once,
   before anything is stored; then ``Broker._handle_message_delivery`` logs a warning for any topic
   starting with ``$`` and ends that client's message loop. So ``BrokerProtocolHandler.handle_publish``
   is wrapped: a PUBLISH under ``$ECQ/`` goes to :meth:`EcqPlugin.handle_ecq_publish`, which stores the
   write and only then acknowledges it (MQTT 3.1.1 section 4.3.2: PUBACK after taking ownership).
2. ``topic_filtering`` plugins see a SUBSCRIBE's filter but not its QoS, and ECQ queues are read only at
   QoS 1. So ``Broker.add_subscription`` is wrapped: for a ``$ECQ/`` filter the plugin grants QoS 1 or
   refuses with return code 0x80 (MQTT 3.1.1 section 3.9.3).

3. ``PublishVariableHeader`` refuses ``+``/``#`` in a PUBLISH topic while decoding, leaving the rest of
   the packet unread; the reader then takes the payload for a new packet and drops the connection. For
   ``$ECQ/`` topics the check is left to ECQ, which refuses such a write with a reason and keeps the
   publisher connected (SPEC.md section 1, bad writes). Other topics keep amqtt's check.

The first two wrappers find the plugin in the handler's or broker's own PluginManager, so several brokers in one
process work independently and a broker without the ECQ plugin behaves exactly as stock amqtt.

ECQ's own packets (the PUBACK of a write, the PUBLISH of a delivery) do not go through amqtt's
``_send_packet``, which makes one socket ``send`` per packet: :func:`send_soon` gathers every packet for
a connection queued during one event-loop iteration into one write. A commit of a few hundred writes
then answers each publisher with one ``send`` instead of one per PUBACK (issue 5 profile: the per-packet
``send`` was 14 % of the event loop). amqtt's ``PACKET_SENT`` plugin event is not fired for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import weakref
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from amqtt.broker import Broker, BrokerContext
from amqtt.errors import MQTTError
from amqtt.events import MQTTEvents
from amqtt.mqtt.connack import NOT_AUTHORIZED, ConnackPacket
from amqtt.mqtt.constants import QOS_1
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.puback import PubackPacket
from amqtt.mqtt.pubcomp import PubcompPacket
from amqtt.mqtt.packet import MQTTVariableHeader
from amqtt.mqtt.publish import PublishPacket, PublishVariableHeader
from amqtt.mqtt.pubrec import PubrecPacket
from amqtt.session import OutgoingApplicationMessage, Session

from ecq.topics import is_ecq_topic

if TYPE_CHECKING:
    from ecq.plugin import EcqPlugin

log = logging.getLogger(__name__)

SUBACK_FAILURE = 0x80
_QOS2_PUBREL_TIMEOUT_S = 10.0
_plugin_class: type | None = None
_unsent: dict[BrokerProtocolHandler, list[bytes]] = {}  # packets queued by send_soon, per connection


def install(plugin_class: type) -> None:
    """Wrap the three amqtt methods once per process; ``plugin_class`` is the class to dispatch to."""
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
    BrokerProtocolHandler.handle_puback = handle_puback_at_once
    original_stream_connected = Broker.stream_connected

    async def stream_connected(broker: Broker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                               listener_name: str) -> None:
        reader.set_exception = _end_of_stream_after_buffered_data(reader)
        return await original_stream_connected(broker, reader, writer, listener_name)

    Broker.stream_connected = stream_connected
    _install_persistent_takeover()
    Broker.add_subscription = add_subscription
    PublishVariableHeader.__init__ = header_init
    _refuse_forbidden_wills()
    _keep_ecq_out_of_broadcasts()
    _keep_ecq_out_of_retained_store()


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


def _end_of_stream_after_buffered_data(reader: asyncio.StreamReader) -> Callable[[BaseException], None]:
    """What a TCP connection's StreamReader does when the connection fails: end the stream after the bytes
    already received, as a normal close does.

    asyncio's ``StreamReader.set_exception`` makes every later read raise at once, even while the bytes
    received before the failure are still buffered. A client that closes with unread data in its socket
    makes its kernel send RST instead of FIN (``mosquitto_sub -C 1`` with more messages in flight): the
    PUBACK it sent just before was in the buffer, amqtt 0.12.1's reader loop never decoded it, and ECQ
    redelivered an acknowledged message (issue 10, point 4). The error itself is only logged.
    """
    def end_of_stream(exc: BaseException) -> None:
        log.debug("connection error %r: the stream ends after the bytes already received", exc)
        reader.feed_eof()
    return end_of_stream


async def _nothing() -> None:
    return None


def _install_persistent_takeover() -> None:
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
