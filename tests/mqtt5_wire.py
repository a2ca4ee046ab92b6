"""MQTT 5.0 packets as raw bytes, for what the ``mqtt5`` codec refuses to encode (a property given twice, a value the
spec forbids, a property a packet may not carry, thousands of User Properties): each packet's properties are given
already encoded, built with :func:`prop`. ``tests.mqtt_wire`` sends them (``WireClient.send``)."""

from __future__ import annotations

import struct

from tests.harness import fixed_header

# property identifiers (MQTT 5.0 section 2.2.2.2)
SUBSCRIPTION_IDENTIFIER, SESSION_EXPIRY_INTERVAL, REQUEST_PROBLEM_INFORMATION = 0x0B, 0x11, 0x17
WILL_DELAY_INTERVAL, REQUEST_RESPONSE_INFORMATION, RECEIVE_MAXIMUM = 0x18, 0x19, 0x21
TOPIC_ALIAS, USER_PROPERTY, MAXIMUM_PACKET_SIZE = 0x23, 0x26, 0x27
_SIZES = {REQUEST_PROBLEM_INFORMATION: 1, REQUEST_RESPONSE_INFORMATION: 1, RECEIVE_MAXIMUM: 2, TOPIC_ALIAS: 2,
          SESSION_EXPIRY_INTERVAL: 4, WILL_DELAY_INTERVAL: 4, MAXIMUM_PACKET_SIZE: 4}


def varint(value: int) -> bytes:
    """A Variable Byte Integer (section 1.5.5)."""
    return fixed_header(0, value)[1:]


def string(text: str | bytes) -> bytes:
    """A UTF-8 string or binary data: 2-byte length, then the bytes (sections 1.5.4, 1.5.6)."""
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack(">H", len(raw)) + raw


def prop(identifier: int, value: int | tuple[str, str]) -> bytes:
    """One property: a Subscription Identifier (Variable Byte Integer), a User Property (name, value), or an integer
    property of its size (1, 2 or 4 bytes)."""
    if identifier == USER_PROPERTY:
        return bytes([identifier]) + string(value[0]) + string(value[1])
    if identifier == SUBSCRIPTION_IDENTIFIER:
        return bytes([identifier]) + varint(value)
    return bytes([identifier]) + value.to_bytes(_SIZES[identifier], "big")


def user_properties(count: int, size: int = 1) -> bytes:
    """``count`` User Properties, each a name and a value of ``size`` bytes."""
    return prop(USER_PROPERTY, ("u" * size, "v" * size)) * count


def connect(client_id: str, properties: bytes = b"", will_properties: bytes | None = None,
            will_topic: str | bytes = "wills/t") -> bytes:
    """A level 5 CONNECT, Clean Start, Keep Alive 30 s, with a Will (QoS 0, payload ``x``) when
    ``will_properties`` is given (section 3.1)."""
    flags = 0x02 | (0x04 if will_properties is not None else 0)
    body = string("MQTT") + bytes([5, flags]) + struct.pack(">H", 30) + varint(len(properties)) + properties
    body += string(client_id)
    if will_properties is not None:
        body += varint(len(will_properties)) + will_properties + string(will_topic) + string(b"x")
    return fixed_header(0x10, len(body)) + body


def publish(topic: str | bytes, properties: bytes = b"", qos: int = 1, packet_id: int = 1,
            payload: bytes = b"v") -> bytes:
    """A PUBLISH (section 3.3); ``packet_id`` is left out at QoS 0."""
    body = string(topic) + (struct.pack(">H", packet_id) if qos else b"") + varint(len(properties)) + properties
    return fixed_header(0x30 | qos << 1, len(body + payload)) + body + payload


def subscribe(topic_filter: str, properties: bytes = b"", packet_id: int = 1, options: int = 1) -> bytes:
    """A SUBSCRIBE of one filter with its Subscription Options byte (section 3.8)."""
    body = struct.pack(">H", packet_id) + varint(len(properties)) + properties + string(topic_filter)
    return fixed_header(0x82, len(body) + 1) + body + bytes([options])
