"""ECQ's own paths through amqtt 0.12.1, and the connection operations the plugin uses.

Plugin events cannot do what ECQ's queues need, because in stock amqtt:

- ``ProtocolHandler.handle_publish`` PUBACKs a QoS 1 PUBLISH before anything is stored, so a PUBLISH under
  ``$ECQ/`` goes to the plugin's ``handle_ecq_publish``, which stores, then acknowledges (MQTT 3.1.1
  section 4.3.2): :func:`take_ecq_publishes`;
- ``topic_filtering`` plugins do not see a SUBSCRIBE's QoS, so ``Broker.add_subscription`` asks the plugin
  to grant QoS 1 or refuse (0x80, section 3.9.3): :func:`grant_ecq_subscriptions`;
- ``PublishVariableHeader`` refuses ``+``/``#`` mid-decode and desynchronises the stream, so for ``$ECQ/``
  topics ECQ refuses such a write itself and keeps the publisher connected: :func:`accept_ecq_wildcards`.

ECQ's own packets (write PUBACKs, deliveries) leave through :func:`send_soon`, one socket write per
connection and event-loop iteration (one ``send`` per packet was 14 % of the loop); amqtt's
``PACKET_SENT`` event is not fired for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from typing import Any

from amqtt.broker import Broker, BrokerContext
from amqtt.mqtt.constants import QOS_1
from amqtt.mqtt.packet import MQTTVariableHeader
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.pubcomp import PubcompPacket
from amqtt.mqtt.publish import PublishPacket, PublishVariableHeader
from amqtt.mqtt.pubrec import PubrecPacket
from amqtt.session import OutgoingApplicationMessage

from ecq.broker.amqtt_hooks.target import find_target
from ecq.queue.topics import is_ecq_topic

SUBACK_FAILURE = 0x80
_PUBACK = struct.Struct(">BBH")  # PUBACK: type 4, remaining length 2, packet id (MQTT 3.1.1 section 3.4)
_QOS2_PUBREL_TIMEOUT_S = 10.0
_unsent: dict[BrokerProtocolHandler, list[bytes]] = {}  # packets queued by send_soon, per connection


log = logging.getLogger(__name__)

def take_ecq_publishes() -> None:
    """Hand every PUBLISH under ``$ECQ/`` to the plugin's ``handle_ecq_publish`` instead of amqtt's
    ``BrokerProtocolHandler.handle_publish``, which acknowledges before anything is stored."""
    original = BrokerProtocolHandler.handle_publish

    async def handle_publish(handler: BrokerProtocolHandler, packet: PublishPacket) -> None:
        plugin = find_target(handler.plugins_manager)
        if plugin is None or packet.topic_name is None or not is_ecq_topic(packet.topic_name):
            return await original(handler, packet)
        return await plugin.handle_ecq_publish(handler, packet)

    BrokerProtocolHandler.handle_publish = handle_publish


def grant_ecq_subscriptions() -> None:
    """Let the plugin's ``grant_subscription`` choose the QoS of a SUBSCRIBE to an ``$ECQ/`` filter, or refuse
    it with SUBACK 0x80, before amqtt's ``Broker.add_subscription`` records it."""
    original = Broker.add_subscription

    async def add_subscription(broker: Broker, subscription: tuple[str, int], session: Any) -> int:
        plugin = find_target(broker.plugins_manager)
        topic_filter, qos = subscription
        if plugin is not None and is_ecq_topic(topic_filter):
            granted = plugin.grant_subscription(session.client_id, topic_filter, qos)
            if granted is None:
                return SUBACK_FAILURE
            subscription = (topic_filter, granted)
        return await original(broker, subscription, session)

    Broker.add_subscription = add_subscription


def accept_ecq_wildcards() -> None:
    """Let an ``$ECQ/`` topic with ``+`` or ``#`` through amqtt's ``PublishVariableHeader``, whose refusal
    mid-decode leaves the payload to be read as the next packet; the plugin refuses such a write itself."""
    original = PublishVariableHeader.__init__

    def header_init(header: PublishVariableHeader, topic_name: str, packet_id: int | None = None) -> None:
        if not is_ecq_topic(topic_name):
            return original(header, topic_name, packet_id)
        MQTTVariableHeader.__init__(header)
        header.topic_name, header.packet_id = topic_name, packet_id

    PublishVariableHeader.__init__ = header_init


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
        send_soon(handler, _PUBACK.pack(0x40, 2, packet_id))
    elif qos == 2:
        pubrel = asyncio.get_running_loop().create_future()
        handler._pubrel_waiters[packet_id] = pubrel
        try:
            await handler._send_packet(PubrecPacket.build(packet_id))
            await asyncio.wait_for(pubrel, _QOS2_PUBREL_TIMEOUT_S)
        finally:
            handler._pubrel_waiters.pop(packet_id, None)
        await handler._send_packet(PubcompPacket.build(packet_id))


def acknowledge_soon(handler: BrokerProtocolHandler, qos: int, packet_id: int | None) -> None:
    """Start :func:`acknowledge` now: a QoS 1 PUBACK is queued at once (``send_soon``), a QoS 2 flow runs in a
    task of its own (its PUBREC is sent before anything started later); a failure is logged, not raised."""
    if qos == QOS_1:
        send_soon(handler, _PUBACK.pack(0x40, 2, packet_id))
    elif qos == 2:
        asyncio.ensure_future(acknowledge(handler, qos, packet_id)).add_done_callback(_log_ack_failure)


def _log_ack_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.info("ECQ could not finish a QoS 2 acknowledgement: %s", exc or type(exc).__name__)


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
    2,000 clients connecting at once lost thousands of SYNs and retried for up to 14 s.
    Linux applies a second ``listen`` to a listening socket and caps it at ``net.core.somaxconn``."""
    sockets = _listening_sockets(context)
    for listening in sockets:
        with socket.socket(fileno=os.dup(listening.fileno())) as same_socket:
            same_socket.listen(backlog)
    return len(sockets)


class _SubscriptionMap(dict):
    """amqtt's map of topic filter -> [(session, QoS)], with a repr that names its size instead of every entry."""

    def __repr__(self) -> str:
        return f"<{len(self)} topic filters>"


def shorten_subscriptions_repr(context: BrokerContext) -> None:
    """amqtt 0.12.1's ``Broker._client_message_loop`` runs ``logger.debug(repr(self._subscriptions))`` after every
    SUBSCRIBE: the argument is formatted even when debug logging is off, down to each subscriber's
    ``Session.__repr__``. Each SUBSCRIBE cost time in proportion to every subscription of every client, so a storm
    of N consumers subscribing cost O(N^2) (1.9 % of the broker's samples while 1,000 consumers connected). The
    map keeps its contents and type (a dict); only its repr is short."""
    broker = context._broker_instance
    broker._subscriptions = _SubscriptionMap(broker._subscriptions)


def listener_addresses(context: BrokerContext) -> list[str]:
    """``host:port`` of every TCP socket the broker's MQTT listeners listen on (IPv6 hosts in brackets)."""
    addresses = []
    for listening in _listening_sockets(context):
        host, port = listening.getsockname()[:2]
        addresses.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return addresses


def _listening_sockets(context: BrokerContext) -> list[socket.socket]:
    """The TCP sockets of the broker's listeners (amqtt keeps each asyncio server in ``Broker._servers``)."""
    return [listening for server in context._broker_instance._servers.values()
            for listening in getattr(server.instance, "sockets", None) or ()
            if listening.type == socket.SOCK_STREAM]
