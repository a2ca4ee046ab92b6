"""MQTT 5.0 connections served by amqtt 0.12.1, which speaks MQTT 3.1.1 only, translated at the connection edge.

amqtt's ``BrokerProtocolHandler.init_from_connect`` reads the CONNECT and answers any protocol level but 4 with
CONNACK 0x01 (unacceptable protocol version). For a broker that runs the ECQ plugin:

- :func:`translate_level_5_connects` peeks at the first packet's protocol level before amqtt reads it. Level 4
  (and anything that is no CONNECT) is handed to amqtt as it came, byte for byte; a level 5 CONNECT is decoded
  with ``mqtt5`` and handed to amqtt as the equivalent 3.1.1 CONNECT (MQTT 5.0 section 3.1), and the
  connection keeps an ``mqtt5_packets.Mqtt5Context``;
- :func:`send_mqtt5_packets`: every packet amqtt sends on a v5 connection (``ProtocolHandler._send_packet``) is
  encoded as MQTT 5.0: CONNACK with ECQ's properties, SUBACK and UNSUBACK with reason codes, PUBLISH.
  PUBACK, PUBREC, PUBREL, PUBCOMP and PINGRESP are the same bytes in both versions.

The packets a v5 client sends after its CONNECT are read by ``mqtt5_framer.Mqtt5Framer``; ECQ's own packets
(write acknowledgements, deliveries) are encoded by ``ecq_paths`` with ``mqtt5_packets``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import mqtt5
from amqtt.adapters import ReaderAdapter, WriterAdapter
from amqtt.errors import AMQTTError
from amqtt.mqtt.connack import ConnackPacket
from amqtt.codecs_amqtt import encode_data_with_length
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.puback import PubackPacket
from amqtt.mqtt.pubcomp import PubcompPacket
from amqtt.mqtt.suback import SubackPacket
from amqtt.mqtt.unsuback import UnsubackPacket

from ecq.broker.amqtt_hooks.bad_clients import (checked_connection, fixed_header_violation, share_checks,
                                               stop_sharing_checks, violation)
from ecq.broker.amqtt_hooks.mqtt5_messages import publish_bytes
from ecq.broker.amqtt_hooks.mqtt5_packets import (BAD_AUTHENTICATION_METHOD, MALFORMED_PACKET, PACKET_TOO_LARGE,
                                                  MalformedPacket, Mqtt5Context, context_of, decode, remaining_length,
                                                  set_context)
from ecq.broker.amqtt_hooks.mqtt5_properties import PropertyBounds
from ecq.broker.amqtt_hooks.mqtt5_sessions import connack_properties, session_options
from ecq.broker.amqtt_hooks.seam import replace, step
from ecq.broker.amqtt_hooks.target import find_target

log = logging.getLogger(__name__)

LEVEL_5 = 5
_CONNECT_FIRST_BYTE = 0x10
_LONGEST_PROTOCOL_NAME = 6  # "MQIsdp" (MQTT 3.1); "MQTT" from 3.1.1 on
# a 3.1.1 CONNACK return code (section 3.2.2.3) -> the MQTT 5.0 CONNACK reason code (section 3.2.2.2)
_CONNACK_CODES = {1: 0x84, 2: 0x85, 3: 0x88, 4: 0x86, 5: 0x87}
UNSPECIFIED_ERROR = 0x80


class _ShortConnect(Exception):
    """The stream ended (or a read came back short) while the CONNECT's start was peeked."""


class _Replay(ReaderAdapter):
    """A reader that gives ``prefix`` first, then what ``reader`` reads: amqtt reads the CONNECT from it as if the
    peeked bytes had never been taken (or, for MQTT 5, the translated CONNECT)."""

    def __init__(self, prefix: bytes, reader: ReaderAdapter) -> None:
        self._prefix, self._reader = prefix, reader

    async def read(self, n: int = -1) -> bytes:
        if not self._prefix:
            return await self._reader.read(n)
        if n < 0:
            head, self._prefix = self._prefix, b""
            return head + await self._reader.read(n)
        head, self._prefix = self._prefix[:n], self._prefix[n:]
        return head + (await self._reader.read(n - len(head)) if len(head) < n else b"")

    def feed_eof(self) -> None:
        self._reader.feed_eof()


class _ConnackWriter(WriterAdapter):
    """The writer amqtt's CONNECT handling sees on a v5 connection: a 3.1.1 CONNACK refusal it writes (amqtt's,
    ``ecq_guards.refuse_forbidden_wills``') leaves as the MQTT 5.0 CONNACK of the same refusal."""

    def __init__(self, writer: WriterAdapter, context: Mqtt5Context) -> None:
        self._writer = writer
        self.context = context  # the connection's, given to its handler once amqtt made it
        self.refusal_code: int | None = None  # the v5 code of a refusal, when not its 3.1.1 code's (refuse_v5_with)

    def write(self, data: bytes) -> None:
        if len(data) == 4 and data[0] == 0x20:
            code = (self.refusal_code or _CONNACK_CODES.get(data[3], UNSPECIFIED_ERROR)) if data[3] else 0
            data = mqtt5.ConnAckPacket(reason_code=mqtt5.ConnAckReasonCode(code)).write()
        self._writer.write(data)

    async def drain(self) -> None:
        await self._writer.drain()

    def get_peer_info(self) -> tuple[str, int] | None:
        return self._writer.get_peer_info()

    def get_ssl_info(self) -> Any:
        return self._writer.get_ssl_info()

    async def close(self) -> None:
        await self._writer.close()


def refuse_v5_with(writer: WriterAdapter, reason_code: int) -> None:
    """Make the CONNACK refusal written next on ``writer`` (the writer a CONNECT's handling gets) carry MQTT 5.0
    ``reason_code`` (section 3.2.2.2) when the connection is MQTT 5, in place of the v5 code of its 3.1.1 return
    code (``_CONNACK_CODES``: 0x03 is 0x88 Server unavailable, ``connection_cap`` answers 0x97 Quota exceeded);
    nothing on a 3.1.1 connection."""
    if isinstance(writer, _ConnackWriter):
        writer.refusal_code = reason_code


def translate_level_5_connects() -> None:
    """Let a protocol level 5 CONNECT through amqtt 0.12.1's ``BrokerProtocolHandler.init_from_connect``, which
    refuses every level but 4 (CONNACK 0x01), as the equivalent 3.1.1 CONNECT, on brokers that run the ECQ
    plugin (MQTT 5.0 section 3.1). The peek at the protocol level, and the reading of a whole v5 CONNECT, run
    within ``connect_timeout`` (then amqtt's read of the CONNECT it is given gets ``time_limit_connect``'s); a
    level 4 CONNECT, and anything else, reaches amqtt unchanged. The bytes read are replayed to amqtt from a
    :class:`_Replay` sharing the connection's packet checks until the CONNECT is handled."""

    async def read_a_level_5_connect(cls: type, reader: Any, writer: Any, plugins_manager: Any,
                                     loop: Any) -> tuple[Any, ...] | None:
        connection = checked_connection(reader)
        if connection is None:
            return None
        settings = find_target(plugins_manager).settings
        context = Mqtt5Context(server_receive_maximum=settings.receive_maximum,
                               server_topic_alias_maximum=settings.topic_alias_maximum,
                               property_bounds=PropertyBounds(settings.max_properties_bytes,
                                                              settings.max_user_properties))
        try:
            async with asyncio.timeout(connection.connect_timeout_s):
                peeked, level = await _peek_level(reader)
                connect = await _read_v5_connect(reader, writer, peeked, context) if level == LEVEL_5 else None
        except TimeoutError:
            raise AMQTTError(f"no CONNECT from {connection.peer} within {connection.connect_timeout_s:g} s: "
                             "connection closed") from None
        if connect is None:
            replay = _Replay(peeked, reader)
            share_checks(reader, replay)
            return cls, replay, writer, plugins_manager, loop
        translated = _Replay(_connect_as_3_1_1(connect, context, plugins_manager), reader)
        share_checks(reader, translated)
        return cls, translated, _ConnackWriter(writer, context), plugins_manager, loop

    def mark_the_connection_mqtt5(connected: tuple[BrokerProtocolHandler, Any], cls: type, reader: Any, writer: Any,
                                  plugins_manager: Any, loop: Any) -> None:
        if isinstance(writer, _ConnackWriter):
            set_context(connected[0], writer.context)

    def end_the_replay(cls: type, reader: Any, writer: Any, plugins_manager: Any, loop: Any) -> None:
        if isinstance(reader, _Replay):
            stop_sharing_checks(reader)

    step(BrokerProtocolHandler, "init_from_connect", before=read_a_level_5_connect, after=mark_the_connection_mqtt5,
         always=end_the_replay)


async def _peek_level(reader: ReaderAdapter) -> tuple[bytes, int | None]:
    """Read a CONNECT up to its protocol level byte: (the bytes read, the level), the level None when the packet
    is no CONNECT, its protocol name is longer than any MQTT version's, or the stream ended (MQTT 5.0 section
    3.1.2.2: the level follows the fixed header and the protocol name)."""
    peeked = bytearray()

    async def take(n: int) -> bytes:
        try:
            data = await reader.read(n)
        except asyncio.IncompleteReadError as exc:
            data = exc.partial
        peeked.extend(data)
        if len(data) < n:
            raise _ShortConnect
        return data

    try:
        if (await take(1))[0] != _CONNECT_FIRST_BYTE:
            return bytes(peeked), None
        for _ in range(4):
            if not (await take(1))[0] & 0x80:
                break
        else:
            return bytes(peeked), None
        name_length = int.from_bytes(await take(2), "big")
        if name_length > _LONGEST_PROTOCOL_NAME:
            return bytes(peeked), None
        await take(name_length)
        level = (await take(1))[0]
        return bytes(peeked), level
    except _ShortConnect:
        return bytes(peeked), None


async def _read_v5_connect(reader: ReaderAdapter, writer: WriterAdapter, peeked: bytes,
                           context: Mqtt5Context) -> Any:
    """The rest of a level 5 CONNECT read and decoded (its fixed header checked before its body is read, as
    ``bad_clients.check_fixed_headers`` does for 3.1.1); the options ECQ keeps go to ``context``. A refusal is
    answered with its CONNACK and raises AMQTTError: a packet above ``max_packet_bytes`` (0x95), one that does not
    decode (0x81 Malformed Packet, 0x82 Protocol Error, 0x95 for properties beyond the broker's bounds:
    ``MalformedPacket.code``, MQTT 5.0 section 4.13) or holds U+0000 in a string amqtt reads (0x81), an
    Authentication Method (0x8C: ECQ has no enhanced authentication, section 4.12)."""
    remaining, shift, index = 0, 0, 1
    while True:
        remaining |= (peeked[index] & 0x7F) << shift
        shift, index = shift + 7, index + 1
        if not peeked[index - 1] & 0x80:
            break
    connection = checked_connection(reader)
    if (reason := fixed_header_violation(1, 0, remaining, connection.max_packet_bytes)) is not None:
        await _refuse_connect(writer, PACKET_TOO_LARGE, reason, reader)
    if remaining < len(peeked) - index:
        await _refuse_connect(writer, MALFORMED_PACKET, f"MQTT 5 CONNECT with remaining length {remaining}, shorter "
                              "than its protocol name and level", reader)
    try:
        rest = await reader.read(remaining - (len(peeked) - index))
    except asyncio.IncompleteReadError:
        raise AMQTTError(f"end of stream inside the CONNECT of {connection.peer}") from None
    try:
        connect = decode(peeked + rest, context.property_bounds)
    except MalformedPacket as exc:
        await _refuse_connect(writer, exc.code, f"MQTT 5 CONNECT that does not decode ({exc})", reader)
    if not isinstance(connect, mqtt5.ConnectPacket):
        await _refuse_connect(writer, MALFORMED_PACKET, "MQTT 5 CONNECT that decodes as another packet", reader)
    if (what := _string_with_nul(connect)) is not None:
        await _refuse_connect(writer, MALFORMED_PACKET, f"MQTT 5 CONNECT {what} contains U+0000 [MQTT-1.5.4-2]",
                              reader)
    if connect.authentication_method is not None:
        await _refuse_connect(writer, BAD_AUTHENTICATION_METHOD,
                              f"MQTT 5 CONNECT with Authentication Method {connect.authentication_method!r}", None)
    context.receive_maximum, context.maximum_packet_size = connect.receive_max, connect.max_packet_size
    context.problem_information = connect.request_problem_info
    context.session_expiry_s = connect.session_expiry_interval
    context.topic_alias_maximum = connect.topic_alias_max
    context.server_maximum_packet_size = connection.max_packet_bytes
    return connect


def _string_with_nul(connect: Any) -> str | None:
    """What in a v5 CONNECT holds U+0000 (its client id, Will topic or user name), None when none does: a Malformed
    Packet (MQTT 5.0 section 1.5.4, MQTT-1.5.4-2) that the mqtt5 codec lets through."""
    will_topic = connect.will.topic if connect.will is not None else None
    for what, text in (("client id", connect.client_id), ("Will topic", will_topic), ("user name", connect.username)):
        if text and "\x00" in text:
            return what
    return None


async def _refuse_connect(writer: WriterAdapter, code: int, reason: str, reader: ReaderAdapter | None) -> None:
    """Send the v5 CONNACK refusal ``code``, close, and raise AMQTTError (counted as a protocol violation when a
    ``reader`` is given)."""
    if reader is not None:
        violation(reader, reason)
    writer.write(mqtt5.ConnAckPacket(reason_code=mqtt5.ConnAckReasonCode(code)).write())
    await writer.close()
    raise AMQTTError(f"MQTT 5 CONNECT refused with {code:#x}: {reason}")


def _connect_as_3_1_1(connect: Any, context: Mqtt5Context, plugins_manager: Any) -> bytes:
    """The MQTT 3.1.1 CONNECT amqtt is given for a v5 ``connect`` (mqtt5.ConnectPacket). An empty clientid gets one
    (``context.assigned_client_id``, MQTT 5.0 section 3.1.3.1). Clean Start becomes Clean Session (amqtt resumes
    a session or not, section 3.1.2.4); the session options ECQ applies (``mqtt5_sessions.session_options``:
    Session Expiry Interval, Keep Alive, the Will with its properties) go to ``context.session``, and the Keep
    Alive applied to the 3.1.1 CONNECT."""
    client_id = connect.client_id
    if not client_id:
        client_id = context.assigned_client_id = f"ecq-{secrets.token_hex(8)}"  # no "/": it may own a queue
    context.session = session_options(connect, find_target(plugins_manager).settings)
    flags, payload = 0x02 if connect.clean_start else 0, encode_data_with_length(client_id.encode())
    if (will := connect.will) is not None:
        flags |= 0x04 | int(will.qos) << 3 | (0x20 if will.retain else 0)
        payload += encode_data_with_length(will.topic.encode()) + encode_data_with_length(will.payload or b"")
    if connect.username is not None:
        flags |= 0x80
        payload += encode_data_with_length(connect.username.encode())
    if connect.password is not None:
        flags |= 0x40
        payload += encode_data_with_length(connect.password)
    keep_alive = context.session.keep_alive_s.to_bytes(2, "big")
    body = encode_data_with_length(b"MQTT") + bytes((4, flags)) + keep_alive + payload
    return bytes((_CONNECT_FIRST_BYTE,)) + remaining_length(len(body)) + body


class _Translated:
    """An amqtt packet as amqtt's ``_send_packet`` sends it, with its MQTT 5.0 bytes: ``to_stream`` writes
    those; any other attribute (for PACKET_SENT plugins) is the amqtt packet's."""

    def __init__(self, packet: Any, data: bytes) -> None:
        self._packet, self._data = packet, data

    async def to_stream(self, writer: WriterAdapter) -> None:
        writer.write(self._data)
        await writer.drain()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


def send_mqtt5_packets() -> None:
    """Encode as MQTT 5.0 what amqtt 0.12.1's ``ProtocolHandler._send_packet`` sends on a v5 connection (it
    writes 3.1.1 packets): CONNACK, SUBACK, UNSUBACK and PUBLISH differ; the rest are the same bytes. A PUBACK or
    PUBCOMP ends a client's PUBLISH in flight (``Mqtt5Context.inbound``)."""
    original = BrokerProtocolHandler._send_packet

    async def send_packet(handler: BrokerProtocolHandler, packet: Any) -> None:
        context = context_of(handler)
        if context is None:
            return await original(handler, packet)
        if isinstance(packet, (PubackPacket, PubcompPacket)):
            context.inbound.discard(packet.packet_id)
        data = _as_mqtt5(handler, context, packet)
        return await original(handler, packet if data is None else _Translated(packet, data))

    replace(BrokerProtocolHandler, "_send_packet", send_packet)


def _as_mqtt5(handler: BrokerProtocolHandler, context: Mqtt5Context, packet: Any) -> bytes | None:
    """The v5 bytes of an amqtt packet, None when they are the 3.1.1 bytes (PUBACK to PUBCOMP, PINGRESP)."""
    if isinstance(packet, ConnackPacket):
        return _connack(context, packet.session_parent, packet.return_code)
    if isinstance(packet, SubackPacket):
        return _suback(handler, context, packet.variable_header.packet_id, packet.payload.return_codes)
    if isinstance(packet, UnsubackPacket):
        packet_id = packet.variable_header.packet_id
        codes = context.unsubscribes.pop(packet_id, [0])
        return mqtt5.UnsubAckPacket(packet_id, [mqtt5.UnsubAckReasonCode(code) for code in codes]).write()
    if packet.fixed_header.packet_type == 3:  # PUBLISH
        return publish_bytes(context, packet)
    return None


def _connack(context: Mqtt5Context, session_present: int, return_code: int) -> bytes:
    """The v5 CONNACK of a 3.1.1 one (MQTT 5.0 section 3.2): a refusal with its v5 code, or success with ECQ's
    properties: Topic Alias Maximum ``topic_alias_maximum``, Subscription Identifiers and Shared
    Subscriptions available, Receive Maximum ``receive_maximum``, Maximum Packet Size the broker's
    ``max_packet_bytes``, the Assigned Client Identifier, and the Session Expiry Interval and Server Keep Alive ECQ
    applies when they differ from the ones asked for (``mqtt5_sessions.connack_properties``)."""
    if return_code:
        code = _CONNACK_CODES.get(return_code, UNSPECIFIED_ERROR)
        return mqtt5.ConnAckPacket(reason_code=mqtt5.ConnAckReasonCode(code)).write()
    return mqtt5.ConnAckPacket(
        session_present=bool(session_present), assigned_client_id=context.assigned_client_id,
        **connack_properties(context),
        receive_max=context.server_receive_maximum, topic_alias_max=context.server_topic_alias_maximum,
        retain_available=True,
        wildcard_subscription_available=True, max_packet_size=context.server_maximum_packet_size,
        subscription_id_available=True,
        shared_subscription_available=True).write()


def _suback(handler: BrokerProtocolHandler, context: Mqtt5Context, packet_id: int, granted: list[int]) -> bytes:
    """The v5 SUBACK of amqtt's (MQTT 5.0 section 3.9.3): the filters ECQ refused itself get their codes back in
    place (``context.subscribes``); amqtt's 0x80 becomes the code ECQ chose for that filter (0x87 for another
    client's queue), else 0x80 Unspecified error; with the Reason String ECQ kept for it
    (``context.subscribe_reasons``) when the packet still fits the client's Maximum Packet Size."""
    decided = context.subscribes.pop(packet_id, None) or [(True, UNSPECIFIED_ERROR)] * len(granted)
    amqtt_codes = iter(granted)
    codes = []
    for handed, code in decided:
        if not handed:
            codes.append(code)
            continue
        answer = next(amqtt_codes, UNSPECIFIED_ERROR)
        codes.append(answer if answer < UNSPECIFIED_ERROR else code)
    reason_codes = [mqtt5.SubAckReasonCode(code) for code in codes]
    if (reason := context.subscribe_reasons.pop(packet_id, None)) is not None:
        packet = mqtt5.SubAckPacket(packet_id, reason_codes, reason_str=reason).write()
        if context.fits(packet):
            return packet
    return mqtt5.SubAckPacket(packet_id, reason_codes).write()
