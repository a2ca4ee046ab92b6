"""The packet reader of an MQTT 5.0 connection (one whose CONNECT ``mqtt5_edge`` translated): ECQ's framer with
each packet decoded by the ``mqtt5`` codec, then taken by ECQ's fast path or handed to amqtt 0.12.1 as the
equivalent 3.1.1 packet, which amqtt's decoders (and ``bad_clients``' checks) read.

- a PUBLISH under ``$ECQ/`` goes to the plugin's ``take_ecq_write``, as on 3.1.1; any other PUBLISH reaches amqtt
  as an amqtt PublishPacket whose payload carries the v5 properties (``mqtt5_messages.Mqtt5Payload``); a Topic
  Alias is resolved per connection (MQTT 5.0 section 3.3.2.3.4); more than ``receive_maximum`` QoS 1/2 PUBLISHes
  unacknowledged get DISCONNECT 0x93 (section 3.3.4);
- PUBACK, PUBREC, PUBREL, PUBCOMP: their packet id (a reason code and properties are read and dropped);
- SUBSCRIBE: a malformed ``$share/`` filter is refused with 0x8F, one on ``$ECQ/`` with 0x9E
  (``shared_subscriptions``), No Local on a shared subscription is a Protocol Error (0x82); the other filters reach
  amqtt with their options and Subscription Identifier kept (``mqtt5_routing.subscribed``), and ``mqtt5_edge``
  puts the codes back in place in the SUBACK; UNSUBSCRIBE: its UNSUBACK codes (``mqtt5_routing.unsubscribed``);
- DISCONNECT: its Session Expiry Interval applies (``mqtt5_sessions.take_disconnect_expiry``; a non-zero one after
  a CONNECT's 0 is a Protocol Error, 0x82); reason 0x04 (Disconnect with Will Message) keeps the Will, as a
  connection lost does; any other drops it (section 3.14.2.1);
- AUTH: DISCONNECT 0x82 Protocol Error, then close (no CONNECT had an Authentication Method, which ECQ refuses
  with CONNACK 0x8C; section 4.12: an AUTH without one is a Protocol Error; 0x8C is no DISCONNECT reason code);
- a packet that does not decode, or breaks a rule of ``bad_clients``: DISCONNECT 0x81 (0x95 for one above
  ``max_packet_bytes``, 0x94 for a Topic Alias of 0, 0x82 for what MQTT 5.0 calls a Protocol Error: a property
  given twice, a Subscription Identifier of 0, ..., ``mqtt5_packets.MalformedPacket``; 0x95 for properties beyond
  ``max_properties_bytes`` or ``max_user_properties``, ``mqtt5_properties``), then close (section 4.13), after a
  linger that lets the client read it (:meth:`_linger`).

:func:`read_mqtt5_with_the_framer` picks this reader for every v5 connection, over TCP or WebSocket, whatever
``fast_path`` says: amqtt's own reader reads 3.1.1 only.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import mqtt5
from amqtt.adapters import StreamReaderAdapter, StreamWriterAdapter
from amqtt.mqtt.packet import (CONNECT, DISCONNECT, PINGREQ, PUBACK, PUBCOMP, PUBLISH, PUBREC, PUBREL, RESERVED_15,
                               SUBSCRIBE, UNSUBSCRIBE)
from amqtt.codecs_amqtt import encode_data_with_length
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.publish import PublishPacket

from ecq.broker.amqtt_hooks.bad_clients import (ProtocolViolation, checked_connection, fixed_header_violation,
                                                publish_violation, utf8_or_violation, violation)
from ecq.broker.amqtt_hooks.ecq_paths import client_id, send_soon
from ecq.broker.amqtt_hooks.framer import READ_SIZE, Framer
from ecq.broker.amqtt_hooks.mqtt5_messages import payload_of
from ecq.broker.amqtt_hooks.mqtt5_packets import (MALFORMED_PACKET, PACKET_TOO_LARGE, PROTOCOL_ERROR,
                                                  RECEIVE_MAXIMUM_EXCEEDED, TOPIC_ALIAS_INVALID, MalformedPacket,
                                                  context_of, decode, remaining_length)
from ecq.broker.amqtt_hooks.mqtt5_routing import subscribed, unsubscribed
from ecq.broker.amqtt_hooks.mqtt5_sessions import take_disconnect_expiry, tell
from ecq.broker.amqtt_hooks.seam import Instead, step
from ecq.broker.amqtt_hooks.shared_subscriptions import share_target, v5_refusal
from ecq.queue.groups import parse_group_filter
from ecq.broker.amqtt_hooks.target import find_target
from ecq.queue.topics import is_ecq_topic, is_scq_topic, queue_filter

_ACKS = (PUBACK, PUBREC, PUBREL, PUBCOMP)
_WITH_WILL = 0x04
LINGER_S = 2.0  # how long a connection refused with DISCONNECT waits for the client to close (see _linger)
LINGER_IDLE_S = 0.2  # ... or for the client to stop sending
_lingering: set[asyncio.Task] = set()  # the tasks of _linger, kept from the garbage collector
NOT_AUTHORIZED, UNSPECIFIED_ERROR = 0x87, 0x80


def read_mqtt5_with_the_framer() -> None:
    """Read v5 connections with :class:`Mqtt5Framer` in place of amqtt 0.12.1's
    ``BrokerProtocolHandler._reader_loop`` (which decodes 3.1.1 only), on TCP and WebSocket listeners of brokers
    that run the ECQ plugin; every other connection keeps the reader it had."""

    def read_a_v5_connection(handler: BrokerProtocolHandler) -> Instead | None:
        plugin = find_target(handler.plugins_manager)
        if plugin is None or context_of(handler) is None or checked_connection(handler.reader) is None:
            return None
        return Instead(Mqtt5Framer(handler, plugin).run())

    step(BrokerProtocolHandler, "_reader_loop", before=read_a_v5_connection)


def mqtt5_header_violation(packet_type: int, flags: int, remaining_length: int, max_packet_bytes: int) -> str | None:
    """``bad_clients.fixed_header_violation`` with MQTT 5.0's lengths: PUBACK to PUBCOMP carry a reason code and
    properties after their packet id (2 bytes or more), DISCONNECT may have a body (MQTT 5.0 sections 3.4-3.7,
    3.14), AUTH is a packet type (refused once read)."""
    if remaining_length <= max_packet_bytes:
        if packet_type in _ACKS and remaining_length >= 2:
            remaining_length = 2
        elif packet_type == DISCONNECT:
            remaining_length = 0
    return fixed_header_violation(packet_type, flags, remaining_length, max_packet_bytes)


class _WebSocketStream:
    """``read``/``readexactly`` over amqtt's WebSocket reader adapter, for the framer: ``read(n)`` returns what the
    last WebSocket message left, at least one byte, b"" at the end of the stream."""

    def __init__(self, adapter: Any) -> None:
        self._adapter = adapter

    async def read(self, n: int) -> bytes:
        first = await self._adapter.read(1)
        return first + self._adapter._stream.read(n - 1) if first else first

    async def readexactly(self, n: int) -> bytes:
        data = await self._adapter.read(n)
        if len(data) < n:
            raise asyncio.IncompleteReadError(data, n)
        return data


class Mqtt5Framer(Framer):
    """ECQ's framer on a v5 connection: reads as :class:`Framer` does, decodes each packet as MQTT 5.0."""

    _header_violation = staticmethod(mqtt5_header_violation)

    def __init__(self, handler: BrokerProtocolHandler, plugin: Any) -> None:
        super().__init__(handler, plugin)
        self._context = context_of(handler)
        self._publish: Any = None  # a PUBLISH decoded by _take_ecq_publish that amqtt is to handle

    @staticmethod
    def _byte_stream(adapter: Any) -> Any:
        return adapter._reader if isinstance(adapter, StreamReaderAdapter) else _WebSocketStream(adapter)

    async def _cut(self, data: bytes) -> bytes:
        """Framer's ``_cut``; a protocol violation is told to the client with DISCONNECT (0x95 for a packet above
        ``max_packet_bytes``, else 0x81 Malformed Packet) before the connection closes (MQTT 5.0 section 4.13)."""
        try:
            return await super()._cut(data)
        except ProtocolViolation as exc:
            self._refuse(PACKET_TOO_LARGE if "above max_packet_bytes" in str(exc) else MALFORMED_PACKET)
            raise

    async def _read(self) -> None:
        """Framer's ``_read``; after a server DISCONNECT, :func:`_linger` keeps the socket while the connection ends."""
        try:
            await super()._read()
        except ProtocolViolation:
            if self._context.session.disconnect_sent:
                _linger(self._handler.writer)
            raise

    def _refuse(self, code: int) -> None:
        """Write DISCONNECT ``code`` now, unless the connection had one (``mqtt5_sessions.tell``): the reader's exit
        closes the connection after it."""
        tell(self._handler, code)

    def _decode(self, first: int, body: bytes) -> Any:
        """The mqtt5 packet of a fixed header's first byte and ``body``; ProtocolViolation after DISCONNECT with the
        code of what is wrong with it (``MalformedPacket.code``: 0x81, 0x82 Protocol Error, 0x94, 0x95 for properties
        beyond the broker's bounds)."""
        try:
            return decode(bytes((first,)) + remaining_length(len(body)) + body, self._context.property_bounds)
        except MalformedPacket as exc:
            self._refuse(exc.code)
            raise violation(self._packets, f"MQTT 5 packet that does not decode ({exc})") from None

    def _take_ecq_publish(self, data: bytes, first: int, body: int, end: int) -> bool:
        """Take a v5 PUBLISH under ``$ECQ/`` (as Framer does), with its Message Expiry Interval, which is stored with
        the entry (MQTT 5.0 section 3.3.2.3.3); any other is kept for :meth:`_hand_to_amqtt` (False).
        Raises ProtocolViolation: malformed, a bad Topic Alias (:meth:`_topic_of`), a Subscription Identifier,
        bad_clients' PUBLISH rules (topic length, UTF-8, NUL, wildcards, packet id 0)."""
        self._check_topic(data, first, body, end)
        packet = self._decode(first, data[body:end])
        topic, qos = self._topic_of(packet), int(packet.qos)
        if packet.subscription_ids:
            self._refuse(PROTOCOL_ERROR)
            raise violation(self._packets, "PUBLISH from a client with a Subscription Identifier [MQTT-3.3.4-6]")
        if (reason := publish_violation(topic, packet.packet_id)) is not None:
            self._refuse(PROTOCOL_ERROR)
            raise violation(self._packets, reason)
        if qos and not self._context.receive(packet.packet_id):
            self._refuse(RECEIVE_MAXIMUM_EXCEEDED)
            raise violation(self._packets, f"more than the Receive Maximum of {self._context.server_receive_maximum} "
                                           "QoS 1 and 2 PUBLISHes unacknowledged (MQTT 5.0 section 3.3.4)")
        if not is_ecq_topic(topic):
            self._publish = (packet, topic)
            return False
        self._plugin.take_ecq_write(self._handler, topic, qos, packet.packet_id, packet.payload,
                                    packet.message_expiry_interval or 0)
        return True

    def _topic_of(self, packet: Any) -> str:
        """The topic of a v5 PUBLISH: its Topic Name, which a Topic Alias then stands for on this connection, or the
        topic its Topic Alias stands for when the name is empty (MQTT 5.0 section 3.3.2.3.4). Raises
        ProtocolViolation after DISCONNECT 0x94 for an alias above ``topic_alias_maximum`` (announced in
        CONNACK), 0x82 for an empty topic with an alias no PUBLISH set."""
        alias = packet.topic_alias
        if alias is None:
            return packet.topic
        if alias > (most := self._context.server_topic_alias_maximum):
            self._refuse(TOPIC_ALIAS_INVALID)
            raise violation(self._packets, f"PUBLISH with Topic Alias {alias}, above the Topic Alias Maximum "
                                           f"{most} of CONNACK [MQTT-3.3.2-9]")
        if packet.topic:
            self._context.aliases_in[alias] = packet.topic
            return packet.topic
        topic = self._context.aliases_in.get(alias)
        if topic is None:
            self._refuse(PROTOCOL_ERROR)
            raise violation(self._packets, f"PUBLISH with an empty topic and Topic Alias {alias}, which no PUBLISH "
                                           "set on this connection (section 3.3.2.3.4)")
        return topic

    def _check_topic(self, data: bytes, first: int, body: int, end: int) -> None:
        """bad_clients' rules on a PUBLISH's topic before the codec reads it (the topic comes first in both versions,
        MQTT 5.0 section 3.3.2.1): a topic running past the packet, ill-formed UTF-8 (on which mqtt5 0.8.0 panics),
        U+0000 (section 1.5.4). Raises ProtocolViolation."""
        topic_end = self._topic_end(data, first >> 1 & 0x03, body, end)
        utf8_or_violation(self._packets, data[body + 2:topic_end], "PUBLISH topic")

    async def _hand_to_amqtt(self, first: int, body: bytes) -> None:
        """Hand a v5 packet to amqtt as its 3.1.1 equivalent (see the module's docstring)."""
        kind = first >> 4
        if kind == PUBLISH:
            (packet, topic), self._publish = self._publish, None
            payload = payload_of(packet, client_id(self._handler))
            return await self._handle(first, PublishPacket.build(topic, payload, packet.packet_id,
                                                                 packet.duplicate, int(packet.qos), packet.retain))
        if kind == PINGREQ:
            return await super()._hand_to_amqtt(first, body)
        if kind == RESERVED_15:
            self._refuse(PROTOCOL_ERROR)
            raise violation(self._packets, "AUTH without an Authentication Method in CONNECT [MQTT-4.12.0-6]")
        if kind == CONNECT:
            self._refuse(PROTOCOL_ERROR)
            raise violation(self._packets, "a second CONNECT [MQTT-3.1.0-2]")
        packet = self._decode(first, body)
        if kind in _ACKS:
            packet_id = packet.packet_id.to_bytes(2, "big")
            if kind != PUBACK or not self._resolve_ecq_puback(packet_id, 0):
                await super()._hand_to_amqtt(first, packet_id)
        elif kind == SUBSCRIBE:
            await self._subscribe(packet)
        elif kind == UNSUBSCRIBE:
            self._context.unsubscribes[packet.packet_id] = unsubscribed(self._handler.session, packet.patterns)
            await super()._hand_to_amqtt(first, packet.packet_id.to_bytes(2, "big") + b"".join(
                encode_data_with_length(pattern.encode()) for pattern in packet.patterns))
        elif kind == DISCONNECT and not take_disconnect_expiry(self._context, packet):
            self._refuse(PROTOCOL_ERROR)
            raise violation(self._packets, "DISCONNECT with a Session Expiry Interval after a CONNECT without one "
                                           "[MQTT-3.14.2-2]")
        elif kind == DISCONNECT and packet.reason_code == _WITH_WILL:
            await self._handle(first, None)  # amqtt publishes the Will of a connection that ends without DISCONNECT
        elif kind == DISCONNECT:
            await super()._hand_to_amqtt(first, b"")
        else:
            self._refuse(PROTOCOL_ERROR)
            raise violation(self._packets, f"a packet of type {kind} a server does not take")

    async def _subscribe(self, packet: Any) -> None:
        """A v5 SUBSCRIBE: the filters amqtt can carry go to it as a 3.1.1 SUBSCRIBE, their options and
        Subscription Identifier kept for the deliveries (``mqtt5_routing``), with why ECQ refuses an ``$ECQ/`` one
        for the SUBACK's Reason String, unless the client asked for no problem information (section 3.9.2.1.2); the
        others are refused in the SUBACK (MQTT 5.0 section 3.9.3), sent at once when no filter is left for amqtt."""
        decided, kept, reasons = [], [], []
        for topic_filter in packet.topic_filters:
            if topic_filter.no_local and topic_filter.pattern.startswith("$share/"):
                self._refuse(PROTOCOL_ERROR)
                raise violation(self._packets, "No Local on a shared subscription [MQTT-3.8.3-4]")
            code = v5_refusal(topic_filter.pattern)
            if code is not None:
                decided.append((False, code))
                continue
            kept.append(topic_filter)
            subscribed(self._handler, topic_filter, packet.subscription_id)
            pattern, clientid = topic_filter.pattern, client_id(self._handler) or ""
            if parse_group_filter(pattern) is not None:  # an SCQ's shared group: judged as the $SCQ/ filter it reads
                pattern = share_target(pattern)
            reason = self._plugin.subscription_refusal(clientid, pattern, int(topic_filter.max_qos)) \
                if is_ecq_topic(pattern) else None
            # refused, another client's queue, or an SCQ the ACL denies, is 0x87; a refused form or QoS of one's own
            # queue or of an SCQ, 0x80
            not_authorized = pattern != queue_filter(clientid) if not is_scq_topic(pattern) else reason is None
            decided.append((True, NOT_AUTHORIZED if is_ecq_topic(pattern) and not_authorized else UNSPECIFIED_ERROR))
            if reason:
                reasons.append(reason)
        if not kept:
            codes = [mqtt5.SubAckReasonCode(code) for _, code in decided]
            send_soon(self._handler, mqtt5.SubAckPacket(packet.packet_id, codes).write())
            return
        self._context.subscribes[packet.packet_id] = decided
        if reasons and self._context.problem_information:
            self._context.subscribe_reasons[packet.packet_id] = "; ".join(reasons)
        await super()._hand_to_amqtt(0x82, packet.packet_id.to_bytes(2, "big") + b"".join(
            encode_data_with_length(f.pattern.encode()) + bytes((int(f.max_qos),)) for f in kept))


def _linger(writer: Any) -> None:
    """After a server DISCONNECT on TCP: shut the sending side once the DISCONNECT is written (FIN) and keep the
    socket open on a duplicate descriptor, discarding what the client still sends until it closes, sends nothing for
    :data:`LINGER_IDLE_S`, or :data:`LINGER_S` at most. Closing a socket with unread bytes sends a reset, which makes
    the client lose the DISCONNECT unread and fail its next write (MQTT 5.0 section 4.13: the client is to learn
    the reason). The connection itself (session, handler) ends at once, as without the linger."""
    if not isinstance(writer, StreamWriterAdapter):
        return
    transport = writer._writer.transport
    raw = transport.get_extra_info("socket")
    if transport.is_closing() or raw is None or not transport.can_write_eof():
        return
    transport.write_eof()
    held = socket.socket(fileno=os.dup(raw.fileno()))
    held.setblocking(False)
    task = asyncio.ensure_future(_discard_until_closed(held))
    _lingering.add(task)
    task.add_done_callback(_lingering.discard)


async def _discard_until_closed(held: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(LINGER_S):
            while await asyncio.wait_for(loop.sock_recv(held, READ_SIZE), LINGER_IDLE_S):
                pass
    except (TimeoutError, OSError):
        pass
    finally:
        held.close()


