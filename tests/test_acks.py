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
