"""The packet reader of an MQTT 5.0 connection (one whose CONNECT ``mqtt5_edge`` translated): ECQ's framer with
each packet decoded by the ``mqtt5`` codec, then taken by ECQ's fast path or handed to amqtt 0.12.1 as the
equivalent 3.1.1 packet, which amqtt's decoders (and ``bad_clients``' checks) read.

- a PUBLISH under ``$ECQ/`` goes to the plugin's ``take_ecq_write``, as on 3.1.1; any other PUBLISH reaches amqtt
  as 3.1.1 (its properties are not carried); a Topic Alias is refused with DISCONNECT 0x94 (CONNACK announced
  Topic Alias Maximum 0, MQTT 5.0 section 3.3.2.3.4);
- PUBACK, PUBREC, PUBREL, PUBCOMP: their packet id (a reason code and properties are read and dropped);
- SUBSCRIBE: a malformed ``$share/`` filter is refused with 0x8F, one on ``$ECQ/`` with 0x9E (``shared_subscriptions``),
  a Subscription Identifier with 0xA1, and No Local, Retain As Published or a Retain Handling other than 0 with 0x83
  (amqtt has none of them, section 3.8.3.1); the other filters reach amqtt, and ``mqtt5_edge`` puts the codes back
  in place in the SUBACK;
- DISCONNECT: reason 0x04 (Disconnect with Will Message) keeps the Will, as a connection lost does; any other
  drops it (section 3.14.2.1);
- AUTH: DISCONNECT 0x82 Protocol Error, then close (no CONNECT had an Authentication Method, which ECQ refuses
  with CONNACK 0x8C; section 4.12: an AUTH without one is a Protocol Error; 0x8C is no DISCONNECT reason code);
- a packet that does not decode, or breaks a rule of ``bad_clients``: DISCONNECT 0x81 (0x95 for one above
  ``max_packet_bytes``), then close (section 4.13).

:func:`read_mqtt5_with_the_framer` picks this reader for every v5 connection, over TCP or WebSocket, whatever
``fast_path`` says: amqtt's own reader reads 3.1.1 only.
"""

from __future__ import annotations

import asyncio
from typing import Any

import mqtt5
from amqtt.adapters import StreamReaderAdapter
from amqtt.mqtt.packet import (CONNECT, DISCONNECT, PINGREQ, PUBACK, PUBCOMP, PUBLISH, PUBREC, PUBREL, RESERVED_15,
                               SUBSCRIBE, UNSUBSCRIBE)
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

from ecq.broker.amqtt_hooks.bad_clients import (ProtocolViolation, checked_connection, fixed_header_violation,
                                                publish_violation, utf8_or_violation, violation)
from ecq.broker.amqtt_hooks.ecq_paths import client_id, send_soon
from ecq.broker.amqtt_hooks.framer import Framer
from ecq.broker.amqtt_hooks.mqtt5_packets import (MALFORMED_PACKET, PACKET_TOO_LARGE,
                                                  PROTOCOL_ERROR, TOPIC_ALIAS_INVALID, MalformedPacket, context_of,
                                                  decode, disconnect, mqtt_string, remaining_length)
from ecq.broker.amqtt_hooks.shared_subscriptions import v5_refusal
from ecq.broker.amqtt_hooks.target import find_target
from ecq.queue.topics import is_ecq_topic, queue_filter

_ACKS = (PUBACK, PUBREC, PUBREL, PUBCOMP)
_WITH_WILL = 0x04
IDS_NOT_SUPPORTED, OPTIONS_NOT_SUPPORTED = 0xA1, 0x83
NOT_AUTHORIZED, UNSPECIFIED_ERROR = 0x87, 0x80


def read_mqtt5_with_the_framer() -> None:
    """Read v5 connections with :class:`Mqtt5Framer` in place of amqtt 0.12.1's
    ``BrokerProtocolHandler._reader_loop`` (which decodes 3.1.1 only), on TCP and WebSocket listeners of brokers
    that run the ECQ plugin; every other connection keeps the reader it had."""
    original = BrokerProtocolHandler._reader_loop

    async def reader_loop(handler: BrokerProtocolHandler) -> None:
        plugin = find_target(handler.plugins_manager)
        if plugin is None or context_of(handler) is None or checked_connection(handler.reader) is None:
            return await original(handler)
        await Mqtt5Framer(handler, plugin).run()

    BrokerProtocolHandler._reader_loop = reader_loop


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
        self._disconnect_sent = False

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

    def _refuse(self, code: int) -> None:
        """Write DISCONNECT ``code`` now (once): the reader's exit closes the connection after it."""
        if not self._disconnect_sent and self._handler.writer is not None:
            self._disconnect_sent = True
            self._handler.writer.write(disconnect(code))

    def _decode(self, first: int, body: bytes) -> Any:
        """The mqtt5 packet of a fixed header's first byte and ``body``; ProtocolViolation when it is malformed."""
        try:
            return decode(bytes((first,)) + remaining_length(len(body)) + body)
        except MalformedPacket as exc:
            raise violation(self._packets, f"MQTT 5 packet that does not decode ({exc})") from None

    def _take_ecq_publish(self, data: bytes, first: int, body: int, end: int) -> bool:
        """Take a v5 PUBLISH under ``$ECQ/`` (as Framer does); any other is kept for :meth:`_hand_to_amqtt` (False).
        Raises ProtocolViolation: malformed, a Topic Alias (after DISCONNECT 0x94), bad_clients' PUBLISH rules
        (topic length, UTF-8, NUL, wildcards, packet id 0)."""
        self._check_topic(data, first, body, end)
        packet = self._decode(first, data[body:end])
        if packet.topic_alias is not None:
            self._refuse(TOPIC_ALIAS_INVALID)
            raise violation(self._packets, "PUBLISH with a Topic Alias: CONNACK announced Topic Alias Maximum 0 "
                                           "[MQTT-3.3.2-9]")
        topic, qos = packet.topic, int(packet.qos)
        if "\x00" in topic:
            raise violation(self._packets, "PUBLISH topic with U+0000 [MQTT-1.5.4-2]")
        if (reason := publish_violation(topic, packet.packet_id)) is not None:
            self._refuse(PROTOCOL_ERROR)
            raise violation(self._packets, reason)
        if not is_ecq_topic(topic):
            self._publish = packet
            return False
        self._plugin.take_ecq_write(self._handler, topic, qos, packet.packet_id, packet.payload)
        return True

    def _check_topic(self, data: bytes, first: int, body: int, end: int) -> None:
        """bad_clients' rules on a PUBLISH's topic before the codec reads it (the topic comes first in both versions,
        MQTT 5.0 section 3.3.2.1): a topic running past the packet, ill-formed UTF-8 (on which mqtt5 0.8.0 panics).
        Raises ProtocolViolation."""
        topic_end = self._topic_end(data, first >> 1 & 0x03, body, end)
        utf8_or_violation(self._packets, data[body + 2:topic_end], "PUBLISH topic")

    async def _hand_to_amqtt(self, first: int, body: bytes) -> None:
        """Hand a v5 packet to amqtt as its 3.1.1 equivalent (see the module's docstring)."""
        kind = first >> 4
        if kind == PUBLISH:
            packet, self._publish = self._publish, None
            return await super()._hand_to_amqtt(first, _publish_body(packet))
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
            self._context.unsubscribes[packet.packet_id] = len(packet.patterns)
            await super()._hand_to_amqtt(first, packet.packet_id.to_bytes(2, "big") + b"".join(
                mqtt_string(pattern.encode()) for pattern in packet.patterns))
        elif kind == DISCONNECT and packet.reason_code == _WITH_WILL:
            await self._handle(first, None)  # amqtt publishes the Will of a connection that ends without DISCONNECT
        elif kind == DISCONNECT:
            await super()._hand_to_amqtt(first, b"")
        else:
            self._refuse(PROTOCOL_ERROR)
            raise violation(self._packets, f"a packet of type {kind} a server does not take")

    async def _subscribe(self, packet: Any) -> None:
        """A v5 SUBSCRIBE: the filters amqtt can carry go to it as a 3.1.1 SUBSCRIBE; the others are refused in the
        SUBACK (MQTT 5.0 section 3.9.3), sent at once when no filter is left for amqtt."""
        decided, kept = [], []
        for topic_filter in packet.topic_filters:
            code = _refusal(topic_filter, packet.subscription_id)
            if code is not None:
                decided.append((False, code))
                continue
            kept.append(topic_filter)
            own = topic_filter.pattern == queue_filter(client_id(self._handler) or "")
            foreign_queue = is_ecq_topic(topic_filter.pattern) and not own
            decided.append((True, NOT_AUTHORIZED if foreign_queue else UNSPECIFIED_ERROR))
        if not kept:
            codes = [mqtt5.SubAckReasonCode(code) for _, code in decided]
            send_soon(self._handler, mqtt5.SubAckPacket(packet.packet_id, codes).write())
            return
        self._context.subscribes[packet.packet_id] = decided
        await super()._hand_to_amqtt(0x82, packet.packet_id.to_bytes(2, "big") + b"".join(
            mqtt_string(f.pattern.encode()) + bytes((int(f.max_qos),)) for f in kept))


def _refusal(topic_filter: Any, subscription_id: int | None) -> int | None:
    """The SUBACK code of a v5 filter amqtt cannot carry, or None (MQTT 5.0 sections 3.8.3.1, 4.8.2)."""
    if (code := v5_refusal(topic_filter.pattern)) is not None:
        return code
    if subscription_id is not None:
        return IDS_NOT_SUPPORTED
    if (topic_filter.no_local or topic_filter.retain_as_published
            or topic_filter.retain_handling != mqtt5.RetainHandling.SEND_ALWAYS):
        return OPTIONS_NOT_SUPPORTED
    return None


def _publish_body(packet: Any) -> bytes:
    """The 3.1.1 body of a v5 PUBLISH (topic, packet id at QoS 1 and 2, payload; MQTT 3.1.1 section 3.3)."""
    packet_id = packet.packet_id.to_bytes(2, "big") if int(packet.qos) else b""
    return mqtt_string(packet.topic.encode()) + packet_id + packet.payload
