"""MQTT 3.1.1 on the wire, byte by byte, over TCP or WebSocket: what a client sends, also when things go wrong.

The encoders below build each packet a client sends (CONNECT, PUBLISH at QoS 0/1/2 with DUP, PUBACK, PUBREC,
PUBREL, PUBCOMP, SUBSCRIBE, UNSUBSCRIBE, PINGREQ, DISCONNECT), so a test can put several in one write, resend a
PUBLISH with DUP=1, or leave an acknowledgement unread. :class:`WireClient` sends them over a :class:`Tcp` socket
or a :class:`WebSocket` (binary frames, subprotocol ``mqtt``, MQTT 3.1.1 section 6) and cuts the broker's bytes
into :class:`Packet` objects. Every wait is bounded. ``tests.harness.RawClient`` is the simpler TCP-only client
most tests use; the packet framing (:func:`tests.harness.fixed_header`, :func:`tests.harness.split_packet`) is
shared with it.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from tests.harness import fixed_header, split_packet

WAIT_S = 5.0  # the longest a test waits for one answer of the broker

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 10, 11, 12, 13, 14

DISCONNECT_PACKET = bytes([DISCONNECT << 4, 0])
PINGREQ_PACKET = bytes([PINGREQ << 4, 0])


def _string(text: str | bytes) -> bytes:
    """An MQTT UTF-8 string: 2-byte length, then the bytes (section 1.5.3)."""
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack(">H", len(raw)) + raw


def connect_packet(client_id: str, clean_session: bool = True, keepalive_s: int = 60) -> bytes:
    """CONNECT, protocol level 4 (3.1.1), no Will, no credentials (section 3.1)."""
    flags = 0x02 if clean_session else 0x00
    body = _string("MQTT") + bytes([4, flags]) + struct.pack(">H", keepalive_s) + _string(client_id)
    return fixed_header(CONNECT << 4, len(body)) + body


def publish_packet(topic: str | bytes, payload: bytes, qos: int = 0, packet_id: int | None = None,
                   dup: bool = False, retain: bool = False) -> bytes:
    """PUBLISH (section 3.3); ``packet_id`` is required at QoS 1 and 2 and left out at QoS 0."""
    first = PUBLISH << 4 | (0x08 if dup else 0) | qos << 1 | (0x01 if retain else 0)
    body = _string(topic) + (struct.pack(">H", packet_id) if qos else b"") + payload
    return fixed_header(first, len(body)) + body


def _ack(kind: int, packet_id: int, flags: int = 0) -> bytes:
    return bytes([kind << 4 | flags, 2]) + struct.pack(">H", packet_id)


def puback_packet(packet_id: int) -> bytes:
    """PUBACK (section 3.4)."""
    return _ack(PUBACK, packet_id)


def pubrec_packet(packet_id: int) -> bytes:
    """PUBREC (section 3.5)."""
    return _ack(PUBREC, packet_id)


def pubrel_packet(packet_id: int) -> bytes:
    """PUBREL, with its required flags 0010 (section 3.6.1)."""
    return _ack(PUBREL, packet_id, 0x02)


def pubcomp_packet(packet_id: int) -> bytes:
    """PUBCOMP (section 3.7)."""
    return _ack(PUBCOMP, packet_id)


def subscribe_packet(packet_id: int, *filters: tuple[str, int]) -> bytes:
    """SUBSCRIBE of (topic filter, requested QoS) pairs, flags 0010 (section 3.8)."""
    body = struct.pack(">H", packet_id) + b"".join(_string(f) + bytes([qos]) for f, qos in filters)
    return fixed_header(SUBSCRIBE << 4 | 0x02, len(body)) + body


def unsubscribe_packet(packet_id: int, *filters: str) -> bytes:
    """UNSUBSCRIBE of topic filters, flags 0010 (section 3.10)."""
    body = struct.pack(">H", packet_id) + b"".join(_string(f) for f in filters)
    return fixed_header(UNSUBSCRIBE << 4 | 0x02, len(body)) + body


@dataclass(frozen=True)
class Packet:
    """One packet the broker sent: its first byte (type and flags) and its body."""

    first: int
    body: bytes

    @property
    def kind(self) -> int:
        """The packet type (1 CONNECT ... 14 DISCONNECT)."""
        return self.first >> 4

    @property
    def packet_id(self) -> int:
        """The packet id of an acknowledgement, SUBACK or UNSUBACK (its first two body bytes)."""
        return struct.unpack_from(">H", self.body)[0]

    def publish(self) -> Publish:
        """This PUBLISH decoded (raises AssertionError for another packet type)."""
        assert self.kind == PUBLISH, f"expected a PUBLISH, got packet type {self.kind}"
        qos = self.first >> 1 & 0x03
        size = struct.unpack_from(">H", self.body)[0]
        topic, rest = self.body[2:2 + size].decode(), self.body[2 + size:]
        packet_id = struct.unpack_from(">H", rest)[0] if qos else None
        return Publish(topic, rest[2:] if qos else rest, qos, packet_id, bool(self.first & 0x08))


@dataclass(frozen=True)
class Publish:
    """A decoded PUBLISH: topic, payload, QoS, packet id (None at QoS 0) and DUP flag."""

    topic: str
    payload: bytes
    qos: int
    packet_id: int | None
    dup: bool


class Tcp:
    """A TCP connection to the broker (TCP_NODELAY: each write leaves at once, as one segment)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, data: bytes) -> None:
        """Write ``data`` in one ``sendall``."""
        self.sock.sendall(data)

    def recv(self, timeout: float) -> bytes:
        """The next bytes (b"" at the end of the stream or after a reset); raises TimeoutError after ``timeout``
        seconds (at least 1 ms)."""
        self.sock.settimeout(max(timeout, 0.001))
        try:
            return self.sock.recv(65536)
        except ConnectionResetError:
            return b""

    def close(self) -> None:
        """FIN: an ordinary close."""
        self.sock.close()

    def reset(self) -> None:
        """RST instead of FIN (SO_LINGER 0), what a kernel sends when a socket closes with unread data; bytes
        still in this side's send buffer are dropped."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


class WebSocket(Tcp):
    """A WebSocket connection to the broker's ``type: ws`` listener: MQTT bytes in binary frames, subprotocol
    ``mqtt`` (MQTT 3.1.1 section 6), through the ``websockets`` package's sans-I/O client protocol, so that this
    side owns the socket (a reset is a TCP reset) and every wait is this module's own."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.protocol = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/"), subprotocols=[Subprotocol("mqtt")])
        self.protocol.send_request(self.protocol.connect())
        self._flush()
        self._received = bytearray()
        deadline = time.monotonic() + WAIT_S
        while self.protocol.handshake_exc is None and self.protocol.state.name == "CONNECTING":
            chunk = super().recv(deadline - time.monotonic())
            self.protocol.receive_eof() if not chunk else self.protocol.receive_data(chunk)
            self._take_events()
        if self.protocol.handshake_exc is not None:
            raise ConnectionError(f"WebSocket handshake failed: {self.protocol.handshake_exc}")

    def send(self, data: bytes) -> None:
        """Write ``data`` as one binary frame."""
        self.protocol.send_binary(data)
        self._flush()

    def recv(self, timeout: float) -> bytes:
        """The payload bytes of the next data frames (b"" once the WebSocket or the TCP stream ended)."""
        deadline = time.monotonic() + timeout
        while not self._received:
            if self.protocol.state.name == "CLOSED":
                return b""
            chunk = super().recv(deadline - time.monotonic())
            self.protocol.receive_eof() if not chunk else self.protocol.receive_data(chunk)
            self._take_events()
            self._flush()  # pongs, the close handshake
            if not chunk:
                break
        data, self._received = bytes(self._received), bytearray()
        return data

    def close(self) -> None:
        """The WebSocket close handshake's first frame, then FIN."""
        if self.protocol.state.name == "OPEN":
            self.protocol.send_close()
            try:
                self._flush()
            except OSError:
                pass
        super().close()

    def _take_events(self) -> None:
        for event in self.protocol.events_received():
            if isinstance(event, Frame) and event.opcode in (Opcode.BINARY, Opcode.CONT, Opcode.TEXT):
                self._received += event.data

    def _flush(self) -> None:
        if data := b"".join(self.protocol.data_to_send()):
            self.sock.sendall(data)


class WireClient:
    """One MQTT connection over ``transport`` ("tcp" or "ws", on ``port``): raw packets out, parsed packets in."""

    def __init__(self, port: int, transport: str = "tcp") -> None:
        self.transport_name = transport
        self.transport: Tcp = WebSocket(port) if transport == "ws" else Tcp(port)
        self._buffer = b""
        self.ended = False  # the broker closed the connection (or it was reset)

    @classmethod
    def connected(cls, port: int, client_id: str, clean_session: bool = True, transport: str = "tcp"
                  ) -> tuple[WireClient, bool]:
        """A new connection that sent CONNECT and read a CONNACK accepting it: (client, session present)."""
        client = cls(port, transport)
        client.send(connect_packet(client_id, clean_session))
        return client, client.read_connack()

    def read_connack(self) -> bool:
        """Read the CONNACK; True when it says session present (section 3.2.2.2). Raises AssertionError when
        the broker refused the CONNECT or sent something else."""
        packet = self.next()
        assert packet is not None and packet.kind == CONNACK, f"expected CONNACK, got {packet}"
        assert packet.body[1] == 0, f"CONNECT refused with return code {packet.body[1]}"
        return bool(packet.body[0] & 0x01)

    def send(self, *packets: bytes) -> None:
        """Write the encoded ``packets`` in one write (one TCP segment on loopback, or one WebSocket frame)."""
        self.transport.send(b"".join(packets))

    def next(self, timeout: float = WAIT_S) -> Packet | None:
        """The next packet from the broker; None once the connection ended. Raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while (whole := split_packet(self._buffer)) is None:
            if self.ended:
                return None
            left = deadline - time.monotonic()
            try:
                chunk = self.transport.recv(left)  # at least one short read, also for a timeout of 0
            except TimeoutError:
                if left <= 0:
                    raise TimeoutError(f"no packet within {timeout} s") from None
                continue
            except OSError:
                chunk = b""
            self._buffer += chunk
            self.ended = self.ended or not chunk
        first, body, self._buffer = whole
        return Packet(first, body)

    def available(self, timeout: float = 0.0) -> list[Packet]:
        """Every packet that arrives within ``timeout`` seconds (all that are already here for 0)."""
        packets = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                packet = self.next(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return packets
            if packet is None:
                return packets
            packets.append(packet)

    def until_closed(self, timeout: float = WAIT_S) -> list[Packet]:
        """Every packet until the broker closes the connection; raises TimeoutError when it keeps it open."""
        packets = []
        deadline = time.monotonic() + timeout
        while (packet := self.next(max(0.0, deadline - time.monotonic()))) is not None:
            packets.append(packet)
        return packets

    def close(self) -> None:
        """Close without DISCONNECT (FIN)."""
        self.transport.close()
        self.ended = True

    def reset(self) -> None:
        """Close with a TCP reset (see :meth:`Tcp.reset`)."""
        self.transport.reset()
        self.ended = True
