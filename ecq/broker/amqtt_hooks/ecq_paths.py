"""ECQ's own paths through amqtt 0.12.1, and the connection operations the plugin uses.

Plugin events cannot do what ECQ's queues need, because in stock amqtt:

- ``ProtocolHandler.handle_publish`` PUBACKs a QoS 1 PUBLISH before anything is stored, so a PUBLISH under
  ``$ECQ/`` goes to the plugin's ``take_ecq_write`` as it is read, which stores, then acknowledges (MQTT 3.1.1
  section 4.3.2), and plain QoS 1 PUBACKs and QoS 2 PUBRECs wait their turn behind it: :func:`take_ecq_publishes`;
- a QoS 2 write's packet id is kept until its PUBREL (:func:`qos2_receipts`), so a retransmit is not stored
  again, and every PUBREL gets its PUBCOMP: :func:`release_ecq_qos2_writes`;
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
import functools
import os
import socket
import struct
from collections.abc import Callable, Coroutine
from typing import Any

from amqtt.broker import Broker, BrokerContext
from amqtt.mqtt.constants import QOS_1, QOS_2
from amqtt.mqtt.packet import MQTTVariableHeader
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.publish import PublishPacket, PublishVariableHeader
from amqtt.mqtt.pubcomp import PubcompPacket
from amqtt.mqtt.pubrel import PubrelPacket
from amqtt.session import IncomingApplicationMessage, OutgoingApplicationMessage

from ecq.broker.amqtt_hooks.mqtt5_messages import subscriptions_of
from ecq.broker.amqtt_hooks.mqtt5_packets import context_of, delivery, publish_acknowledgement, release_inbound
from ecq.broker.amqtt_hooks.seam import Result, kept_on, replace, step
from ecq.broker.amqtt_hooks.target import find_target
from ecq.queue.topics import is_ecq_topic, reading_filter
from ecq.store.protocol import Message

SUBACK_FAILURE = 0x80
_ACK = struct.Struct(">BBH")  # PUBACK, PUBREC, PUBCOMP: first byte, remaining length 2, packet id (section 3.4-3.7)
_ACK_TYPES = {1: 0x40, 2: 0x50}  # the acknowledgement of an incoming PUBLISH by QoS: PUBACK, PUBREC
_unsent: dict[BrokerProtocolHandler, list[bytes]] = {}  # packets queued by send_soon, per connection
_SENT_PACKET_IDS = "ecq_sent_packet_ids"  # amqtt's Session.attributes key: (topic, seqno) -> packet id, not acked
REMEMBERED_PACKET_IDS = 1024  # per session; at most reader_batch_size (31) are in flight when a connection drops


def take_ecq_publishes() -> None:
    """Take every PUBLISH under ``$ECQ/`` from amqtt's ``BrokerProtocolHandler.handle_publish``, which PUBACKs
    before anything is stored, and put the acknowledgement of a plain QoS 1 or 2 PUBLISH in the connection's arrival
    order (MQTT 3.1.1 section 4.6, MQTT-4.6.0-2/3: amqtt PUBACKs or PUBRECs it at once, ahead of earlier ``$ECQ/``
    writes still committing).

    Like ``acks.handle_puback_at_once`` this is not a coroutine function: it acts while the reader decodes the
    packet. amqtt's reader runs ``handle_publish`` in a task and cancels every pending one when the stream ends,
    so a QoS 0 write sent with DISCONNECT (``mosquitto_pub``'s default) was lost before its task ever ran. The
    body of the method's one wrapper (``seam.step``).
    """
    original = BrokerProtocolHandler.handle_publish

    def handle_publish(handler: BrokerProtocolHandler, packet: PublishPacket) -> Coroutine[Any, Any, None]:
        plugin = find_target(handler.plugins_manager)
        topic = packet.topic_name
        if plugin is None or topic is None or packet.data is None:
            return original(handler, packet)
        if is_ecq_topic(topic):
            plugin.take_ecq_write(handler, topic, packet.qos, packet.packet_id, bytes(packet.data))
            return no_op()
        if packet.qos == QOS_1:
            return _route_qos1(handler, packet, plugin.hold_acknowledgement(handler))
        if packet.qos == QOS_2 and packet.packet_id is not None:
            return _route_qos2(handler, packet, plugin.hold_acknowledgement(handler))
        return original(handler, packet)

    step(BrokerProtocolHandler, "handle_publish", body=handle_publish)


async def _route_qos1(handler: BrokerProtocolHandler, packet: PublishPacket,
                      acknowledged: Callable[[Callable[[], None] | None], None]) -> None:
    """amqtt's incoming QoS 1 flow (``_handle_qos1_message_flow``: the message to the broker's delivery queue,
    then PUBACK), with the PUBACK handed to ``acknowledged`` to leave in arrival order (on an MQTT 5 connection it
    ends the PUBLISH's count against the server's Receive Maximum, ``acknowledge_soon``) once the message is routed
    (``flow.count_publishes_read`` counted it): amqtt sent it before the fan-out, so a broker killed just after the
    PUBACK lost a message that an offline persistent session was to keep in the store (MQTT 3.1.1 section 4.3.2:
    the receiver has taken ownership of the message when it sends PUBACK)."""
    message = IncomingApplicationMessage(packet.packet_id, packet.topic_name, QOS_1, packet.data, packet.retain_flag)
    message.publish_packet = packet
    try:
        await handler.session.delivered_message_queue.put(message)
    except BaseException:
        acknowledged(None)
        raise
    puback = functools.partial(acknowledged, functools.partial(acknowledge_soon, handler, QOS_1, packet.packet_id))
    if (routing := getattr(packet, "_ecq_routing", None)) is None:
        puback()
    else:
        routing.inbound.when_routed(routing.seq, puback)


async def _route_qos2(handler: BrokerProtocolHandler, packet: PublishPacket,
                      acknowledged: Callable[[Callable[[], None] | None], None]) -> None:
    """amqtt's incoming QoS 2 flow (``_handle_qos2_message_flow``: the message kept in ``inflight_in``, PUBREC, then
    on PUBREL the message to the broker's delivery queue and PUBCOMP), with the PUBREC handed to ``acknowledged`` to
    leave in arrival order. As in amqtt's flow, a retransmit before the PUBREL replaces the earlier one's wait. On an
    MQTT 5 connection the PUBCOMP ends the PUBLISH's count against the server's Receive Maximum."""
    packet_id = packet.packet_id
    message = IncomingApplicationMessage(packet_id, packet.topic_name, QOS_2, packet.data, packet.retain_flag)
    message.publish_packet = packet
    handler.session.inflight_in[packet_id] = message
    if (earlier := handler._pubrel_waiters.get(packet_id)) is not None:
        earlier.cancel()
    pubrel = handler._pubrel_waiters[packet_id] = asyncio.get_running_loop().create_future()
    acknowledged(functools.partial(acknowledge_soon, handler, QOS_2, packet_id))
    message.pubrel_packet = await pubrel
    del handler._pubrel_waiters[packet_id]
    await handler.session.delivered_message_queue.put(message)
    handler.session.inflight_in.pop(packet_id, None)
    message.pubcomp_packet = PubcompPacket.build(packet_id)
    release_inbound(handler, packet_id)
    send_soon(handler, _ACK.pack(0x70, 2, packet_id))


async def no_op() -> None:
    pass


def release_ecq_qos2_writes() -> None:
    """Answer a PUBREL of an ``$ECQ/`` QoS 2 write (its packet id in :func:`qos2_receipts`) with PUBCOMP, and a
    PUBREL nobody waits for with PUBCOMP too, where amqtt 0.12.1's ``handle_pubrel`` logs it and answers nothing,
    so a client that reconnects between PUBREC and PUBCOMP resent its PUBREL forever (MQTT 3.1.1 section
    4.3.3: the receiver MUST respond to a PUBREL with a PUBCOMP of the same packet id). Not a coroutine function:
    the packet id is released while the reader decodes the PUBREL."""
    original = BrokerProtocolHandler.handle_pubrel

    def handle_pubrel(handler: BrokerProtocolHandler, pubrel: PubrelPacket) -> Coroutine[Any, Any, None]:
        packet_id = pubrel.packet_id
        if find_target(handler.plugins_manager) is None or packet_id in handler._pubrel_waiters:
            return original(handler, pubrel)
        qos2_receipts(handler).pop(packet_id, None)
        release_inbound(handler, packet_id)
        send_soon(handler, _ACK.pack(0x70, 2, packet_id))
        return no_op()

    replace(BrokerProtocolHandler, "handle_pubrel", handle_pubrel)


def qos2_receipts(handler: BrokerProtocolHandler) -> dict[int, asyncio.Future]:
    """The ``$ECQ/`` QoS 2 writes of ``handler``'s session whose PUBREL has not come yet: packet id -> a future
    that resolves to True once the PUBREC is due (stored or refused) or False (the write failed; the id is then
    taken out). Kept on amqtt's Session, so it lasts across a persistent reconnect and ends with a clean session
    (MQTT 3.1.1 section 4.3.3: until PUBREL, a PUBLISH with the same packet id is not a new message)."""
    return kept_on(handler.session, "_ecq_qos2_receipts", dict)


def holds_packet_ids(session: Any) -> bool:
    """True while amqtt's ``session`` holds packet ids a reconnect must see again (MQTT 3.1.1 sections 4.3.3, 4.4): a
    send not yet acknowledged (an ordinary QoS 1/2 message in ``inflight_out``, an ECQ delivery's remembered id, see
    :func:`_delivery_packet_id`) or a QoS 2 PUBLISH of the client awaiting its PUBREL (``inflight_in``, an ECQ
    write's receipt, :func:`qos2_receipts`)."""
    return bool(session.inflight_out or session.inflight_in or session.attributes.get(_SENT_PACKET_IDS)
                or getattr(session, "_ecq_qos2_receipts", None))


def grant_ecq_subscriptions() -> None:
    """Let the plugin's ``grant_subscription`` choose the QoS of a SUBSCRIBE to an ``$ECQ/`` filter, or refuse
    it with SUBACK 0x80, before amqtt's ``Broker.add_subscription`` records it."""

    def grant(broker: Broker, subscription: tuple[str, int], session: Any) -> tuple[Any, ...] | Result | None:
        plugin = find_target(broker.plugins_manager)
        topic_filter, qos = subscription
        if plugin is None or not is_ecq_topic(topic_filter):
            return None
        granted = plugin.grant_subscription(session.client_id, topic_filter, qos)
        return Result(SUBACK_FAILURE) if granted is None else (broker, (topic_filter, granted), session)

    step(Broker, "add_subscription", before=grant)


def accept_ecq_wildcards() -> None:
    """Let an ``$ECQ/`` topic with ``+`` or ``#`` through amqtt's ``PublishVariableHeader``, whose refusal
    mid-decode leaves the payload to be read as the next packet; the plugin refuses such a write itself."""
    original = PublishVariableHeader.__init__

    def header_init(header: PublishVariableHeader, topic_name: str, packet_id: int | None = None) -> None:
        if not is_ecq_topic(topic_name):
            return original(header, topic_name, packet_id)
        MQTTVariableHeader.__init__(header)
        header.topic_name, header.packet_id = topic_name, packet_id

    replace(PublishVariableHeader, "__init__", header_init)


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


def acknowledge_soon(handler: BrokerProtocolHandler, qos: int, packet_id: int | None,
                     refusal: tuple[str, str] | None = None) -> None:
    """Queue (``send_soon``) the acknowledgement of an incoming PUBLISH: PUBACK for QoS 1, PUBREC for QoS 2 (its
    PUBREL is answered by :func:`release_ecq_qos2_writes`); nothing for QoS 0. ``refusal`` is (reason, message)
    of a refused write (``BadWrite``): on an MQTT 5 connection its reason code and Reason String go in the
    acknowledgement (MQTT 5.0 section 3.4.2), and a refused QoS 2 write's flow ends with its PUBREC (section
    4.3.3: no PUBREL follows a PUBREC of 0x80 or above); on 3.1.1 it is acknowledged as a stored write."""
    if qos not in _ACK_TYPES:
        return
    context = context_of(handler)
    if context is not None and (qos == 1 or refusal is not None):
        context.inbound.discard(packet_id)
    if context is None or refusal is None:
        send_soon(handler, _ACK.pack(_ACK_TYPES[qos], 2, packet_id))
        return
    if qos == 2:
        qos2_receipts(handler).pop(packet_id, None)
    send_soon(handler, publish_acknowledgement(context, qos, packet_id, *refusal))


async def publish_qos1(handler: BrokerProtocolHandler, topic: str, payload: bytes, seqno: int | None = None,
                       ts_ms: int | None = None, expires_ms: int = 0, dup: bool = False,
                       topic_filter: str | None = None) -> None:
    """Send a QoS 1 PUBLISH on ``handler`` and wait for its PUBACK for as long as the connection lives. On an
    MQTT 5 connection it carries the User Properties ``ecq-seqno`` and ``ecq-ts`` (the message's seqno and
    publish time in Unix ms, when given), for an entry that expires at ``expires_ms`` (Unix ms, 0: never)
    the Message Expiry Interval left (MQTT 5.0 section 3.3.2.3.3), and the Subscription Identifier of the
    subscription the delivery answers (section 3.3.4): ``topic_filter``, an SCQ group's
    ``$share/<group>/$SCQ/<queue>/#``, or by default the queue's (ecq.queue.topics.reading_filter). DUP is 1 when
    ``dup`` or when this session sent entry ``seqno`` before, whose packet id it then reuses
    (:func:`_delivery_packet_id`).

    amqtt's own ``mqtt_publish`` gives up after a fixed 5 s and forgets the packet id, so under load a
    late PUBACK was lost and the resend added more load. MQTT 3.1.1 section 4.4 resends unacknowledged
    PUBLISHes only when the client reconnects, which is what ECQ's redelivery does.
    On an MQTT 5 connection the send waits for room in the connection's one window of the client's Receive Maximum
    (MQTT 5.0 section 4.9), which every queue the connection reads and its ordinary topics share (the semaphore is
    FIFO, so one queue's deliveries keep their order).
    Raises ConnectionError when the connection is closed or closes before the PUBACK.
    """
    if (context := context_of(handler)) is None:
        return await _publish_qos1(handler, topic, payload, seqno, ts_ms, expires_ms, dup, topic_filter)
    async with context.window():
        return await _publish_qos1(handler, topic, payload, seqno, ts_ms, expires_ms, dup, topic_filter)


async def _publish_qos1(handler: BrokerProtocolHandler, topic: str, payload: bytes, seqno: int | None,
                        ts_ms: int | None, expires_ms: int, dup: bool, topic_filter: str | None) -> None:
    if not connection_is_open(handler):
        raise ConnectionError("connection closed")
    session = handler.session
    packet_id, sent_before = _delivery_packet_id(session, seqno, topic)
    dup = dup or sent_before
    message = OutgoingApplicationMessage(packet_id, topic, QOS_1, payload, False)
    puback = asyncio.get_running_loop().create_future()
    session.inflight_out[packet_id] = message  # keeps the packet id taken until the PUBACK
    handler._puback_waiters[packet_id] = puback  # amqtt's handle_puback resolves it; stop() cancels it
    try:
        if context_of(handler) is None:
            send_soon(handler, message.build_publish_packet(dup=dup).to_bytes())
        else:
            send_soon(handler, _mqtt5_delivery(session, packet_id, topic, payload, seqno, ts_ms, expires_ms, dup,
                                               topic_filter))
        await puback
        _sent_packet_ids(session).pop((topic, seqno), None)
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            if connection_is_open(handler):  # the consumer forgot this send (a rewind): the client still holds its id
                _sent_packet_ids(session).pop((topic, seqno), None)
            raise
        raise ConnectionError("connection closed while waiting for PUBACK") from None
    finally:
        handler._puback_waiters.pop(packet_id, None)
        if session.inflight_out.get(packet_id) is message:  # a resend on a newer connection may hold the id now
            del session.inflight_out[packet_id]


def delivery_fits(handler: BrokerProtocolHandler, topic_filter: str | None = None
                  ) -> Callable[[str, Message], bool] | None:
    """For an MQTT 5 connection that announced a Maximum Packet Size, a test of whether the delivery PUBLISH of a
    queue entry to a topic stays within it (its exact encoding, as :func:`publish_qos1` sends it with
    ``topic_filter``'s Subscription Identifier; MQTT 5.0 section 3.1.2.11.4, MQTT-3.1.2-24: a larger packet is not
    sent); None when every delivery fits (3.1.1: no limit)."""
    context = context_of(handler)
    if context is None or context.maximum_packet_size is None:
        return None
    session = handler.session
    return lambda topic, entry: context.fits(_mqtt5_delivery(session, 1, topic, entry.payload, entry.seqno,
                                                             entry.ts_ms, entry.expires_ms, False, topic_filter))


def _mqtt5_delivery(session: Any, packet_id: int, topic: str, payload: bytes, seqno: int | None, ts_ms: int | None,
                    expires_ms: int, dup: bool, topic_filter: str | None = None) -> bytes:
    """The v5 PUBLISH of a delivery, with the Subscription Identifier of the session's ``topic_filter`` (None: its
    ``$ECQ/<clientid>/#`` or ``$SCQ/<queue>/#``, ecq.queue.topics.reading_filter)."""
    subscription = subscriptions_of(session).get(topic_filter or reading_filter(topic))
    ids = (subscription.subscription_id,) if subscription and subscription.subscription_id else ()
    return delivery(packet_id, topic, payload, seqno, ts_ms, expires_ms, dup, ids)


def _sent_packet_ids(session: Any) -> dict[tuple[str, int], int]:
    """(topic, seqno) -> packet id of the deliveries ``session`` sent and got no PUBACK for, oldest first (made
    empty); by topic too, since a session reading SCQs besides its own queue gets entries of several queues."""
    return session.attributes.setdefault(_SENT_PACKET_IDS, {})


def _delivery_packet_id(session: Any, seqno: int | None, topic: str) -> tuple[int, bool]:
    """(the packet id of a delivery of entry ``seqno`` on ``topic`` on amqtt's ``session``, True when the session sent
    it before).

    A resend keeps the packet id of the first send (MQTT 3.1.1 section 4.4, MQTT-4.4.0-1) while amqtt's Session
    lives: a persistent session on this broker. A clean session, a broker restart or another cluster node has
    none to remember: a new id (DUP still comes from the consumer, ``ecq.queue.delivery``). An id another message
    took meanwhile is not reused, nor one whose send the consumer forgot while the connection was open (a rewind:
    the client still holds that id). At most REMEMBERED_PACKET_IDS are kept (the oldest forgotten): entries never
    sent again (compacted, expired, rewound past) would otherwise stay forever."""
    sent = _sent_packet_ids(session)
    packet_id = sent.pop((topic, seqno), None)
    sent_before = packet_id is not None
    if packet_id is None or packet_id in session.inflight_out or packet_id in session.inflight_in:
        packet_id = session.next_packet_id
    if seqno is not None:
        sent[topic, seqno] = packet_id
        if len(sent) > REMEMBERED_PACKET_IDS:
            del sent[next(iter(sent))]
    return packet_id, sent_before


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
