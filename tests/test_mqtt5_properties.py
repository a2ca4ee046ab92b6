"""What one MQTT 5 packet's properties may cost (issue 31 point 8): ``max_properties_bytes`` and
``max_user_properties``, refused with DISCONNECT 0x95 (CONNACK 0x95 for a CONNECT) before the properties become
Python objects, measured on the broker's RSS while clients send huge property sets. Real ``ecq broker`` processes,
raw v5 packets over TCP."""

from __future__ import annotations

import threading

import mqtt5
import pytest

from ecq.broker.amqtt_hooks.mqtt5_properties import property_bytes
from tests import mqtt5_wire as raw5
from tests.mqtt_wire import DISCONNECT, WireClient
from tests.test_mqtt5 import stored, v5, v5_packet, wire  # noqa: F401 (v5: the fixture)

CLIENTS, PUBLISHES = 10, 5  # each PUBLISH ~1 MB of User Properties (max_packet_bytes is 1 MB + 64 KiB)
HUGE = raw5.user_properties(90_000, 3)  # 90,000 User Properties of 3-byte names and values: 990,000 bytes


def vm_kib(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak RSS) of process ``pid``, in KiB, from /proc/<pid>/status."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith(f"{field}:"))
    return int(line.split()[1])


def send_and_read_to_the_end(port: int, client_id: str, packets: list[bytes], answers: dict[str, list]) -> None:
    """Connect, send ``packets`` and DISCONNECT, and keep (kind, first body byte) of what the broker answers."""
    client = wire(port, client_id)
    try:
        for packet in packets:
            client.send(packet)
        client.send(mqtt5.DisconnectPacket().write())
    except OSError:
        pass  # the broker closed the connection after its DISCONNECT: what it sent is still read below
    answers[client_id] = [(p.kind, p.body[:1]) for p in client.until_closed()]


def test_huge_user_property_sets_are_refused_before_they_cost_memory(make_broker, v5):
    broker = make_broker()
    before = vm_kib(broker.proc.pid, "VmRSS")
    packets = [raw5.publish(f"$ECQ/w/props/k{n}" if n % 2 else f"plain/props{n}", HUGE, packet_id=n + 1)
               for n in range(PUBLISHES)]
    answers: dict[str, list] = {}
    threads = [threading.Thread(target=send_and_read_to_the_end, args=(broker.port, f"props{n}", packets, answers))
               for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == {f"props{n}": [(DISCONNECT, b"\x95")] for n in range(CLIENTS)}
    growth_mib = (vm_kib(broker.proc.pid, "VmHWM") - before) / 1024
    assert growth_mib < 40, f"the broker's peak RSS grew by {growth_mib:.0f} MiB"
    assert stored(broker, "props") == 0
    assert v5(broker.port, "after-props").publish("$ECQ/w/after/k", "still served") == (0, None)


def test_the_user_property_count_is_bounded_and_a_packet_within_both_bounds_is_taken(make_broker):
    broker = make_broker(max_user_properties=100, max_properties_bytes=4096)
    within = wire(broker.port, "within")
    within.send(raw5.publish("$ECQ/w/bound/k", raw5.user_properties(100)))  # 100 x 7 bytes: within both
    assert v5_packet(within.next()).reason_code == 0
    for client_id, properties in (("count", raw5.user_properties(101)), ("bytes", raw5.user_properties(1, 2046))):
        client = wire(broker.port, client_id)
        client.send(raw5.publish("$ECQ/w/bound/j", properties))
        assert [(p.kind, p.body[:1]) for p in client.until_closed()] == [(DISCONNECT, b"\x95")]
    assert "101 User Properties, above max_user_properties 100" in broker.log()
    assert "4097 bytes of properties, above max_properties_bytes 4096" in broker.log()
    assert stored(broker, "bound") == 1


@pytest.mark.parametrize("packet", [
    raw5.subscribe("plain/#", HUGE),
    raw5.publish("plain/t", HUGE, qos=0),
    b"\x40" + raw5.varint(3 + len(raw5.varint(len(HUGE))) + len(HUGE)) + b"\x00\x01\x00"
    + raw5.varint(len(HUGE)) + HUGE,  # PUBACK
], ids=["subscribe", "qos0-publish", "puback"])
def test_every_packet_type_is_bounded(broker, packet):
    client = wire(broker.port, "every")
    client.send(packet)
    assert [(p.kind, p.body[:1]) for p in client.until_closed()] == [(DISCONNECT, b"\x95")]


@pytest.mark.parametrize("properties, will_properties", [
    (HUGE, None),
    (b"", HUGE),  # the Will's User Properties count too
    (raw5.user_properties(600), raw5.user_properties(600)),  # 1200 together, above 1024
], ids=["connect", "will", "together"])
def test_a_connect_beyond_the_bounds_gets_connack_0x95(broker, properties, will_properties):
    client = WireClient(broker.port)
    client.send(raw5.connect("huge", properties, will_properties))
    connack = v5_packet(client.next())
    assert isinstance(connack, mqtt5.ConnAckPacket) and connack.reason_code == 0x95
    assert client.until_closed() == []


@pytest.mark.parametrize("packet, size", [
    (mqtt5.ConnectPacket("c", user_properties=[("a", "b")], will=mqtt5.Will("w", user_properties=[("cc", "d")])
                         ).write(), 7 + 8),
    (mqtt5.ConnectPacket("c", receive_max=10).write(), 3),
    (mqtt5.PublishPacket("t/1", b"v", qos=mqtt5.QoS.AT_LEAST_ONCE, packet_id=3, content_type="text").write(), 7),
    (mqtt5.PublishPacket("t", b"", user_properties=[("k", "v")]).write(), 7),
    (mqtt5.SubscribePacket(1, [mqtt5.TopicFilter("a")], subscription_id=200).write(), 3),
    (mqtt5.PubAckPacket(1, reason_code=mqtt5.PubAckReasonCode(0x80), reason_str="no").write(), 5),
    (mqtt5.PubAckPacket(1).write(), 0),
    (mqtt5.DisconnectPacket(reason_str="bye").write(), 6),
    (mqtt5.DisconnectPacket().write(), 0),
], ids=["connect-and-will", "connect", "publish-qos1", "publish-qos0", "subscribe", "puback", "puback-short",
        "disconnect", "disconnect-short"])
def test_property_bytes_are_read_from_the_property_lengths(packet, size):
    assert property_bytes(packet) == size
