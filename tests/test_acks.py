"""An acknowledged message is never delivered again, over TCP against a real broker.

No test here sleeps before a disconnect: a PUBACK that the broker read from the socket must count even
when the DISCONNECT and the end of the stream arrive in the same read.
"""

from __future__ import annotations

import subprocess
import struct
import threading

import pytest

from tests.harness import RawClient, drain, fixed_header, write

PUBACK = bytes([0x40, 0x02])
DISCONNECT = bytes([0xE0, 0x00])


def _puback(packet_id: int) -> bytes:
    return PUBACK + packet_id.to_bytes(2, "big")


@pytest.mark.parametrize("ending", ["disconnect", "reset", "disconnect-reset"])
def test_puback_right_before_the_end_of_the_connection_counts(broker, connect, ending):
    # 3 messages in flight; the consumer acks the first and at once sends DISCONNECT and closes, or resets
    # the connection (what a client's kernel does when it closes with unread data, as `mosquitto_sub -C 1`
    # does). Tried on 4 queues: before the fix the ack was lost after a reset in most tries.
    producer = connect(broker.port, "producer")
    for attempt in range(4):
        clientid = f"pd{attempt}"
        for i in range(3):
            write(producer, clientid, f"k{i}", f"v{i}")
        raw = RawClient(broker.port, clientid)
        assert raw.subscribe(f"$ECQ/{clientid}/#".encode()) == (0x90, b"\x00\x01\x01")
        first_topic, first_id, _ = raw.receive_publish()
        assert first_topic == f"$ECQ/{clientid}/k0".encode()
        raw.receive_publish(), raw.receive_publish()
        raw.send_raw(_puback(first_id) + (DISCONNECT if ending.startswith("disconnect") else b""))
        raw.close(reset=ending.endswith("reset"))
        assert drain(connect, broker.port, clientid, 2) == [
            (f"$ECQ/{clientid}/k1", b"v1"), (f"$ECQ/{clientid}/k2", b"v2")], f"attempt {attempt}"


def test_mosquitto_sub_count_one_gets_each_message_once(broker, connect):
    # `mosquitto_sub -C 1` PUBACKs its first message and closes with the other two in flight unread, so
    # its kernel resets the connection right after the PUBACK. Three runs must print three messages.
    producer = connect(broker.port, "producer")
    for queue in ("mc1", "mc2", "mc3"):
        for i in range(3):
            write(producer, queue, f"k{i}", f"v{i}")
        printed = [_mosquitto_sub_one(broker.port, queue) for _ in range(3)]
        assert printed == [f"$ECQ/{queue}/k{i} v{i}" for i in range(3)]


def _mosquitto_sub_one(port: int, clientid: str) -> str:
    out = subprocess.run(["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-i", clientid, "-q", "1",
                          "-t", f"$ECQ/{clientid}/#", "-C", "1", "-W", "10", "-F", "%t %p"],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("sync_writes", [False, True])
def test_an_ack_is_stored_before_the_next_delivery_is_sent(make_broker, connect, sync_writes):
    # The consumer acks each message as it comes (window 1, so each delivery follows the previous PUBACK);
    # the broker is killed from paho's callback the moment message k3 arrives. Every ack received before
    # k3 was sent must be in LevelDB: after the restart the queue resumes at k3. With fsync'd commits
    # (sync_writes) an ack save takes long enough that sending before it committed showed up here.
    broker = make_broker(reader_batch_size=1, sync_writes=sync_writes)
    producer = connect(broker.port, "producer")
    for queue in ("ks1", "ks2", "ks3"):
        for i in range(5):
            write(producer, queue, f"k{i}", f"v{i}")
    for queue in ("ks1", "ks2", "ks3"):
        consumer = connect(broker.port, queue, manual_ack=True)
        killed = threading.Event()

        def on_message(client, _userdata, message):
            if message.topic.endswith("/k3"):
                broker.kill()
                killed.set()
            else:
                client.ack(message.mid, message.qos)

        consumer._c.on_message = on_message
        consumer.subscribe(f"$ECQ/{queue}/#")
        assert killed.wait(10), f"{queue}: k3 never came"
        consumer.close(clean=False)
        broker.start()
        assert drain(connect, broker.port, queue, 2) == [(f"$ECQ/{queue}/k3", b"v3"), (f"$ECQ/{queue}/k4", b"v4")]


def test_pubacks_leave_in_the_order_the_publishes_arrived(make_broker):
    # MQTT 3.1.1 section 4.6: 500 QoS 1 writes to 100 queues (four writer agents commit them side by side),
    # every 50th refused at once for a bad topic, all sent without waiting: the PUBACK packet ids come back in order.
    # fsync'd commits run in writer threads and take a while, so a refusal or another agent's commit could overtake.
    broker = make_broker(writer_pool_size=4, sync_writes=True)
    raw = RawClient(broker.port, "orderly")
    raw.sock.settimeout(30)  # 500 fsyncs on a busy machine: bounded, but not by the 5 s of one answer
    packets = []
    for packet_id in range(1, 501):
        topic = b"$ECQ/w/c%d" % packet_id if packet_id % 50 == 0 else b"$ECQ/w/c%d/k%d" % (packet_id % 100, packet_id)
        body = struct.pack(">H", len(topic)) + topic + struct.pack(">H", packet_id) + b"v" * 64
        packets.append(fixed_header(0x32, len(body)) + body)
    raw.send_raw(b"".join(packets))
    answers = [raw.receive() for _ in range(500)]
    assert {header for header, _body in answers} == {0x40}
    assert [struct.unpack(">H", body)[0] for _header, body in answers] == list(range(1, 501))
    raw.close()


UNSUBACK = 0xB0


def _unsubscribe(raw: RawClient, topic_filter: bytes, packet_id: int = 2) -> None:
    """UNSUBSCRIBE ``topic_filter`` and read the answer, which must be its UNSUBACK (nothing sent before it)."""
    raw.send(0xA2, struct.pack(">H", packet_id) + struct.pack(">H", len(topic_filter)) + topic_filter)
    assert raw.receive() == (UNSUBACK, struct.pack(">H", packet_id))


@pytest.mark.parametrize("acked_before", [(), (0, 2), (1,)], ids=["all-after", "first-third-before", "second-before"])
def test_pubacks_after_unsubscribe_complete_the_deliveries_in_flight(make_broker, connect, acked_before):
    # MQTT-3.10.4-3: deliveries already started when the UNSUBSCRIBE comes are completed. Four messages are in
    # flight (all that is stored, window 4); some are acked before the UNSUBSCRIBE, the rest after its UNSUBACK,
    # with two writes made in between: no new delivery starts, and on the next subscribe only those two come.
    broker = make_broker(reader_batch_size=4)
    producer = connect(broker.port, "producer")
    clientid = "ua" + "".join(map(str, acked_before))
    for i in range(4):
        write(producer, clientid, f"k{i}", f"v{i}")
    raw = RawClient(broker.port, clientid)
    assert raw.subscribe(f"$ECQ/{clientid}/#".encode()) == (0x90, b"\x00\x01\x01")
    sent = [raw.receive_publish() for _ in range(4)]
    assert [topic for topic, _id, _payload in sent] == [f"$ECQ/{clientid}/k{i}".encode() for i in range(4)]
    raw.puback(*(sent[i][1] for i in acked_before))
    _unsubscribe(raw, f"$ECQ/{clientid}/#".encode())
    write(producer, clientid, "k4", "v4")
    write(producer, clientid, "k5", "v5")
    raw.puback(*(packet_id for i, (_topic, packet_id, _payload) in enumerate(sent) if i not in acked_before))
    assert raw.ping(), "a PUBLISH came after the UNSUBSCRIBE instead of PINGRESP"
    raw.send_raw(DISCONNECT)
    raw.close()
    assert drain(connect, broker.port, clientid, 2) == [(f"$ECQ/{clientid}/k4", b"v4"), (f"$ECQ/{clientid}/k5", b"v5")]


def test_resubscribe_on_the_same_connection_after_acks_sent_after_unsubscribe(make_broker, connect):
    # The same flow without reconnecting: after the late PUBACKs, a SUBSCRIBE on the same connection resumes with
    # the messages never sent; nothing acked comes again.
    broker = make_broker(reader_batch_size=2)
    producer = connect(broker.port, "producer")
    for i in range(4):
        write(producer, "ur", f"k{i}", f"v{i}")
    raw = RawClient(broker.port, "ur")
    assert raw.subscribe(b"$ECQ/ur/#") == (0x90, b"\x00\x01\x01")
    sent = [raw.receive_publish() for _ in range(2)]
    _unsubscribe(raw, b"$ECQ/ur/#")
    raw.puback(*(packet_id for _topic, packet_id, _payload in sent))
    assert raw.ping()
    assert raw.subscribe(b"$ECQ/ur/#", packet_id=3) == (0x90, b"\x00\x03\x01")
    again = [raw.receive_publish() for _ in range(2)]
    assert [(topic, payload) for topic, _id, payload in again] == [(b"$ECQ/ur/k2", b"v2"), (b"$ECQ/ur/k3", b"v3")]
    raw.puback(*(packet_id for _topic, packet_id, _payload in again))
    raw.send_raw(DISCONNECT)
    raw.close()
    assert drain(connect, broker.port, "ur", 0) == []
