"""ECQ over every transport amqtt listens on: TCP, TLS, WebSocket and WebSocket over TLS, with paho-mqtt and
MQTT.js (a client written by others, in another language), and the shipped example config
docs/examples/listeners.yaml (the four listeners, password authentication, an ACL using ``${username}``).

The certificate is made here with openssl (self-signed for 127.0.0.1); MQTT.js runs from tests/mqttjs/
(``scripts/setup`` installs it with ``npm ci``).
"""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from pwdlib.hashers.argon2 import Argon2Hasher
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.harness import fixed_header, free_port, topics_payloads, wait_until

REPO = Path(__file__).resolve().parent.parent
MQTTJS = REPO / "tests" / "mqttjs"
EXAMPLE = REPO / "docs" / "examples" / "listeners.yaml"
TRANSPORTS = ["tcp", "tls", "ws", "wss"]
PAHO_TRANSPORT = {"tcp": "tcp", "tls": "tcp", "ws": "websockets", "wss": "websockets"}
URL_SCHEME = {"tcp": "mqtt", "tls": "mqtts", "ws": "ws", "wss": "wss"}
PIPELINED = 300  # writes sent before the first PUBACK is awaited
LARGE = 1_048_576  # bytes: the default max_payload_bytes


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """(certificate, key) PEM paths: a self-signed certificate for 127.0.0.1 and localhost, made with the
    openssl command docs/listeners.md shows."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "server.crt", folder / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=30)
    return str(cert), str(key)


def listener(transport: str, port: int, certificate: tuple[str, str]) -> dict:
    """amqtt's listener mapping for ``transport`` on 127.0.0.1:``port``."""
    config = {"type": "ws" if transport.startswith("ws") else "tcp", "bind": f"127.0.0.1:{port}"}
    if transport in ("tls", "wss"):
        config |= {"ssl": True, "certfile": certificate[0], "keyfile": certificate[1]}
    return config


def transport_of(config: dict) -> str:
    """``tcp``, ``tls``, ``ws`` or ``wss`` for an amqtt listener mapping."""
    return {("tcp", False): "tcp", ("tcp", True): "tls", ("ws", False): "ws", ("ws", True): "wss"}[
        (config.get("type", "tcp"), bool(config.get("ssl")))]


@pytest.fixture
def every_transport(broker_process, certificate):
    """A started broker listening on every transport, and its port for each: (broker, {transport: port})."""
    ports = {transport: free_port() for transport in TRANSPORTS if transport != "tcp"}
    broker = broker_process(listeners={t: listener(t, port, certificate) for t, port in ports.items()}).start()
    return broker, {"tcp": broker.port, **ports}


@pytest.fixture
def paho(connect, certificate):
    """Factory: paho(transport, port, client_id, **kw) -> a harness Client over that transport."""
    def factory(transport: str, port: int, client_id: str, **kwargs):
        ca = certificate[0] if transport in ("tls", "wss") else None
        return connect(port, client_id, transport=PAHO_TRANSPORT[transport], ca=ca, **kwargs)
    return factory


def mqttjs(transport: str, port: int, certificate: tuple[str, str], timeout_s: float = 30, **spec) -> dict:
    """Run one MQTT.js session (tests/mqttjs/ecq_client.mjs, spec keys there) and return its JSON result."""
    if shutil.which("node") is None or not (MQTTJS / "node_modules" / "mqtt").is_dir():
        pytest.fail("MQTT.js is not installed: run scripts/setup test (it installs Node.js and runs npm ci in tests/mqttjs)")
    spec = {"url": f"{URL_SCHEME[transport]}://127.0.0.1:{port}", "timeoutMs": int(timeout_s * 1000),
            "ca": certificate[0] if transport in ("tls", "wss") else None, **spec}
    done = subprocess.run(["node", "ecq_client.mjs"], cwd=MQTTJS, input=json.dumps(spec), capture_output=True,
                          text=True, timeout=timeout_s + 10)
    assert done.returncode == 0, f"MQTT.js failed: {done.stdout}{done.stderr}"
    return json.loads(done.stdout)


def writes(queue: str, count: int, size: int = 16) -> list[tuple[str, bytes]]:
    """``count`` ECQ writes into ``queue``, one key each, payloads of ``size`` bytes that name their index."""
    return [(f"$ECQ/w/{queue}/k{i}", f"{i:08d}".encode().ljust(size, b"x")) for i in range(count)]


def delivered(messages: list[tuple[str, bytes]], queue: str) -> list[tuple[str, bytes]]:
    """What a consumer of ``queue`` receives for ``messages`` written in order: ``$ECQ/<queue>/<key>``."""
    return [(topic.replace(f"$ECQ/w/{queue}/", f"$ECQ/{queue}/"), payload) for topic, payload in messages]


def mqtt_over_websocket(port: int, client_id: str, keepalive: int = 60):
    """A raw MQTT 3.1.1 connection over WebSocket (websockets' sync client), CONNACKed (clean session,
    ``keepalive`` seconds), to send what clients send when things go wrong."""
    ws = ws_connect(f"ws://127.0.0.1:{port}/mqtt", subprotocols=["mqtt"], open_timeout=5)
    connect = b"\x00\x04MQTT\x04\x02" + struct.pack(">HH", keepalive, len(client_id)) + client_id.encode()
    ws.send(fixed_header(0x10, len(connect)) + connect)
    assert ws.recv(timeout=5) == b"\x20\x02\x00\x00"
    return ws


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ecq_writes_and_deliveries_with_paho(every_transport, paho, transport):
    """Over each transport, with paho: pipelined writes and large payloads are PUBACKed, delivered whole and in
    order, their PUBACKs stored (a new connection gets nothing again). amqtt's WebSocket writer sent nothing
    ECQ wrote (no PUBACK, no delivery) until ``amqtt_hooks.websocket`` corrected it."""
    broker, ports = every_transport
    queue = f"paho-{transport}"
    sent = writes(queue, PIPELINED) + [(f"$ECQ/w/{queue}/large{i}", bytes([65 + i]) * LARGE) for i in range(2)]
    producer = paho(transport, ports[transport], f"producer-{transport}")
    infos = producer.publish_many(sent, timeout=60)
    assert [info.is_published() for info in infos] == [True] * len(sent)

    consumer = paho(transport, ports[transport], queue)
    assert consumer.subscribe(f"$ECQ/{queue}/#") == 1
    assert topics_payloads(consumer.expect(len(sent), timeout=60)) == delivered(sent, queue)
    consumer.close()
    again = paho(transport, ports[transport], queue)
    assert again.subscribe(f"$ECQ/{queue}/#") == 1
    assert again.quiet(1.0) == []


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ecq_writes_and_deliveries_with_mqttjs(every_transport, certificate, transport):
    """The same over each transport with MQTT.js 5 (Node.js, which sends each packet in several WebSocket
    messages): pipelined and large writes PUBACKed, delivered whole and in order, acks kept."""
    broker, ports = every_transport
    port, queue = ports[transport], f"js-{transport}"
    sent = [(topic, payload.decode()) for topic, payload in writes(queue, PIPELINED)]
    sent.append((f"$ECQ/w/{queue}/large", "L" * LARGE))
    assert mqttjs(transport, port, certificate, clientId=f"producer-{transport}", publish=sent)["acked"] == len(sent)
    consumer = mqttjs(transport, port, certificate, clientId=queue, subscribe=f"$ECQ/{queue}/#", expect=len(sent))
    assert consumer["granted"] == [1]
    assert [tuple(message) for message in consumer["received"]] == delivered(sent, queue)
    again = mqttjs(transport, port, certificate, clientId=queue, subscribe=f"$ECQ/{queue}/#", quietMs=1000)
    assert again["received"] == []


def test_websocket_drop_redelivers_what_was_not_acked(every_transport, paho):
    """A consumer whose WebSocket drops without DISCONNECT is detached: what it had not acked comes again on
    its next connection (MQTT 3.1.1 section 4.4), what it acked does not."""
    broker, ports = every_transport
    sent = writes("wsdrop", 7)
    paho("ws", ports["ws"], "producer").publish_many(sent)
    consumer = paho("ws", ports["ws"], "wsdrop", manual_ack=True)
    assert consumer.subscribe("$ECQ/wsdrop/#") == 1
    first, *_ = consumer.expect(5)  # reader_batch_size: the window is full
    consumer.ack(first)
    consumer.expect(1)  # k5: sent once the ack of k0 was stored
    consumer.close(clean=False)
    again = paho("ws", ports["ws"], "wsdrop")
    assert again.subscribe("$ECQ/wsdrop/#") == 1
    assert topics_payloads(again.expect(6)) == delivered(sent[1:], "wsdrop")
    assert again.quiet(1.0) == []


def test_websocket_keepalive(every_transport):
    """Over WebSocket a PINGREQ gets its PINGRESP, and a client silent for 1.5 x its keepalive is closed
    (MQTT 3.1.1 sections 3.12, 3.1.2.10)."""
    broker, ports = every_transport
    with mqtt_over_websocket(ports["ws"], "silent", keepalive=1) as ws:
        ws.send(b"\xc0\x00")
        assert ws.recv(timeout=5) == b"\xd0\x00"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=5)  # closed after 1.5 s of silence, not before the timeout


def test_a_websocket_write_cut_by_the_close_is_not_stored(every_transport, paho):
    """MQTT.js sends each packet in several WebSocket messages. A write whose connection drops after part of its
    payload is not a write: nothing is stored (amqtt's reader appended its last message again until the packet
    was "complete", and ECQ stored and delivered a payload its publisher never sent)."""
    broker, ports = every_transport
    ws = mqtt_over_websocket(ports["ws"], "cut")
    topic, payload = b"$ECQ/w/cutq/cut", b"".join(b"%03d" % i for i in range(40))
    ws.send(fixed_header(0x32, 2 + len(topic) + 2 + len(payload)))
    ws.send(struct.pack(">H", len(topic)) + topic + b"\x00\x07")
    ws.send(payload[:30])
    ws.socket.shutdown(socket.SHUT_RDWR)  # the network drops: no DISCONNECT, no close frame
    ws.close()
    paho("ws", ports["ws"], "producer").publish("$ECQ/w/cutq/whole", b"whole")
    consumer = paho("ws", ports["ws"], "cutq")
    assert consumer.subscribe("$ECQ/cutq/#") == 1
    assert topics_payloads(consumer.expect(1)) == [("$ECQ/cutq/whole", b"whole")]
    assert consumer.quiet(1.0) == []


def example_config(broker, certificate, passwd: Path) -> dict:
    """docs/examples/listeners.yaml as shipped, with this test's ports, certificate, password file and data dir:
    the TCP listener ``default`` on the broker's port."""
    config = yaml.safe_load(EXAMPLE.read_text())
    for name, listener_config in config["listeners"].items():
        listener_config["bind"] = f"127.0.0.1:{broker.port if name == 'default' else free_port()}"
        if listener_config.get("ssl"):
            listener_config["certfile"], listener_config["keyfile"] = certificate
    config["plugins"]["amqtt.plugins.authentication.FileAuthPlugin"]["password_file"] = str(passwd)
    ecq = config["plugins"]["ecq.broker.plugin.EcqPlugin"]
    ecq["acl_file"] = str(REPO / ecq["acl_file"])
    ecq |= {key: broker.options[key] for key in ("data_dir", "admin_bind")}
    return config


def test_shipped_listeners_example(broker_process, certificate, paho, tmp_path):
    """The example config docs/listeners.md shows, as shipped: every listener serves ECQ to a user with the right
    password, refuses a wrong password and a client without one; the ACL's ``${username}`` rules let the backend write
    into any queue, and a user read only the queue named as its username."""
    passwd = tmp_path / "passwd"
    passwd.write_text("".join(f"{user}:{Argon2Hasher().hash(user + '-secret')}\n" for user in ("alice", "backend")))
    broker = broker_process()
    config = example_config(broker, certificate, passwd)
    broker.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    broker.start()
    for name, listener_config in config["listeners"].items():
        transport, port = transport_of(listener_config), int(listener_config["bind"].rsplit(":", 1)[1])
        with pytest.raises(ConnectionRefusedError):
            paho(transport, port, "alice", username="alice", password="wrong")
        with pytest.raises(ConnectionRefusedError):
            paho(transport, port, "alice")
        backend = paho(transport, port, f"backend-{name}", username="backend", password="backend-secret")
        backend.publish(f"$ECQ/w/alice/{name}", name.encode())
        alice = paho(transport, port, "alice", username="alice", password="alice-secret")
        assert alice.subscribe("$ECQ/alice/#") == 1
        assert topics_payloads(alice.expect(1)) == [(f"$ECQ/alice/{name}", name.encode())]
        alice.publish("$ECQ/w/alice/self", b"not allowed")  # refused (acl_denied), PUBACKed, not stored
        assert alice.quiet(1.0) == []
        alice.close()
        as_bob = paho(transport, port, "bob", username="alice", password="alice-secret")
        assert as_bob.subscribe("$ECQ/bob/#") == 0x80
        as_bob.close()


def test_websocket_message_over_the_largest_packet_is_refused_and_logged(broker_process):
    """A WebSocket message larger than the largest packet the broker reads (``max_packet_bytes`` plus a fixed
    header) closes its connection, and the broker says why (amqtt's listener closed it without a word)."""
    port = free_port()
    broker = broker_process(listeners={"ws": {"type": "ws", "bind": f"127.0.0.1:{port}"}},
                            max_payload_bytes=1000).start()  # packets up to 1,000 + 65,539 bytes
    with mqtt_over_websocket(port, "big") as ws:
        publish = b"\x00\x0c$ECQ/w/big/k\x00\x01" + b"x" * 70_000
        ws.send(fixed_header(0x32, len(publish)) + publish)  # one message over 66,539 + 5 bytes
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
    assert closed.value.rcvd.code == 1009
    assert wait_until(lambda: "ECQ closed the WebSocket connection" in broker.log(), 5), broker.log()


def silent_websocket_client(port: int, client_id: str) -> socket.socket:
    """A persistent-session MQTT client over a WebSocket opened by hand, which then stops reading: it never
    answers a close frame, as a client whose network went away does not."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"GET /mqtt HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                 b"Sec-WebSocket-Protocol: mqtt\r\n\r\n")
    response = b""
    while b"\r\n\r\n" not in response:
        response += sock.recv(1024)
    assert response.startswith(b"HTTP/1.1 101"), response
    connect = b"\x00\x04MQTT\x04\x00\x00\x3c" + struct.pack(">H", len(client_id)) + client_id.encode()
    packet, mask = fixed_header(0x10, len(connect)) + connect, b"\x01\x02\x03\x04"
    masked = bytes(byte ^ mask[i % 4] for i, byte in enumerate(packet))
    sock.sendall(bytes([0x82, 0x80 | len(packet)]) + mask + masked)  # one masked binary frame (RFC 6455 5.2)
    assert sock.recv(16)[2:4] == b"\x20\x02"  # a binary frame holding the CONNACK
    return sock


def test_a_persistent_takeover_of_a_websocket_client_that_never_answers_the_close_is_not_held(every_transport,
                                                                                            paho):
    """On a persistent session's takeover amqtt closed the old WebSocket and waited for its close frame
    (websockets' close_timeout, 10 s) before it went on: the new connection got its CONNACK 10 s late."""
    _broker, ports = every_transport
    old = silent_websocket_client(ports["ws"], "twice")
    try:
        started = time.monotonic()
        paho("ws", ports["ws"], "twice", clean_session=False)
        assert time.monotonic() - started < 3
    finally:
        old.close()
