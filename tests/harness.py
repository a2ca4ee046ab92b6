"""Test harness: real MQTT clients over TCP (paho-mqtt, and a raw socket client) with bounded waits.

The broker process itself comes from :mod:`ecq.testing`.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
import urllib.request
from dataclasses import dataclass

import paho.mqtt.client as mqtt

from ecq.testing import ECQ, BrokerProcess, free_port, port_open, wait_until  # noqa: F401 (re-exported)


@dataclass
class Received:
    """One PUBLISH a test client received."""

    topic: str
    payload: bytes
    qos: int
    mid: int
    dup: bool


class Client:
    """A paho-mqtt 3.1.1 client with bounded waits.

    ``manual_ack=True`` withholds PUBACKs until :meth:`ack` is called (to test redelivery). ``transport``
    is ``"tcp"`` or ``"websockets"``; ``ca`` (a PEM file) makes it TLS, trusting that certificate. A CONNACK
    that refuses the connection raises ConnectionRefusedError naming the reason.
    """

    def __init__(self, port: int, client_id: str = "", clean_session: bool = True, manual_ack: bool = False,
                 username: str | None = None, password: str | None = None, transport: str = "tcp",
                 ca: str | None = None, keepalive: int = 30) -> None:
        self.messages: queue.Queue[Received] = queue.Queue()
        self.suback: queue.Queue[list[int]] = queue.Queue()
        self.disconnected = threading.Event()
        self._c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean_session,
                              protocol=mqtt.MQTTv311, manual_ack=manual_ack, transport=transport)
        self._c.max_inflight_messages_set(1000)
        if username is not None:
            self._c.username_pw_set(username, password)
        if ca is not None:
            self._c.tls_set(ca_certs=ca)
        self._c.on_message = lambda _c, _u, m: self.messages.put(Received(m.topic, m.payload, m.qos, m.mid, m.dup))
        self._c.on_subscribe = lambda _c, _u, _mid, codes, _p: self.suback.put([c.value for c in codes])
        self._c.on_disconnect = lambda *_args: self.disconnected.set()
        connected = threading.Event()
        connack: list[mqtt.ReasonCode] = []
        self.session_present: bool | None = None  # the CONNACK's flag (MQTT 3.1.1 section 3.2.2.2)
        self._c.on_connect = lambda _c, _u, flags, reason, _p: (
            setattr(self, "session_present", flags.session_present), connack.append(reason), connected.set())
        self._c.connect("127.0.0.1", port, keepalive=keepalive)
        self._c.loop_start()
        if not connected.wait(10):
            self.close()
            raise TimeoutError(f"no CONNACK for {client_id!r}")
        if connack[0].is_failure:
            self.close(clean=False)
            raise ConnectionRefusedError(f"CONNACK for {client_id!r}: {connack[0]}")

    def subscribe(self, topic_filter: str, qos: int = 1) -> int:
        """SUBSCRIBE and return the SUBACK return code (0, 1, 2 granted QoS or 0x80 failure)."""
        self._c.subscribe(topic_filter, qos)
        return self.suback.get(timeout=10)[0]

    def publish(self, topic: str, payload: bytes | str, qos: int = 1, timeout: float = 10.0,
                retain: bool = False) -> None:
        """PUBLISH and, for QoS 1/2, wait for the broker's acknowledgement (raises TimeoutError)."""
        info = self._c.publish(topic, payload, qos, retain)
        info.wait_for_publish(timeout)
        if not info.is_published():
            raise TimeoutError(f"no acknowledgement for PUBLISH to {topic!r}")

    def publish_many(self, topic_payloads: list[tuple[str, bytes]], qos: int = 1, timeout: float = 30.0):
        """Pipeline many PUBLISHes, then wait for every acknowledgement; returns the paho infos."""
        infos = [self._c.publish(t, p, qos) for t, p in topic_payloads]
        deadline = time.monotonic() + timeout
        for info in infos:
            info.wait_for_publish(max(0.0, deadline - time.monotonic()))
        return infos

    def expect(self, count: int, timeout: float = 10.0) -> list[Received]:
        """Exactly the next ``count`` messages (raises queue.Empty if they do not come in time)."""
        deadline = time.monotonic() + timeout
        return [self.messages.get(timeout=max(0.01, deadline - time.monotonic())) for _ in range(count)]

    def quiet(self, seconds: float = 1.5) -> list[Received]:
        """Whatever arrives within ``seconds`` (used to show that nothing arrives)."""
        time.sleep(seconds)
        out = []
        while not self.messages.empty():
            out.append(self.messages.get_nowait())
        return out

    def ack(self, message: Received) -> None:
        """Send the PUBACK of a message received with ``manual_ack=True``."""
        self._c.ack(message.mid, message.qos)

    def close(self, clean: bool = True) -> None:
        """DISCONNECT (or drop the socket when ``clean`` is False) and stop the network thread.

        A clean close waits (at most 5 s) until paho has written its DISCONNECT, so every packet queued before
        it (PUBACKs) went out: stopping paho's thread at once could leave them unsent.
        """
        if clean:
            self._c.disconnect()
            self.disconnected.wait(5)
        else:
            sock = self._c.socket()
            if sock is not None:  # None once paho saw the broker go away
                sock.close()
        self._c.loop_stop()


def metrics_text(broker: BrokerProcess) -> str:
    """The broker's ``/metrics`` page (Prometheus text exposition) from its admin API."""
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.admin_port}/metrics", timeout=10) as response:
        return response.read().decode()


def lines_let_through(elapsed_s: float, interval_s: float) -> int:
    """The most lines one LogThrottle(interval_s) (ecq.queue.throttle) lets through in ``elapsed_s`` seconds:
    one per window it opened. A bound on throttled log lines that holds however slow the machine is."""
    return int(elapsed_s // interval_s) + 1


def write(client: Client, clientid: str, key: str, payload: bytes | str, qos: int = 1) -> None:
    """An ECQ write: PUBLISH to ``$ECQ/w/<clientid>/<key>`` and wait for its acknowledgement."""
    client.publish(f"$ECQ/w/{clientid}/{key}", payload, qos)


def topics_payloads(messages: list[Received]) -> list[tuple[str, bytes]]:
    """(topic, payload) of each message, in arrival order."""
    return [(m.topic, m.payload) for m in messages]


def drain(connect, port: int, clientid: str, count: int, **client_options) -> list[tuple[str, bytes]]:
    """Connect as ``clientid``, subscribe to its queue, and return exactly the next ``count`` messages as
    (topic, payload); fails if they do not come or if anything more arrives within a second."""
    consumer = connect(port, clientid, **client_options)
    assert consumer.subscribe(f"$ECQ/{clientid}/#") == 1
    messages = topics_payloads(consumer.expect(count))
    extra = topics_payloads(consumer.quiet(1.0))
    assert extra == [], f"after {messages}, more came: {extra}"
    return messages


def fixed_header(first_byte: int, remaining_length: int) -> bytes:
    """An MQTT fixed header: ``first_byte`` (packet type and flags), then the variable-length remaining length."""
    encoded = bytearray()
    while True:
        byte, remaining_length = remaining_length % 128, remaining_length // 128
        encoded.append(byte | (0x80 if remaining_length else 0))
        if not remaining_length:
            return bytes([first_byte]) + bytes(encoded)


def split_packet(data: bytes) -> tuple[int, bytes, bytes] | None:
    """The first whole MQTT packet of ``data``: (first byte, body, the bytes after it); None while it is incomplete.
    The inverse of :func:`fixed_header` followed by the body (MQTT 3.1.1 section 2.2.3: at most 4 length bytes,
    ValueError beyond)."""
    size, shift, index = 0, 0, 1
    while index < len(data):
        byte = data[index]
        index += 1
        size |= (byte & 0x7F) << shift
        if not byte & 0x80:
            end = index + size
            return (data[0], data[index:end], data[end:]) if end <= len(data) else None
        shift += 7
        if shift == 28:
            raise ValueError("a remaining length longer than 4 bytes")
    return None


class RawClient:
    """A minimal MQTT 3.1.1 client on a plain socket, for packets that paho and mosquitto refuse to send
    (wildcards or NUL in a PUBLISH topic, protocol violations)."""

    def __init__(self, port: int, client_id: str = "raw", clean_session: bool = True) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        cid = client_id.encode()
        flags = b"\x02" if clean_session else b"\x00"
        variable = b"\x00\x04MQTT\x04" + flags + b"\x00\x3c" + struct.pack(">H", len(cid)) + cid
        self.send(0x10, variable)
        header, body = self._recv()
        assert header == 0x20 and body[1] == 0, f"CONNECT refused: {body!r}"
        self.session_present = bool(body[0] & 1)

    def publish_qos1(self, topic: bytes, payload: bytes, packet_id: int) -> tuple[int, bytes]:
        """Send a QoS 1 PUBLISH and return the broker's answer (type byte, body)."""
        self.send(0x32, struct.pack(">H", len(topic)) + topic + struct.pack(">H", packet_id) + payload)
        return self._recv()

    def subscribe(self, topic_filter: bytes, qos: int = 1, packet_id: int = 1) -> tuple[int, bytes]:
        """Send a SUBSCRIBE with one filter and return the broker's answer (type byte, body)."""
        self.send(0x82, struct.pack(">H", packet_id) + struct.pack(">H", len(topic_filter)) + topic_filter
                   + bytes([qos]))
        return self._recv()

    def receive_publish(self) -> tuple[bytes, int, bytes]:
        """The next packet, which must be a QoS 1 PUBLISH: (topic, packet id, payload)."""
        header, body = self._recv()
        assert header & 0xF0 == 0x30, f"expected PUBLISH, got packet type {header >> 4}"
        size = struct.unpack_from(">H", body)[0]
        return body[2:2 + size], struct.unpack_from(">H", body, 2 + size)[0], body[4 + size:]

    def receive(self) -> tuple[int, bytes]:
        """The next packet the broker sends: (first byte, body)."""
        return self._recv()

    def puback(self, *packet_ids: int) -> None:
        """Acknowledge QoS 1 PUBLISHes the broker sent, in one ``sendall`` (one segment: Nagle's algorithm
        would hold a second small write until the broker's delayed ACK, ~40 ms)."""
        self.send_raw(b"".join(fixed_header(0x40, 2) + struct.pack(">H", packet_id) for packet_id in packet_ids))

    def send_raw(self, packets: bytes) -> None:
        """Write already encoded packets in one ``sendall``: the broker reads them from one buffer."""
        self.sock.sendall(packets)

    def ping(self) -> bool:
        """PINGREQ; True when PINGRESP comes back (the connection is still served)."""
        self.send(0xC0, b"")
        return self._recv() == (0xD0, b"")

    def close(self, reset: bool = False) -> None:
        """Close the socket; ``reset=True`` sends RST instead of FIN (SO_LINGER 0), as a kernel does when a
        socket is closed with unread data."""
        if reset:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def send(self, header: int, body: bytes) -> None:
        """Send one packet: first byte ``header`` (type and flags), then ``body`` with its remaining length."""
        self.sock.sendall(fixed_header(header, len(body)) + body)

    def read_until_closed(self, timeout: float = 5.0) -> list[tuple[int, bytes]]:
        """Every packet the broker sends until it closes the connection (raises TimeoutError if it does not)."""
        self.sock.settimeout(timeout)
        packets = []
        try:
            while True:
                packets.append(self._recv())
        except TimeoutError:
            raise TimeoutError(f"broker kept the connection open; received {packets}") from None
        except OSError:  # end of stream (ConnectionError from _read) or reset
            return packets

    def _recv(self) -> tuple[int, bytes]:
        header = self._read(1)[0]
        size, shift = 0, 0
        while True:
            byte = self._read(1)[0]
            size |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        return header, self._read(size)

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("broker closed the connection")
            data += chunk
        return data
