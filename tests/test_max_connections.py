"""``max_connections`` (issue 32, point 7), over TCP, WebSocket and TLS against real ``ecq broker`` processes: with a
cap of 3 and 3 clients connected, a 4th CONNECT gets CONNACK 0x03 Server unavailable (MQTT 3.1.1 section 3.2.2.3;
MQTT 5: 0x97 Quota exceeded) with session present 0 and is closed, its persistent session untouched; once a client
leaves the next one is accepted; a takeover of a connected client id is accepted at the cap; the cap counts every
listener. Raw sockets check the bytes, paho (3.1.1 and v5) that real clients read the refusal.
"""

from __future__ import annotations

import threading

import mqtt5
import paho.mqtt.client as mqtt
import pytest

from ecq.testing import free_port, wait_until
from tests.harness import metrics_text
from tests.mqtt_wire import (CONNACK, PINGREQ_PACKET, PINGRESP, PUBACK, PUBLISH, SUBACK, WireClient, connect_packet,
                             puback_packet, publish_packet, subscribe_packet)
from tests.test_mqtt5 import v5_packet
from tests.test_transports import certificate, listener  # noqa: F401 (certificate: a fixture)

CAP = 3
WAIT_S = 10.0


@pytest.fixture
def capped(broker_process):
    """A broker with ``max_connections: 3``, a WebSocket listener beside its TCP one: (broker, ws port)."""
    ws_port = free_port()
    broker = broker_process(max_connections=CAP,
                            listeners={"ws": {"type": "ws", "bind": f"127.0.0.1:{ws_port}"}}).start()
    return broker, ws_port


@pytest.fixture
def wire():
    """Factory: wire(port, client_id, transport="tcp", clean_session=True) -> a connected WireClient; all closed at
    teardown."""
    clients: list[WireClient] = []

    def factory(port: int, client_id: str, transport: str = "tcp", clean_session: bool = True) -> WireClient:
        client, _present = WireClient.connected(port, client_id, clean_session, transport)
        clients.append(client)
        return client

    yield factory
    for client in clients:
        client.close()


def metric(broker, name: str) -> float:
    """The value of the unlabelled metric ``name`` on the broker's /metrics page."""
    for line in metrics_text(broker).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def connections_drop_to(broker, count: int) -> None:
    assert wait_until(lambda: metric(broker, "ecq_connections") == count, WAIT_S), metrics_text(broker)


def refused_3_1_1(port: int, client_id: str, transport: str = "tcp", clean_session: bool = True) -> None:
    """A raw 3.1.1 CONNECT gets CONNACK 0x03 with session present 0, then the connection is closed."""
    client = WireClient(port, transport)
    try:
        client.send(connect_packet(client_id, clean_session))
        connack = client.next()
        assert connack is not None and connack.kind == CONNACK and connack.body == b"\x00\x03", connack
        assert client.until_closed() == []
    finally:
        client.close()


def paho_connack(port: int, client_id: str, protocol: int, ca: str | None = None) -> str:
    """The CONNACK paho-mqtt (``protocol`` MQTTv311 or MQTTv5; over TLS trusting ``ca``, a PEM file, if given) reads
    for ``client_id``, as paho names its code."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol,
                         reconnect_on_failure=False)
    if ca is not None:
        client.tls_set(ca_certs=ca)
    answered, reasons = threading.Event(), []
    client.on_connect = lambda _c, _u, _flags, reason, _p: (reasons.append(reason), answered.set())
    client.connect("127.0.0.1", port, keepalive=30)
    client.loop_start()
    try:
        assert answered.wait(WAIT_S), f"no CONNACK for {client_id!r}"
        return str(reasons[0])
    finally:
        client.disconnect()
        client.loop_stop()


def test_the_connect_beyond_the_cap_is_refused_until_one_leaves(capped, wire):
    """3.1.1 on raw sockets: the 4th CONNECT (a persistent client with a message queued) gets 0x03 and is closed, is
    counted, and its session is untouched: once a client left it connects with session present 1 and gets it."""
    broker, _ws = capped
    late = wire(broker.port, "late", clean_session=False)
    late.send(subscribe_packet(1, ("news/#", 1)))
    assert late.next().kind == SUBACK
    late.close()
    publisher = wire(broker.port, "publisher")
    publisher.send(publish_packet("news/1", b"kept", qos=1, packet_id=1))
    assert publisher.next().kind == PUBACK  # routed to late's offline session
    first, _third = wire(broker.port, "first"), wire(broker.port, "third")
    refused_3_1_1(broker.port, "late", clean_session=False)
    assert metric(broker, "ecq_connections_refused_total") == 1
    assert "refused (CONNACK 0x03, MQTT 5 0x97): 3 clients connected, max_connections 3" in broker.log()
    first.close()
    connections_drop_to(broker, CAP - 1)
    late, present = WireClient.connected(broker.port, "late", clean_session=False)
    try:
        assert present
        delivery = late.next()
        assert delivery.kind == PUBLISH and delivery.publish().payload == b"kept", delivery
        late.send(puback_packet(delivery.publish().packet_id))
    finally:
        late.close()


def test_an_mqtt5_connect_beyond_the_cap_gets_quota_exceeded(capped, wire):
    """MQTT 5 on a raw socket: the 4th CONNECT gets CONNACK 0x97 Quota exceeded with session present 0, closed."""
    broker, _ws = capped
    for client_id in ("a", "b", "c"):
        wire(broker.port, client_id)
    client = WireClient(broker.port)
    try:
        client.send(mqtt5.ConnectPacket("d", clean_start=True).write())
        connack = v5_packet(client.next())
        assert connack.reason_code == 0x97 and not connack.session_present, connack
        assert client.until_closed() == []
    finally:
        client.close()


@pytest.mark.parametrize("protocol, refusal", [(mqtt.MQTTv311, "Server unavailable"), (mqtt.MQTTv5, "Quota exceeded")])
def test_paho_reads_the_refusal_and_connects_once_there_is_room(capped, wire, protocol, refusal):
    broker, _ws = capped
    first = wire(broker.port, "a")
    wire(broker.port, "b"), wire(broker.port, "c")
    assert paho_connack(broker.port, "paho", protocol) == refusal
    first.close()
    connections_drop_to(broker, CAP - 1)
    assert paho_connack(broker.port, "paho", protocol) == "Success"


def test_a_takeover_at_the_cap_is_accepted(capped, wire):
    """A CONNECT of a connected client id adds no connection: accepted at the cap, the old connection closed, the
    count still 3 (a new client id is still refused)."""
    broker, _ws = capped
    old = wire(broker.port, "a")
    wire(broker.port, "b"), wire(broker.port, "c")
    new = wire(broker.port, "a")
    assert old.until_closed() == []
    new.send(PINGREQ_PACKET)  # the new connection is served
    assert new.next().kind == PINGRESP
    connections_drop_to(broker, CAP)
    refused_3_1_1(broker.port, "d")


def test_the_cap_counts_every_listener(capped, wire):
    """Two clients over TCP and one over WebSocket fill the cap: a 4th is refused on either listener; one leaving
    the WebSocket listener makes room on the TCP one."""
    broker, ws_port = capped
    wire(broker.port, "tcp1"), wire(broker.port, "tcp2")
    over_ws = wire(ws_port, "ws1", transport="ws")
    refused_3_1_1(ws_port, "ws2", transport="ws")
    refused_3_1_1(broker.port, "tcp3")
    over_ws.close()
    connections_drop_to(broker, CAP - 1)
    wire(broker.port, "tcp3")


@pytest.mark.parametrize("protocol, refusal", [(mqtt.MQTTv311, "Server unavailable"), (mqtt.MQTTv5, "Quota exceeded")])
def test_the_cap_holds_on_a_tls_listener(broker_process, connect, certificate, protocol, refusal):
    """Over TLS (amqtt's ``ssl`` listener, paho trusting the test certificate): two TLS clients and one TCP client
    fill the cap, a 4th CONNECT over TLS gets the refusal, and is accepted once a TLS client left."""
    tls_port = free_port()
    broker = broker_process(max_connections=CAP,
                            listeners={"tls": listener("tls", tls_port, certificate)}).start()
    ca = certificate[0]
    first = connect(tls_port, "tls1", ca=ca)
    connect(tls_port, "tls2", ca=ca), connect(broker.port, "tcp1")
    assert paho_connack(tls_port, "tls3", protocol, ca=ca) == refusal
    first.close()
    connections_drop_to(broker, CAP - 1)
    assert paho_connack(tls_port, "tls3", protocol, ca=ca) == "Success"
