"""MQTT 5.0 clients written by others on ECQ (issue 25), against real ``ecq broker`` processes: MQTT.js 5 with
``protocolVersion: 5`` over TCP and WebSocket, paho-mqtt MQTTv5 over TLS, and QoS 0 writes from
``mosquitto_pub -V mqttv5`` (its default QoS) and paho. What each client reports of a write's PUBACK reason code
(MQTT 5.0 section 3.4.2.1) and of a delivery's User Properties ``ecq-seqno``/``ecq-ts`` (section 3.3.2.3.7).

mosquitto_sub 2.0.11 (libmosquitto) has no WebSocket transport (``mosquitto_sub --help`` lists none), so
``mosquitto_sub -V mqttv5`` is run here over TLS instead; over TCP it is in tests/test_mqtt5.py.
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time

import paho.mqtt.client as mqtt
import pytest

from tests.harness import free_port
from tests.test_mqtt5 import WAIT_S, stored, user_properties, v5  # noqa: F401  (v5: a fixture)
from tests.test_transports import certificate, listener, mqttjs  # noqa: F401  (certificate: a fixture)

V5 = 5  # MQTT.js protocolVersion
TOPIC_NAME_INVALID = 0x90  # the v5 code of a refused ``not_a_write`` (docs/mqtt5.md, "Refused writes")


@pytest.fixture
def tcp_and_ws(broker_process, certificate):  # noqa: F811
    """A started broker with a TCP and a WebSocket listener: (broker, {"tcp": port, "ws": port})."""
    ws_port = free_port()
    broker = broker_process(listeners={"ws": listener("ws", ws_port, certificate)}).start()
    return broker, {"tcp": broker.port, "ws": ws_port}


@pytest.fixture
def tls_broker(broker_process, certificate):  # noqa: F811
    """A started broker with a TLS listener (the module's self-signed certificate): (broker, TLS port)."""
    tls_port = free_port()
    broker = broker_process(listeners={"tls": listener("tls", tls_port, certificate)}).start()
    return broker, tls_port


def assert_ecq_properties(properties: list[dict[str, str]], seqnos: list[int], before_ms: float,
                          after_ms: float) -> None:
    """Each delivery's ``ecq-seqno`` is the expected one and its ``ecq-ts`` (Unix ms) lies within a second of
    [before_ms, after_ms], the span in which its write was made."""
    assert [int(p["ecq-seqno"]) for p in properties] == seqnos, properties
    assert all(before_ms - 1000 <= int(p["ecq-ts"]) <= after_ms + 1000 for p in properties), properties


@pytest.mark.parametrize("transport", ["tcp", "ws"])
def test_mqttjs_v5_sees_each_write_acked_with_its_reason_code(tcp_and_ws, certificate, transport):  # noqa: F811
    """MQTT.js 5 (MQTT 5.0): a stored write is PUBACKed 0x00; a refused one (``$ECQ/<clientid>/<key>`` is a
    queue's topic, not a write: ``not_a_write``) gets 0x90, which MQTT.js reports as a publish error carrying
    that code and the Reason String; nothing of it is stored."""
    broker, ports = tcp_and_ws
    queue_name = f"js5-{transport}"
    sent = [(f"$ECQ/w/{queue_name}/k0", "v0"), (f"$ECQ/{queue_name}/k", "not a write"),
            (f"$ECQ/w/{queue_name}/k1", "v1")]
    result = mqttjs(transport, ports[transport], certificate, clientId=f"producer-{transport}", protocolVersion=V5,
                    publish=sent)
    (first, _), (refused, reason_string), (last, _) = result["acks"]
    assert (first, refused, last) == (0, TOPIC_NAME_INVALID, 0)
    assert "refused" in reason_string, reason_string
    assert stored(broker, queue_name) == 2


@pytest.mark.parametrize("transport", ["tcp", "ws"])
def test_mqttjs_v5_consumer_sees_ecq_seqno_and_ts(tcp_and_ws, certificate, transport):  # noqa: F811
    """An MQTT.js 5 consumer of ``$ECQ/<clientid>/#`` gets each delivery with the User Properties ``ecq-seqno``
    (1, 2, 3 in write order) and ``ecq-ts`` (the write's time, Unix ms)."""
    _broker, ports = tcp_and_ws
    queue_name = f"js5c-{transport}"
    sent = [(f"$ECQ/w/{queue_name}/k{n}", f"v{n}") for n in range(3)]
    before_ms = time.time() * 1000
    assert mqttjs(transport, ports[transport], certificate, clientId=f"producer-{transport}", protocolVersion=V5,
                  publish=sent)["acked"] == 3
    after_ms = time.time() * 1000
    consumer = mqttjs(transport, ports[transport], certificate, clientId=queue_name, protocolVersion=V5,
                      subscribe=f"$ECQ/{queue_name}/#", expect=3)
    assert consumer["granted"] == [1]
    assert consumer["received"] == [[f"$ECQ/{queue_name}/k{n}", f"v{n}"] for n in range(3)]
    assert_ecq_properties(consumer["userProperties"], [1, 2, 3], before_ms, after_ms)


class TlsV5Client:
    """A paho-mqtt MQTT 5.0 client over TLS trusting ``ca`` (tests.test_mqtt5.V5Client has no TLS), with bounded
    waits: each PUBLISH's reason code, each message with its properties."""

    def __init__(self, port: int, client_id: str, ca: str) -> None:
        self.messages: queue.Queue = queue.Queue()
        self.subacks: queue.Queue = queue.Queue()
        self.acks: queue.Queue = queue.Queue()
        self._c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        self._c.tls_set(ca_certs=ca)
        self._c.on_publish = lambda _c, _u, _mid, code, _p: self.acks.put(code.value)
        self._c.on_message = lambda _c, _u, m: self.messages.put(m)
        self._c.on_subscribe = lambda _c, _u, _mid, codes, _p: self.subacks.put([c.value for c in codes])
        connected = threading.Event()
        self._c.on_connect = lambda *_args: connected.set()
        self._c.connect("127.0.0.1", port, keepalive=30, clean_start=True)
        self._c.loop_start()
        assert connected.wait(WAIT_S), f"no CONNACK over TLS for {client_id!r}"

    def publish(self, topic: str, payload: str) -> int:
        """PUBLISH at QoS 1 and return its PUBACK's reason code."""
        self._c.publish(topic, payload, 1)
        return self.acks.get(timeout=WAIT_S)

    def subscribe(self, topic_filter: str) -> list[int]:
        """SUBSCRIBE at QoS 1; the SUBACK's reason codes."""
        self._c.subscribe(topic_filter, options=mqtt.SubscribeOptions(qos=1))
        return self.subacks.get(timeout=WAIT_S)

    def close(self) -> None:
        self._c.disconnect()
        self._c.loop_stop()


@pytest.fixture
def tls_v5(certificate):  # noqa: F811
    """Factory: tls_v5(port, client_id) -> TlsV5Client trusting the module's certificate; closed at teardown."""
    clients: list[TlsV5Client] = []

    def factory(port: int, client_id: str) -> TlsV5Client:
        clients.append(TlsV5Client(port, client_id, certificate[0]))
        return clients[-1]

    yield factory
    for client in clients:
        client.close()


def test_paho_v5_over_tls_writes_and_reads_with_ecq_seqno(tls_broker, tls_v5):
    """paho-mqtt MQTTv5 over TLS: a write is PUBACKed 0x00, its delivery carries ``ecq-seqno`` and ``ecq-ts``."""
    _broker, port = tls_broker
    before_ms = time.time() * 1000
    assert tls_v5(port, "tls5-producer").publish("$ECQ/w/tls5/k", "over tls") == 0
    after_ms = time.time() * 1000
    consumer = tls_v5(port, "tls5")
    assert consumer.subscribe("$ECQ/tls5/#") == [1]
    message = consumer.messages.get(timeout=WAIT_S)
    assert (message.topic, message.payload) == ("$ECQ/tls5/k", b"over tls")
    assert_ecq_properties([user_properties(message)], [1], before_ms, after_ms)


def test_mosquitto_sub_v5_over_tls(tls_broker, tls_v5, certificate):  # noqa: F811
    """``mosquitto_sub -V mqttv5`` over TLS (it has no WebSocket transport) gets a delivery with ``ecq-seqno``."""
    _broker, port = tls_broker
    assert tls_v5(port, "tls5-producer").publish("$ECQ/w/mqtls5/k", "v") == 0
    done = subprocess.run(["mosquitto_sub", "-V", "mqttv5", "-h", "127.0.0.1", "-p", str(port), "--cafile",
                           certificate[0], "-i", "mqtls5", "-q", "1", "-t", "$ECQ/mqtls5/#", "-C", "1", "-W", "10",
                           "-F", "%t %p %P"], capture_output=True, text=True, timeout=WAIT_S + 5)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("$ECQ/mqtls5/k v ecq-seqno:1 ecq-ts:"), done.stdout


def test_mosquitto_pub_v5_default_qos0_write_is_stored_and_delivered(broker, v5):  # noqa: F811
    """``mosquitto_pub -V mqttv5`` without ``-q`` sends a QoS 0 PUBLISH, then DISCONNECT at once: the write is
    stored (no PUBACK tells the client so) and delivered to the queue's consumer with its ``ecq-seqno``."""
    subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-h", "127.0.0.1", "-p", str(broker.port), "-i", "mqpub0",
                    "-t", "$ECQ/w/q0m/k", "-m", "qos 0"], check=True, timeout=WAIT_S)
    consumer = v5(broker.port, "q0m")
    assert consumer.subscribe("$ECQ/q0m/#") == [1]
    [message] = consumer.expect(1)
    assert (message.topic, message.payload, user_properties(message)["ecq-seqno"]) == ("$ECQ/q0m/k", b"qos 0", "1")
    assert stored(broker, "q0m") == 1


def test_paho_v5_qos0_write_is_stored_and_delivered(broker, v5):  # noqa: F811
    """paho MQTTv5 QoS 0 writes (no acknowledgement) are stored in order and delivered with their seqnos."""
    producer = v5(broker.port, "paho-q0")
    for n in range(3):
        assert producer.publish(f"$ECQ/w/q0p/k{n}", f"v{n}", qos=0) == (0, None)  # paho's "sent", not a PUBACK
    consumer = v5(broker.port, "q0p")
    assert consumer.subscribe("$ECQ/q0p/#") == [1]
    messages = consumer.expect(3)
    assert [(m.topic, m.payload, user_properties(m)["ecq-seqno"]) for m in messages] == [
        (f"$ECQ/q0p/k{n}", f"v{n}".encode(), str(n + 1)) for n in range(3)]
