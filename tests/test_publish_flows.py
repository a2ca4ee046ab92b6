"""The QoS flows of a write, as clients really send them, against real brokers with ``fast_path`` on and off:
one-shot QoS 0 publishers (mosquitto_pub's default), QoS 2 retransmits (exactly once, MQTT 3.1.1 section 4.3.3),
acknowledgements in arrival order whatever the topic (section 4.6), malformed packets (section 4.8).

Raw sockets send what paho would not; mosquitto_pub is run as users run it.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import time

import pytest

from tests.harness import RawClient, drain, fixed_header, metrics_text, wait_until
from tests.mqtt_wire import DISCONNECT_PACKET, connect_packet, publish_packet, pubrel_packet

PUBACK, PUBREC, PUBCOMP = 0x40, 0x50, 0x70  # first bytes of the broker's answers


@pytest.fixture(params=[True, False], ids=["fast_path", "amqtt_reader"])
def fast_path(request) -> bool:
    return request.param


def one_shot(port: int, packets: bytes, disconnect: bool = True) -> None:
    """What mosquitto_pub does: CONNECT, the packets and DISCONNECT in one send, then close without reading."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(connect_packet("oneshot") + packets + (DISCONNECT_PACKET if disconnect else b""))


# --- point 1: QoS 0 writes of one-shot publishers -------------------------------------------------------------

@pytest.mark.parametrize("disconnect", [True, False], ids=["disconnect", "eof"])
def test_one_shot_qos0_writes_are_all_stored(make_broker, connect, fast_path, disconnect):
    broker = make_broker(fast_path=fast_path)
    for number in range(5):
        one_shot(broker.port, publish_packet(f"$ECQ/w/q0c/k{number}", b"v%d" % number, 0), disconnect)
    got = drain(connect, broker.port, "q0c", 5)  # five connections: MQTT orders nothing between them
    assert sorted(got) == [(f"$ECQ/q0c/k{n}", b"v%d" % n) for n in range(5)]


def test_mosquitto_pub_qos0_writes_are_all_stored(make_broker, connect, fast_path):
    broker = make_broker(fast_path=fast_path)
    for number in range(5):
        subprocess.run(["mosquitto_pub", "-p", str(broker.port), "-h", "127.0.0.1", "-t", f"$ECQ/w/mq0/k{number}",
                        "-m", f"v{number}"], check=True, timeout=10)
    got = drain(connect, broker.port, "mq0", 5)
    assert sorted(got) == [(f"$ECQ/mq0/k{n}", f"v{n}".encode()) for n in range(5)]


def test_qos0_writes_before_a_qos1_write_keep_their_order(make_broker, connect, fast_path):
    broker = make_broker(fast_path=fast_path)
    raw = RawClient(broker.port, "mixer")
    raw.send_raw(publish_packet("$ECQ/w/ord0/a", b"0", 0) + publish_packet("$ECQ/w/ord0/b", b"1", 0)
                 + publish_packet("$ECQ/w/ord0/c", b"2", 1, 7))
    assert raw.receive() == (0x40, struct.pack(">H", 7))
    raw.close()
    assert drain(connect, broker.port, "ord0", 3) == [("$ECQ/ord0/a", b"0"), ("$ECQ/ord0/b", b"1"),
                                                      ("$ECQ/ord0/c", b"2")]


# --- what was read before DISCONNECT is processed, on ordinary topics too ----------------------------------

def test_pubacked_plain_messages_all_reach_the_subscriber_after_the_publisher_disconnects(make_broker, connect,
                                                                                          fast_path):
    """amqtt PUBACKs a QoS 1 PUBLISH once queued for routing, and its message loop ended at DISCONNECT with the
    rest of that queue unrouted: 100 PUBACKed messages reached a subscriber 35 times."""
    broker = make_broker(fast_path=fast_path)
    watcher = connect(broker.port, "watcher")
    assert watcher.subscribe("plain/#") == 1
    publisher = connect(broker.port, "pub")
    infos = publisher.publish_many([(f"plain/{n}", b"x") for n in range(100)])
    assert all(info.is_published() for info in infos)
    publisher.close()
    got = watcher.expect(100)
    assert sorted(m.topic for m in got) == sorted(f"plain/{n}" for n in range(100))


def test_a_subscribe_sent_with_disconnect_is_recorded(make_broker, connect, fast_path):
    broker = make_broker(fast_path=fast_path)
    subscribe = fixed_header(0x82, 2 + 2 + 7 + 1) + struct.pack(">HH", 1, 7) + b"plain/#" + b"\x01"
    with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as sock:
        sock.sendall(connect_packet("sub1", clean_session=False) + subscribe + DISCONNECT_PACKET)
    connect(broker.port, "pub").publish("plain/x", b"kept for sub1")
    returning = RawClient(broker.port, "sub1", clean_session=False)
    topic, _packet_id, payload = returning.receive_publish()
    returning.close()
    assert (topic, payload) == (b"plain/x", b"kept for sub1")


def test_a_clean_session_ends_with_its_connection(make_broker, connect):
    """A persistent CONNECT right after a clean session's DISCONNECT starts a new session: session present 0 and
    none of the clean session's subscriptions (MQTT 3.1.1 section 3.1.2.4; amqtt kept it up to 1 s)."""
    broker = make_broker()
    subscribe = fixed_header(0x82, 2 + 2 + 7 + 1) + struct.pack(">HH", 1, 7) + b"plain/#" + b"\x01"
    with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as sock:
        sock.sendall(connect_packet("cs1") + subscribe)
        assert sock.recv(4) == b"\x20\x02\x00\x00" and sock.recv(5)[0] == 0x90
        sock.sendall(DISCONNECT_PACKET)
        assert sock.recv(1) == b""  # the broker closed the connection: the session is over
    with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as sock:
        sock.sendall(connect_packet("cs1", clean_session=False))
        assert sock.recv(4) == b"\x20\x02\x00\x00"  # session present 0
        connect(broker.port, "pub").publish("plain/x", b"not for cs1")
        sock.settimeout(1.0)
        with pytest.raises(TimeoutError):
            sock.recv(1)


# --- point 2: QoS 2 exactly once ------------------------------------------------------------------------------

def test_qos2_retransmit_before_pubrel_is_stored_once(make_broker, connect, fast_path):
    broker = make_broker(fast_path=fast_path)
    raw = RawClient(broker.port, "q2pub")
    raw.send_raw(publish_packet("$ECQ/w/cq/k", b"X", 2, 9))
    assert raw.receive() == (PUBREC, struct.pack(">H", 9))
    raw.send_raw(publish_packet("$ECQ/w/cq/k", b"X", 2, 9, dup=True))  # as if the PUBREC was lost
    assert raw.receive() == (PUBREC, struct.pack(">H", 9))
    raw.send_raw(pubrel_packet(9))
    assert raw.receive() == (PUBCOMP, struct.pack(">H", 9))
    raw.send_raw(publish_packet("$ECQ/w/cq/k", b"Y", 2, 9))  # after PUBCOMP the id is free: a new write
    assert raw.receive() == (PUBREC, struct.pack(">H", 9))
    raw.send_raw(pubrel_packet(9))
    assert raw.receive() == (PUBCOMP, struct.pack(">H", 9))
    raw.close()
    assert drain(connect, broker.port, "cq", 1) == [("$ECQ/cq/k", b"Y")]  # compaction: Y replaced X
    assert _stored_seqnos(broker, "cq") == 2  # X once, Y once: no third append


def test_qos2_retransmit_after_a_persistent_reconnect_is_stored_once(make_broker, connect, fast_path):
    broker = make_broker(fast_path=fast_path)
    consumer = connect(broker.port, "cq2")
    assert consumer.subscribe("$ECQ/cq2/#") == 1
    raw = RawClient(broker.port, "q2p", clean_session=False)
    raw.send_raw(publish_packet("$ECQ/w/cq2/k", b"X", 2, 9))
    assert raw.receive() == (PUBREC, struct.pack(">H", 9))
    raw.close(reset=True)
    raw = RawClient(broker.port, "q2p", clean_session=False)
    raw.send_raw(publish_packet("$ECQ/w/cq2/k", b"X", 2, 9, dup=True))
    assert raw.receive() == (PUBREC, struct.pack(">H", 9))
    raw.send_raw(pubrel_packet(9))
    assert raw.receive() == (PUBCOMP, struct.pack(">H", 9))
    raw.close()
    assert [m.payload for m in consumer.expect(1)] == [b"X"]
    assert consumer.quiet(1.0) == []
    assert _stored_seqnos(broker, "cq2") == 1


def test_pubrel_after_a_persistent_reconnect_gets_its_pubcomp(make_broker, connect, fast_path):
    broker = make_broker(fast_path=fast_path)
    raw = RawClient(broker.port, "q2r", clean_session=False)
    raw.send_raw(publish_packet("$ECQ/w/cq3/k", b"X", 2, 4))
    assert raw.receive() == (PUBREC, struct.pack(">H", 4))
    raw.close()
    raw = RawClient(broker.port, "q2r", clean_session=False)
    raw.send_raw(pubrel_packet(4))
    assert raw.receive() == (PUBCOMP, struct.pack(">H", 4))
    raw.close()
    assert drain(connect, broker.port, "cq3", 1) == [("$ECQ/cq3/k", b"X")]


def _stored_seqnos(broker, clientid: str) -> int:
    """The queue's last seqno as ``/metrics`` or the admin API tell it: how many appends it ever took."""
    import json
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.admin_port}/api/v1/queues/{clientid}", timeout=5) as reply:
        return json.load(reply)["last_seqno"]


# --- point 5: acknowledgements in arrival order, whatever the topic ------------------------------------------

def test_pubacks_of_mixed_ecq_and_plain_publishes_keep_arrival_order(make_broker, fast_path):
    broker = make_broker(fast_path=fast_path)
    raw = RawClient(broker.port, "mixed")
    packets = b"".join(publish_packet(f"$ECQ/w/mx/k{n % 7}" if n % 2 else f"plain/{n}", b"p" * 64, 1, n + 1)
                       for n in range(300))
    raw.send_raw(packets)
    answers = [raw.receive() for _ in range(300)]
    raw.close()
    assert [(header, struct.unpack(">H", body)[0]) for header, body in answers] == [(0x40, n + 1) for n in range(300)]


def mixed_qos2_publishes(count: int) -> tuple[bytes, list[tuple[int, int]], list[str]]:
    """``count`` PUBLISHes in one buffer cycling through an ``$ECQ/`` QoS 2 write, a plain QoS 2 PUBLISH, an
    ``$ECQ/`` QoS 1 write and a plain QoS 1 PUBLISH (packet ids 1..count): (the bytes, the (PUBACK/PUBREC first
    byte, packet id) each must get, in arrival order, the topics of the plain ones)."""
    kinds = [("$ECQ/w/mq2/k", 2), ("plain/q2-", 2), ("$ECQ/w/mq2/j", 1), ("plain/q1-", 1)]
    packets, answers, plain = b"", [], []
    for packet_id in range(1, count + 1):
        topic, qos = kinds[(packet_id - 1) % len(kinds)]
        packets += publish_packet(f"{topic}{packet_id}", b"p" * 64, qos, packet_id)
        answers.append((PUBREC if qos == 2 else PUBACK, packet_id))
        if topic.startswith("plain/"):
            plain.append(f"{topic}{packet_id}")
    return packets, answers, plain


def test_pubrecs_of_mixed_ecq_and_plain_qos2_publishes_keep_arrival_order(make_broker, connect, fast_path):
    broker = make_broker(fast_path=fast_path, sync_writes=True)  # each commit fsynced: ECQ writes lag behind
    subscriber = connect(broker.port, "q2-watcher")
    assert subscriber.subscribe("plain/#", qos=2) == 2
    raw = RawClient(broker.port, "mixed2")
    packets, expected, plain = mixed_qos2_publishes(200)
    raw.send_raw(packets)  # one buffer: a plain PUBLISH is routed before the ECQ writes ahead of it commit
    answers = [raw.receive() for _ in expected]
    assert [(header, struct.unpack(">H", body)[0]) for header, body in answers] == expected
    released = [packet_id for header, packet_id in expected if header == PUBREC]
    raw.send_raw(b"".join(pubrel_packet(packet_id) for packet_id in released))
    pubcomps = sorted(raw.receive() for _ in released)  # MQTT 3.1.1 section 4.6 orders no PUBCOMPs
    assert pubcomps == [(PUBCOMP, struct.pack(">H", n)) for n in released]
    raw.close()
    assert sorted(m.topic for m in subscriber.expect(len(plain))) == sorted(plain)  # each once, QoS 2 after PUBREL
    assert subscriber.quiet(0.5) == []


# --- point 7: malformed packets close the connection ----------------------------------------------------------

@pytest.mark.parametrize(("packet", "reason"), [
    (b"\x42\x02\x00\x01", "PUBACK with reserved flags 0x2 [MQTT-2.2.2-2]"),
    (b"\x40\x03\x00\x01\x00", "PUBACK with remaining length 3, not 2"),
    (b"\x32\x04\x00\x20\x24\x45", "PUBLISH whose topic (32 bytes) runs past its remaining length 4"),
    (b"\x30\x01\x00", "PUBLISH whose topic length runs past its remaining length 1"),
    (b"\xe0\x01\x00", "DISCONNECT with remaining length 1, not 0"),
    (b"\x80\x05\x00\x01\x00\x01\x61", "SUBSCRIBE with reserved flags 0x0 [MQTT-2.2.2-2]"),
], ids=["puback_flags", "puback_length", "ecq_topic_overrun", "short_topic_length", "disconnect_length",
        "subscribe_flags"])
def test_malformed_packet_closes_the_connection_with_a_reason(make_broker, connect, fast_path, packet, reason):
    broker = make_broker(fast_path=fast_path)
    raw = RawClient(broker.port, "malformed")
    try:
        raw.send_raw(packet + b"\xc0\x00")  # a PINGREQ after it must not be answered
        assert raw.read_until_closed() == []
    finally:
        raw.close()
    assert "ECQ closing the connection of client 'malformed' (127.0.0.1:" in broker.log()
    assert reason in broker.log()
    assert drain(connect, broker.port, "nothing", 0) == []


def test_violation_log_lines_are_rate_limited_and_each_violation_counted(make_broker):
    broker = make_broker()
    for _ in range(30):
        raw = RawClient(broker.port, "flood")
        raw.send_raw(b"\x42\x02\x00\x01")
        assert raw.read_until_closed() == []
        raw.close()
    # VIOLATION_LOG_BURST lines per 10 s; 30 bad packets take well under that on any machine that passes the rest
    assert broker.log().count("ECQ closing the connection of") == 10, broker.log()[-3000:]
    assert wait_until(lambda: "ecq_protocol_violations_total 30.0" in metrics_text(broker), 5)
