"""MQTT 5.0 packets of one connection: what ECQ keeps of a protocol level 5 CONNECT, and the v5 packets ECQ and
the connection edge (:mod:`.mqtt5_edge`, :mod:`.mqtt5_framer`) send, encoded with the ``mqtt5`` codec.

amqtt 0.12.1 speaks MQTT 3.1.1 only; a level 5 connection is served by amqtt as if it were 3.1.1, with its
packets translated at the edge. :class:`Mqtt5Context` is kept on the connection's handler (:func:`context_of`,
None for a 3.1.1 connection, whose packets stay byte for byte what they were).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import mqtt5

from ecq.broker.amqtt_hooks.mqtt5_properties import PropertyBounds
from ecq.queue.clock import now_ms
from ecq.queue.refusal_codes import write_refusal_code

MALFORMED_PACKET = 0x81
PROTOCOL_ERROR = 0x82
BAD_AUTHENTICATION_METHOD = 0x8C
TOPIC_ALIAS_INVALID = 0x94
PACKET_TOO_LARGE = 0x95
RECEIVE_MAXIMUM_EXCEEDED = 0x93
_PUBLISH_ACKS = {1: mqtt5.PubAckPacket, 2: mqtt5.PubRecPacket}  # the acknowledgement of a PUBLISH by its QoS
_PUBLISH_ACK_CODES = {1: mqtt5.PubAckReasonCode, 2: mqtt5.PubRecReasonCode}
_CONTEXT = "_ecq_mqtt5"  # the attribute of amqtt's handler that holds the context


# what the mqtt5 0.8.0 codec refuses to decode that MQTT 5.0 does not call a Malformed Packet: the start of its
# error -> the reason code of the CONNACK or DISCONNECT that answers it (section 4.13)
_DECODE_ERROR_CODES = {
    "Duplicate value for unique property type": PROTOCOL_ERROR,  # every property but User Property at most once
    "Receive maximum must be != 0": PROTOCOL_ERROR,  # section 3.1.2.11.3
    "Maximum packet size must be != 0": PROTOCOL_ERROR,  # section 3.1.2.11.4
    "Subscription ID must be != 0": PROTOCOL_ERROR,  # section 3.8.2.1.2
    "Invalid boolean": PROTOCOL_ERROR,  # Request Problem / Response Information other than 0 or 1, 3.1.2.11.6-7
    "Invalid RetainHandling value": PROTOCOL_ERROR,  # Retain Handling 3, section 3.8.3.1
    "Topic alias must be set if topic is empty": PROTOCOL_ERROR,  # section 3.3.2.3.4
    "Topic alias must be != 0": TOPIC_ALIAS_INVALID,  # section 3.3.2.3.4
    # a property the packet may not carry (a Topic Alias in CONNECT): Mosquitto answers Protocol Error, as ECQ
    # does; section 2.2.2.2 calls it malformed, and 0x82 still tells the client its packet was refused
    "Invalid property type": PROTOCOL_ERROR,
}


class MalformedPacket(ValueError):
    """Bytes the ``mqtt5`` codec cannot decode as one MQTT 5.0 packet; ``code`` is the reason code that answers
    them (MQTT 5.0 section 4.13): 0x81 Malformed Packet, or 0x82 Protocol Error (a property given twice, a value 0
    or 2 where the spec calls it a Protocol Error, a property the packet may not carry), 0x94 for a Topic Alias
    of 0, 0x95 Packet too large for properties beyond the broker's bounds (``mqtt5_properties``)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code or next((code for start, code in _DECODE_ERROR_CODES.items() if message.startswith(start)),
                                 MALFORMED_PACKET)


@dataclass
class Mqtt5Context:
    """What a level 5 CONNECT asked for (MQTT 5.0 section 3.1.2.11), kept for the life of the connection.

    ``receive_maximum``: the QoS 1/2 PUBLISHes the client takes in flight (1..65535); ``maximum_packet_size``: the
    largest packet it takes, in bytes, None for no limit; ``problem_information``: Reason Strings and User
    Properties allowed on packets other than PUBLISH, CONNACK and DISCONNECT; ``session_expiry_s``: as asked.
    ``assigned_client_id``: the id ECQ gave a CONNECT with an empty one (returned in CONNACK), else None.
    ``session``: the session options ECQ applies (``mqtt5_sessions.SessionOptions``: Session Expiry Interval,
    Keep Alive, Will); ``server_maximum_packet_size``: the broker's ``max_packet_bytes``, announced in CONNACK.
    ``subscribes``: per SUBSCRIBE packet id, one ``(handed to amqtt, code)`` per filter until amqtt's SUBACK:
    a filter ECQ refused itself with ``code``, or one amqtt answers whose refusal (0x80) becomes ``code``;
    ``unsubscribes``: the UNSUBACK reason codes of each UNSUBSCRIBE until its UNSUBACK; ``subscribe_reasons``: per
    SUBSCRIBE packet id, the Reason String of its SUBACK (why ECQ refuses its ``$ECQ/`` filters) until the SUBACK.
    ``topic_alias_maximum``: the aliases the client takes (section 3.1.2.11.5); ``aliases_out``: topic -> the
    alias ECQ gave it on this connection; ``aliases_in``: alias -> topic the client set (at most
    ``server_topic_alias_maximum``, the broker's ``topic_alias_maximum`` told in CONNACK, section 3.3.2.3.4).
    ``send_window``: bounds the QoS 1/2 PUBLISHes of ordinary topics in flight to ``receive_maximum``. ``retained_wanted``: per filter of the SUBSCRIBE being handled,
    whether its Retain Handling sends the retained messages. ``inbound``: the packet ids of the client's QoS 1/2
    PUBLISHes not yet acknowledged (PUBACK, PUBCOMP, or a PUBREC refusal), at most ``server_receive_maximum``
    (the broker's ``receive_maximum``, told in CONNACK, section 3.2.2.3.3). ``property_bounds``: what one packet's
    properties may cost (the broker's ``max_properties_bytes`` and ``max_user_properties``), None for no bound.
    """

    receive_maximum: int = 65535
    maximum_packet_size: int | None = None
    problem_information: bool = True
    session_expiry_s: int = 0
    assigned_client_id: str | None = None
    session: Any = None
    server_maximum_packet_size: int | None = None
    subscribes: dict[int, list[tuple[bool, int]]] = field(default_factory=dict)
    unsubscribes: dict[int, list[int]] = field(default_factory=dict)
    subscribe_reasons: dict[int, str] = field(default_factory=dict)
    topic_alias_maximum: int = 0
    aliases_out: dict[str, int] = field(default_factory=dict)
    aliases_in: dict[int, str] = field(default_factory=dict)
    send_window: asyncio.Semaphore | None = None
    retained_wanted: dict[str, bool] = field(default_factory=dict)
    inbound: set[int] = field(default_factory=set)
    server_receive_maximum: int = 65535
    server_topic_alias_maximum: int = 0
    property_bounds: PropertyBounds | None = None

    def fits(self, packet: bytes) -> bool:
        """True when ``packet`` is within the client's Maximum Packet Size (MQTT 5.0 section 3.1.2.11.4)."""
        return self.maximum_packet_size is None or len(packet) <= self.maximum_packet_size

    def alias_out(self, topic: str) -> tuple[int | None, bool]:
        """(the Topic Alias to send ``topic`` with, True when the client already knows it): a new alias while the
        client's Topic Alias Maximum has room, else None (the topic is sent in full)."""
        alias = self.aliases_out.get(topic)
        if alias is not None:
            return alias, True
        if len(self.aliases_out) >= self.topic_alias_maximum:
            return None, False
        alias = self.aliases_out[topic] = len(self.aliases_out) + 1
        return alias, False

    def receive(self, packet_id: int) -> bool:
        """Count a QoS 1/2 PUBLISH of the client in flight until :meth:`release`: False when that would exceed
        ``server_receive_maximum`` (MQTT 5.0 section 3.3.4: DISCONNECT 0x93). A resent packet id counts once."""
        if packet_id not in self.inbound and len(self.inbound) >= self.server_receive_maximum:
            return False
        self.inbound.add(packet_id)
        return True

    def window(self) -> asyncio.Semaphore:
        """The semaphore of :attr:`send_window`, made on first use (in the connection's event loop)."""
        if self.send_window is None:
            self.send_window = asyncio.Semaphore(self.receive_maximum)
        return self.send_window


def context_of(handler: Any) -> Mqtt5Context | None:
    """The MQTT 5 context of the connection served by ``handler`` (amqtt's BrokerProtocolHandler), None for 3.1.1."""
    return getattr(handler, _CONTEXT, None)


def set_context(handler: Any, context: Mqtt5Context) -> None:
    """Mark the connection served by ``handler`` as MQTT 5 (done once, right after its CONNECT was read)."""
    setattr(handler, _CONTEXT, context)


def decode(packet: bytes | memoryview, bounds: PropertyBounds | None = None) -> Any:
    """One whole MQTT 5.0 packet (fixed header included) decoded by ``mqtt5.read``; returns the mqtt5 packet
    object. Raises MalformedPacket for bytes that do not decode or leave bytes over, including the
    ``pyo3_runtime.PanicException`` (a BaseException) mqtt5 0.8.0 raises for ill-formed UTF-8 (section 1.5.4), and
    (code 0x95) for properties beyond ``bounds``: their bytes are checked before they are decoded."""
    view = memoryview(packet)
    if bounds is not None and (reason := bounds.bytes_violation(view)) is not None:
        raise MalformedPacket(reason, PACKET_TOO_LARGE)
    try:
        decoded, used = mqtt5.read(view)
    except Exception as exc:
        raise MalformedPacket(f"{exc}") from None
    except BaseException as exc:  # pyo3's PanicException, by name: its class is not importable
        if type(exc).__name__ != "PanicException":
            raise
        raise MalformedPacket("a string that is not well-formed UTF-8 [MQTT-1.5.4-1]") from None
    if used != len(view):
        raise MalformedPacket(f"{len(view) - used} bytes left over after the packet")
    if bounds is not None and (reason := bounds.count_violation(decoded)) is not None:
        raise MalformedPacket(reason, PACKET_TOO_LARGE)
    return decoded


def publish_acknowledgement(context: Mqtt5Context, qos: int, packet_id: int, reason: str, message: str) -> bytes:
    """The PUBACK (``qos`` 1) or PUBREC (``qos`` 2) of a refused ``$ECQ/`` write: the reason code of ``reason``
    (a ``BadWrite.reason``, see ``ecq.queue.refusal_codes``), with ``message`` as Reason String when the client
    asked for problem information and the packet still fits its Maximum Packet Size (MQTT 5.0 sections 3.4.2,
    3.4.2.2.2, 3.1.2.11.7)."""
    code = _PUBLISH_ACK_CODES[qos](write_refusal_code(reason))
    if context.problem_information:
        packet = _PUBLISH_ACKS[qos](packet_id, reason_code=code, reason_str=message).write()
        if context.fits(packet):
            return packet
    return _PUBLISH_ACKS[qos](packet_id, reason_code=code).write()


def delivery(packet_id: int, topic: str, payload: bytes, seqno: int | None, ts_ms: int | None,
             expires_ms: int = 0, dup: bool = False, subscription_ids: tuple[int, ...] = ()) -> bytes:
    """A QoS 1 PUBLISH of an ECQ delivery with the User Properties ``ecq-seqno`` (decimal seqno) and ``ecq-ts``
    (the write's publish time, Unix ms), when known (MQTT 5.0 section 3.3.2.3.7), for an entry that expires
    at ``expires_ms`` (Unix ms; 0: never) the Message Expiry Interval left (section 3.3.2.3.3), DUP=1 when ``dup``
    (section 3.3.1.1) and the Subscription Identifiers of the queue's subscription (section 3.3.4, MQTT-3.3.4-3)."""
    properties = [] if seqno is None else [("ecq-seqno", str(seqno)), ("ecq-ts", str(ts_ms))]
    return mqtt5.PublishPacket(topic, payload, qos=mqtt5.QoS.AT_LEAST_ONCE, packet_id=packet_id, duplicate=dup,
                               user_properties=properties, subscription_ids=list(subscription_ids),
                               message_expiry_interval=remaining_expiry_s(expires_ms, now_ms())).write()


def remaining_expiry_s(expires_ms: int, now: int) -> int | None:
    """The Message Expiry Interval of a delivery at ``now`` (Unix ms) of an entry expiring at ``expires_ms``:
    the seconds left, rounded up and at least 1 (a delivery is sent only before its entry expires), None when it
    never expires (MQTT 5.0 section 3.3.2.3.3: the received value minus the time the message waited)."""
    return max(1, -((now - expires_ms) // 1000)) if expires_ms else None


def disconnect(code: int, message: str | None = None) -> bytes:
    """A server DISCONNECT with reason ``code`` (MQTT 5.0 section 3.14.2.1) and an optional Reason String."""
    return mqtt5.DisconnectPacket(reason_code=mqtt5.DisconnectReasonCode(code), reason_str=message).write()


def remaining_length(length: int) -> bytes:
    """``length`` in MQTT's variable byte integer encoding (MQTT 5.0 section 1.5.5), 1 to 4 bytes."""
    encoded = bytearray()
    while True:
        byte, length = length & 0x7F, length >> 7
        encoded.append(byte | 0x80 if length else byte)
        if not length:
            return bytes(encoded)


def release_inbound(handler: Any, packet_id: int) -> None:
    """The client's PUBLISH ``packet_id`` is acknowledged (PUBACK, PUBCOMP, a PUBREC refusal): it no longer
    counts against the server's Receive Maximum (MQTT 5.0 section 4.9). Nothing on a 3.1.1 connection."""
    context = context_of(handler)
    if context is not None:
        context.inbound.discard(packet_id)


def receive_maximum(handler: Any) -> int | None:
    """The Receive Maximum of the MQTT 5 connection served by ``handler`` (QoS 1/2 PUBLISHes it takes in flight,
    MQTT 5.0 section 3.1.2.11.3), None for a 3.1.1 connection (no limit of its own)."""
    context = context_of(handler)
    return None if context is None else context.receive_maximum
