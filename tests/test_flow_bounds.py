"""Nothing unbounded in flow (ecq.broker.amqtt_hooks.flow): a subscriber that never reads, a publisher that never
pauses, a PINGREQ behind PUBLISHes, SIGTERM with stuck subscribers. Memory is the broker process's RSS; every
client is a raw socket (tests.mqtt_wire) on TCP or the WebSocket listener.
"""

from __future__ import annotations

import re
import socket
import time

import mqtt5
import psutil
import pytest

from ecq.testing import free_port
from tests.harness import metrics_text, split_packet, wait_until
from tests.mqtt_wire import (CONNACK, PINGREQ_PACKET, PINGRESP, PUBLISH, SUBACK, WireClient, connect_packet,
                             publish_packet, subscribe_packet)

PAYLOAD = bytes(2048)
BATCH = 500  # PUBLISHes per write of a publisher
MiB = 1024 * 1024


def rss(broker) -> int:
    return psutil.Process(broker.proc.pid).memory_info().rss


def stuck_subscriber(port: int, topic_filter: str, qos: int = 0, transport: str = "tcp") -> WireClient:
    """A subscriber that reads its SUBACK, then nothing: its socket's receive buffer is small (4 KB)."""
    client = WireClient(port, transport)
    client.transport.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.send(connect_packet(f"stuck-{transport}-{qos}"), subscribe_packet(1, (topic_filter, qos)))
    client.read_connack()
    assert client.next().kind == SUBACK
    return client


def publisher(port: int, name: str = "pub", transport: str = "tcp", v5: bool = False) -> WireClient:
    """A raw publisher over ``transport``, MQTT 3.1.1 or (``v5``) MQTT 5.0."""
    client = WireClient(port, transport)
    if v5:
        client.send(mqtt5.ConnectPacket(name, clean_start=True).write())
        assert client.next().kind == CONNACK
    else:
        client.send(connect_packet(name))
        client.read_connack()
    return client


def publish_batches(client: WireClient, topic: str, batches: int, qos: int = 0, broker=None, v5: bool = False) -> int:
    """Send ``batches`` x :data:`BATCH` 2 KB PUBLISHes (MQTT 5.0 ones with ``v5``), unpaced (QoS 1 packet ids
    cycle, their PUBACKs unread); returns the peak RSS of ``broker`` sampled between batches (0 without one)."""
    peak, packet_id = 0, 0
    for _ in range(batches):
        packets = []
        for _ in range(BATCH):
            packet_id = packet_id % 65535 + 1
            packets.append(mqtt5.PublishPacket(topic, PAYLOAD).write() if v5
                           else publish_packet(topic, PAYLOAD, qos, packet_id if qos else None))
        if client.transport_name == "ws":  # one WebSocket message per packet, as paho and MQTT.js send them
            for packet in packets:
                client.send(packet)
        else:
            client.send(*packets)
        if broker is not None:
            peak = max(peak, rss(broker))
    return peak


def metric(broker, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", metrics_text(broker), re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("transport", ["tcp", "ws"])
def test_a_subscriber_that_never_reads_holds_a_bounded_queue_then_is_closed(broker_process, transport):
    ws_port = free_port()
    broker = broker_process(stuck_subscriber_timeout="2s",
                            listeners={"ws": {"type": "ws", "bind": f"127.0.0.1:{ws_port}"}}).start()
    subscriber = stuck_subscriber(ws_port if transport == "ws" else broker.port, "stuck/#", transport=transport)
    sender = publisher(broker.port)
    before = rss(broker)
    peak = publish_batches(sender, "stuck/t", 20, broker=broker)  # 10,000 x 2 KB: 20 MB
    assert peak - before < 20 * MiB, f"RSS grew by {(peak - before) / MiB:.0f} MB"
    assert metric(broker, 'ecq_messages_dropped_total{reason="queue_full"}') > 0
    deadline = time.monotonic() + 15
    while metric(broker, "ecq_stuck_subscribers_closed_total") < 1 and time.monotonic() < deadline:
        publish_batches(sender, "stuck/t", 1)  # drops go on past stuck_subscriber_timeout
    assert metric(broker, "ecq_stuck_subscribers_closed_total") == 1
    assert re.search(rf"ECQ closed the connection of stuck-{transport}-0: it read nothing for 2 s", broker.log())
    assert len(re.findall("ECQ dropped a message to", broker.log())) <= 3  # at most one line per 10 s
    subscriber.until_closed(10)  # what the socket had, then the end: the broker closed it


@pytest.mark.parametrize("reader", ["framer", "amqtt", "amqtt-ws", "framer-v5"])
def test_an_unpaced_publisher_is_read_as_fast_as_its_publishes_are_routed(broker_process, reader):
    ws_port = free_port()
    broker = broker_process(fast_path=reader == "framer",
                            listeners={"ws": {"type": "ws", "bind": f"127.0.0.1:{ws_port}"}}).start()
    v5 = reader.endswith("-v5")
    sender = (publisher(ws_port, transport="ws") if reader.endswith("-ws") else publisher(broker.port, v5=v5))
    before = rss(broker)
    peak = publish_batches(sender, "nobody/listens", 40, broker=broker, v5=v5)  # 20,000 x 2 KB: 40 MB
    sender.send(PINGREQ_PACKET)
    assert sender.next(30).kind == PINGRESP
    assert max(peak, rss(broker)) - before < 15 * MiB, f"RSS grew by {(max(peak, rss(broker)) - before) / MiB:.0f} MB"


def publishes_in_socket(client: WireClient) -> list[bytes]:
    """The payloads of the PUBLISHes that reached ``client``'s socket by now: read without waiting."""
    data = client._buffer
    client.transport.sock.setblocking(False)
    while True:
        try:
            chunk = client.transport.sock.recv(1 << 20)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    payloads = []
    while (whole := split_packet(data)) is not None:
        first, body, data = whole
        if first >> 4 == PUBLISH:
            payloads.append(body[2 + int.from_bytes(body[:2], "big"):])
    return payloads


@pytest.mark.parametrize("reader", ["framer", "amqtt", "framer-v5"])
def test_a_pingreq_is_answered_after_the_publishes_before_it_were_routed(make_broker, reader):
    broker = make_broker(fast_path=reader == "framer")
    v5 = reader.endswith("-v5")
    subscriber = WireClient(broker.port)
    subscriber.send(connect_packet("ordered-sub"), subscribe_packet(1, ("ordered/#", 0)))
    subscriber.read_connack()
    assert subscriber.next().kind == SUBACK
    sender = publisher(broker.port, v5=v5)
    sent = [b"%d" % i for i in range(1000)]  # about 30 KB to the subscriber: its socket takes them all
    publishes = [mqtt5.PublishPacket("ordered/t", p).write() if v5 else publish_packet("ordered/t", p) for p in sent]
    sender.send(*publishes, PINGREQ_PACKET)
    assert sender.next().kind == PINGRESP
    # on loopback the broker's earlier writes to the subscriber are in its socket already
    assert publishes_in_socket(subscriber) == sent


def test_sigterm_with_stuck_subscribers_stops_quickly_and_quietly(make_broker):
    broker = make_broker()
    subscribers = [stuck_subscriber(broker.port, "stop/#", qos) for qos in (0, 1)]
    sender = publisher(broker.port)
    publish_batches(sender, "stop/t", 8, qos=1)  # 4,000 QoS 1 to each: the QoS 1 subscriber acknowledges none
    assert wait_until(lambda: metric(broker, 'ecq_messages_dropped_total{reason="queue_full"}') > 0, 10)
    started = time.monotonic()
    assert broker.stop(timeout=20) == 0
    assert time.monotonic() - started < 5
    log = broker.log()
    assert "Traceback" not in log
    assert len(log) < 20_000, log[-3000:]
    for subscriber in subscribers:
        subscriber.close()


def test_acknowledgement_timeouts_of_a_stuck_qos1_subscriber_are_logged_in_aggregate(make_broker):
    broker = make_broker()
    subscriber = stuck_subscriber(broker.port, "acks/#", 1)
    publish_batches(publisher(broker.port), "acks/t", 2, qos=1)  # 1,000 QoS 1, written to a socket nobody reads
    assert wait_until(lambda: "Timeout waiting for PUBACK" in broker.log(), 15)  # amqtt's 5 s per message
    time.sleep(1)  # the other timeouts come within this (their sends were written within ~0.5 s)
    assert broker.log().count("Timeout waiting for PUBACK") == 1
    assert "Traceback" not in broker.log()
    subscriber.close()
