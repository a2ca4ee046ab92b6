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
from typing import TYPE_CHECKING, Any

from amqtt.broker import Broker, BrokerContext
from amqtt.events import BrokerEvents
from amqtt.mqtt.constants import QOS_1
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.puback import PubackPacket
from amqtt.mqtt.pubcomp import PubcompPacket
from amqtt.mqtt.packet import MQTTVariableHeader
from amqtt.mqtt.publish import PublishPacket, PublishVariableHeader
from amqtt.mqtt.pubrec import PubrecPacket
from amqtt.plugins.manager import PluginManager
from amqtt.session import OutgoingApplicationMessage

from ecq.topics import is_ecq_topic

if TYPE_CHECKING:
    from ecq.plugin import EcqPlugin

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
    Broker.add_subscription = add_subscription
    PublishVariableHeader.__init__ = header_init
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
