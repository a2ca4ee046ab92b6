"""The packet reader (ecq.broker.amqtt_hooks.framer) over TCP against real brokers, with ``fast_path`` on and off.

Each scenario runs both ways and must give the same results; with the fast path on,
``ecq_fast_path_packets_total`` shows that its hot packets (QoS 1 ``$ECQ/`` PUBLISHes, PUBACKs of ECQ
deliveries, PINGREQs with no PUBLISH before them waiting to be routed) took it, and with it off that they did not.
"""

from __future__ import annotations

import re
import socket
import struct
import time

import pytest

from tests.harness import RawClient, drain, fixed_header, metrics_text, wait_until, write

PINGREQ = bytes([0xC0, 0x00])


@pytest.fixture(params=[True, False], ids=["fast", "amqtt-reader"])
def fast_path(request) -> bool:
    return request.param


def _fast_path_counts(broker) -> dict[str, float]:
    """``ecq_fast_path_packets_total`` by packet label (publish, puback, pingreq)."""
    found = re.findall(r'^ecq_fast_path_packets_total\{packet="(\w+)"\} (\S+)$', metrics_text(broker), re.M)
    return {label: float(value) for label, value in found}


def _expect_counts(broker, fast_path: bool, publishes: int, pubacks: int, pings: int = 0) -> None:
    expected = ({"publish": publishes, "puback": pubacks, "pingreq": pings} if fast_path
                else {"publish": 0, "puback": 0, "pingreq": 0})
    assert wait_until(lambda: _fast_path_counts(broker) == expected, 5), _fast_path_counts(broker)


def _mqtt_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack(">H", len(raw)) + raw


def _connect_packet(client_id: str, keepalive: int = 60, will: tuple[str, bytes] | None = None) -> bytes:
    """A clean-session CONNECT; ``will`` = (topic, message) at QoS 1."""
    flags = 0x02 | (0x04 | 0x08 if will else 0)
    body = b"\x00\x04MQTT\x04" + bytes([flags]) + struct.pack(">H", keepalive) + _mqtt_string(client_id)
    if will:
        body += _mqtt_string(will[0]) + _mqtt_string(will[1])
    return fixed_header(0x10, len(body)) + body


def _publish_qos1(topic: bytes, packet_id: int, payload: bytes) -> bytes:
    body = _mqtt_string(topic) + struct.pack(">H", packet_id) + payload
    return fixed_header(0x32, len(body)) + body


def _subscribe(topic_filter: str, packet_id: int, qos: int = 1) -> bytes:
    body = struct.pack(">H", packet_id) + _mqtt_string(topic_filter) + bytes([qos])
    return fixed_header(0x82, len(body)) + body


class _Socket:
    """A TCP connection that sends any bytes (a CONNECT too) and reads the broker's packets one by one."""

    def __init__(self, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = RawClient.__new__(RawClient)  # RawClient's packet reading, on this socket
        self._reader.sock = self.sock

    def send_bytewise(self, data: bytes, gap_s: float = 0.001) -> None:
        """Send ``data`` one byte per segment (TCP_NODELAY, a pause between bytes): the broker reads it in pieces."""
        for index in range(len(data)):
            self.sock.sendall(data[index:index + 1])
            time.sleep(gap_s)

    def receive(self) -> tuple[int, bytes]:
        return self._reader.receive()

    def closed_by_broker(self, timeout: float) -> bool:
        """True when the broker closes the connection within ``timeout`` seconds (its packets are skipped)."""
        try:
            self._reader.read_until_closed(timeout)
            return True
        except TimeoutError:
            return False


def test_write_delivery_and_ack(make_broker, connect, fast_path):
    # Three writes, delivered and acked: a reconnect gets nothing again; the hot packets took the fast path.
    broker = make_broker(fast_path=fast_path)
    producer = connect(broker.port, "producer")
    for i in range(3):
        write(producer, "fq1", f"k{i}", f"v{i}")
    assert drain(connect, broker.port, "fq1", 3) == [(f"$ECQ/fq1/k{i}", f"v{i}".encode()) for i in range(3)]
    assert drain(connect, broker.port, "fq1", 0) == []
    _expect_counts(broker, fast_path, publishes=3, pubacks=3)


def test_refused_writes_are_acknowledged_in_order_and_not_stored(make_broker, connect, fast_path):
    # An empty key, a wildcard key, a payload too large, a rewind by a stranger: each refused with its reason and
    # PUBACKed (ids in order with the valid writes around them); the connection stays up.
    broker = make_broker(fast_path=fast_path, max_payload_bytes=100)
    raw = _Socket(broker.port)
    raw.sock.sendall(_connect_packet("refuser"))
    assert raw.receive() == (0x20, b"\x00\x00")
    topics = [b"$ECQ/w/fr/a", b"$ECQ/w/fr", b"$ECQ/w/fr/+", b"$ECQ/w/fr/big", b"$ECQ/ctl/fr/rewind", b"$ECQ/w/fr/b"]
    payloads = [b"1", b"x", b"x", b"x" * 101, b"earliest", b"2"]
    raw.sock.sendall(b"".join(_publish_qos1(t, i + 1, p) for i, (t, p) in enumerate(zip(topics, payloads))))
    assert [raw.receive() for _ in topics] == [(0x40, struct.pack(">H", i + 1)) for i in range(len(topics))]
    raw.sock.sendall(PINGREQ)
    assert raw.receive() == (0xD0, b"")
    assert drain(connect, broker.port, "fr", 2) == [("$ECQ/fr/a", b"1"), ("$ECQ/fr/b", b"2")]
    text = metrics_text(broker)
    for reason in ("empty_key", "bad_key", "payload_too_large", "not_owner"):
        assert f'ecq_writes_refused_total{{reason="{reason}"}} 1.0' in text, reason
    _expect_counts(broker, fast_path, publishes=6, pubacks=2, pings=1)


def test_many_packets_in_one_segment(make_broker, connect, fast_path):
    # CONNECT, SUBSCRIBE, 200 writes to 40 queues (four writer agents, fsync'd commits finish out of order) and
    # PINGREQ in one sendall: every answer comes, the PUBACKs in the order of the writes.
    broker = make_broker(fast_path=fast_path, writer_pool_size=4, sync_writes=True)
    raw = _Socket(broker.port, timeout=30)
    writes = [_publish_qos1(b"$ECQ/w/seg%d/k%d" % (i % 40, i), i + 1, b"v%d" % i) for i in range(200)]
    raw.sock.sendall(_connect_packet("segment") + _subscribe("plain/#", 1) + b"".join(writes) + PINGREQ)
    answers = [raw.receive() for _ in range(203)]
    assert answers[0] == (0x20, b"\x00\x00")
    assert sorted(header for header, _ in answers[1:]) == [0x40] * 200 + [0x90, 0xD0]
    assert [struct.unpack(">H", body)[0] for header, body in answers if header == 0x40] == list(range(1, 201))
    assert drain(connect, broker.port, "seg7", 5) == [(f"$ECQ/seg7/k{i}", b"v%d" % i) for i in range(7, 200, 40)]
    _expect_counts(broker, fast_path, publishes=200, pubacks=5, pings=1)


def test_packets_split_byte_by_byte(make_broker, connect, fast_path):
    # A write (2-byte remaining length), a SUBSCRIBE and the PUBACK of the delivery, each arriving one byte per
    # TCP segment: all are taken, and the acked message is not delivered again.
    broker = make_broker(fast_path=fast_path)
    raw = _Socket(broker.port)
    raw.send_bytewise(_connect_packet("split"))
    assert raw.receive() == (0x20, b"\x00\x00")
    payload = bytes(range(200))
    raw.send_bytewise(_publish_qos1(b"$ECQ/w/split/k", 9, payload))
    assert raw.receive() == (0x40, struct.pack(">H", 9))
    raw.send_bytewise(_subscribe("$ECQ/split/#", 3))
    assert raw.receive() == (0x90, b"\x00\x03\x01")
    header, body = raw.receive()
    assert header & 0xF6 == 0x32 and body.startswith(_mqtt_string("$ECQ/split/k")) and body.endswith(payload)
    packet_id = body[len(_mqtt_string("$ECQ/split/k")):][:2]
    raw.send_bytewise(bytes([0x40, 0x02]) + packet_id + bytes([0xE0, 0x00]))
    assert raw.closed_by_broker(5)
    assert drain(connect, broker.port, "split", 0) == []
    _expect_counts(broker, fast_path, publishes=1, pubacks=1)


def test_packet_above_max_packet_bytes_is_closed_before_its_body(make_broker, fast_path):
    # Only the fixed header of a 10 MB PUBLISH is sent: the broker closes the connection without waiting for
    # the body, and says why.
    broker = make_broker(fast_path=fast_path, max_payload_bytes=1000)
    raw = _Socket(broker.port)
    raw.sock.sendall(_connect_packet("huge"))
    assert raw.receive() == (0x20, b"\x00\x00")
    raw.sock.sendall(fixed_header(0x32, 10_000_000))
    assert raw.closed_by_broker(5)
    assert "PUBLISH packet announces 10000000 bytes, above max_packet_bytes 66539" in broker.log()


def test_keepalive_closes_a_silent_client_and_publishes_its_will(make_broker, connect, fast_path):
    # Keepalive 1 s: PINGREQs every 0.5 s keep the connection for 3 s; then silence closes it after 1.5 s
    # (MQTT 3.1.1 section 3.1.2.10) and, as it did not DISCONNECT, its Will is published.
    broker = make_broker(fast_path=fast_path)
    watcher = connect(broker.port, "watcher")
    assert watcher.subscribe("will/#") == 1
    raw = _Socket(broker.port)
    raw.sock.sendall(_connect_packet("sleepy", keepalive=1, will=("will/sleepy", b"gone")))
    assert raw.receive() == (0x20, b"\x00\x00")
    for _ in range(6):
        time.sleep(0.5)
        raw.sock.sendall(PINGREQ)
        assert raw.receive() == (0xD0, b"")
    silent_since = time.monotonic()
    assert raw.closed_by_broker(5)
    assert 1.3 <= time.monotonic() - silent_since <= 3.0
    message = watcher.expect(1)[0]
    assert (message.topic, message.payload) == ("will/sleepy", b"gone")


def test_will_on_abrupt_close_not_on_disconnect(make_broker, connect, fast_path):
    broker = make_broker(fast_path=fast_path)
    watcher = connect(broker.port, "watcher")
    assert watcher.subscribe("will/#") == 1
    polite = _Socket(broker.port)
    polite.sock.sendall(_connect_packet("polite", will=("will/polite", b"bye")) + bytes([0xE0, 0x00]))
    assert polite.receive() == (0x20, b"\x00\x00")
    assert polite.closed_by_broker(5)
    abrupt = RawClient.__new__(RawClient)
    abrupt.sock = _Socket(broker.port).sock
    abrupt.sock.sendall(_connect_packet("abrupt", will=("will/abrupt", b"lost")))
    assert abrupt.receive() == (0x20, b"\x00\x00")
    abrupt.close(reset=True)
    message = watcher.expect(1)[0]
    assert (message.topic, message.payload) == ("will/abrupt", b"lost")
    assert watcher.quiet(1.0) == []


def test_qos2_and_qos1_on_ordinary_topics(make_broker, connect, fast_path):
    # Ordinary topics keep amqtt's flows (with ECQ's corrections): one delivery per message at min(QoS).
    broker = make_broker(fast_path=fast_path)
    subscriber = connect(broker.port, "plain-sub")
    assert subscriber.subscribe("plain/#", qos=2) == 2
    publisher = connect(broker.port, "plain-pub")
    publisher.publish("plain/two", b"q2", qos=2)
    publisher.publish("plain/one", b"q1", qos=1)
    got = sorted((m.topic, m.payload, m.qos) for m in subscriber.expect(2))
    assert got == [("plain/one", b"q1", 1), ("plain/two", b"q2", 2)]
    assert subscriber.quiet(1.0) == []
    _expect_counts(broker, fast_path, publishes=0, pubacks=0)
