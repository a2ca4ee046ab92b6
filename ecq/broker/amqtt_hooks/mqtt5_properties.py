"""What one MQTT 5.0 packet's properties may cost the broker: ``max_properties_bytes`` and ``max_user_properties``.

MQTT 5.0 bounds a packet only by its size; its properties are all decoded into Python objects, ~180 bytes each for
a User Property of a few bytes on the wire: 50 PUBLISHes of 90,000 User Properties (1 MB each, within
``max_packet_bytes``) took the broker's peak RSS up by 357 MiB. :class:`PropertyBounds` reads a packet's property
lengths from its bytes before the codec decodes it (the bytes bound), and counts its User Properties once decoded
(the count bound, whose decoding the bytes bound keeps small). A packet over either is answered as one above the
broker's Maximum Packet Size: DISCONNECT 0x95 (CONNACK 0x95 for a CONNECT; MQTT 5.0 sections 3.2.2.2, 3.14.2.1 and
4.13), as EMQX and Mosquitto answer a packet above their ``max_packet_size``; 0x95 is no PUBACK reason code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from amqtt.mqtt.packet import CONNECT, DISCONNECT, PUBACK, PUBCOMP, PUBLISH, PUBREC, PUBREL, SUBSCRIBE, UNSUBSCRIBE

_WILL_FLAG = 0x04
# where the Property Length is in the body: after the packet id, and the reason code of an acknowledgement or DISCONNECT
_PROPERTIES_AT = {SUBSCRIBE: 2, UNSUBSCRIBE: 2, PUBACK: 3, PUBREC: 3, PUBREL: 3, PUBCOMP: 3, DISCONNECT: 1}


@dataclass(frozen=True)
class PropertyBounds:
    """The most one v5 packet may carry: ``max_bytes`` of properties (a CONNECT's own and its Will's together),
    ``max_user_properties`` User Properties (the same sum)."""

    max_bytes: int
    max_user_properties: int

    def bytes_violation(self, packet: bytes | memoryview) -> str | None:
        """Why the whole v5 ``packet`` (fixed header included) carries too many bytes of properties, read from its
        bytes without decoding them, or None."""
        size = property_bytes(packet)
        if size <= self.max_bytes:
            return None
        return f"{size} bytes of properties, above max_properties_bytes {self.max_bytes}"

    def count_violation(self, decoded: Any) -> str | None:
        """Why the decoded mqtt5 packet carries too many User Properties, or None."""
        will = getattr(decoded, "will", None)
        count = len(getattr(decoded, "user_properties", ())) + len(getattr(will, "user_properties", ()))
        if count <= self.max_user_properties:
            return None
        return f"{count} User Properties, above max_user_properties {self.max_user_properties}"


def property_bytes(packet: bytes | memoryview) -> int:
    """The bytes of the properties of the whole v5 ``packet`` (fixed header included), from their Property Length
    fields (MQTT 5.0 section 2.2.2.1): a CONNECT's own and its Will's, another packet's own, 0 for a packet without
    any. A packet cut short counts what its fields say; the codec refuses it afterwards."""
    kind, flags = packet[0] >> 4, packet[0] & 0x0F
    body = _varint(packet, 1)[1]
    if kind == CONNECT:
        return _connect_property_bytes(packet, body)
    if kind == PUBLISH:
        start = body + 2 + _u16(packet, body) + (2 if flags & 0x06 else 0)
    elif kind in _PROPERTIES_AT:
        start = body + _PROPERTIES_AT[kind]
    else:
        return 0
    return _varint(packet, start)[0]


def _connect_property_bytes(packet: bytes | memoryview, body: int) -> int:
    """A CONNECT's Property Length plus its Will Properties' (sections 3.1.2.11 and 3.1.3.2): the properties follow
    the protocol name, level, flags and Keep Alive; the Will's follow the client id."""
    level_at = body + 2 + _u16(packet, body)
    flags = packet[level_at + 1] if level_at + 1 < len(packet) else 0
    own, after = _varint(packet, level_at + 4)
    if not flags & _WILL_FLAG:
        return own
    client_id_at = after + own
    return own + _varint(packet, client_id_at + 2 + _u16(packet, client_id_at))[0]


def _u16(data: bytes | memoryview, index: int) -> int:
    """The Two Byte Integer at ``index`` (0 past the end)."""
    return int.from_bytes(data[index:index + 2], "big")


def _varint(data: bytes | memoryview, index: int) -> tuple[int, int]:
    """(the Variable Byte Integer at ``index``, the index after it), section 1.5.5; what it has past the end."""
    value, shift = 0, 0
    while index < len(data) and shift < 28:
        byte = data[index]
        index += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
    return value, index
