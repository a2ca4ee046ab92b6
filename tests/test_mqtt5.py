"""MQTT 5.0 clients on ECQ (issue 25, first slice): paho-mqtt with ``protocol=MQTTv5``, raw v5 packets (encoded with
the ``mqtt5`` codec) and mosquitto_pub/sub ``-V mqttv5``, over TCP (and WebSocket) against real ``ecq broker``
processes: reason codes of refused writes, ``ecq-seqno``/``ecq-ts`` on deliveries, Receive Maximum, SUBACK
refusals, what is refused with which code, and 3.1.1 clients beside them."""

from __future__ import annotations

import queue
import subprocess
import urllib.error
import threading
import time

import mqtt5
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests import mqtt5_wire as raw5
from tests.harness import free_port, topics_payloads, wait_until
from tests.mqtt5_wire import (MAXIMUM_PACKET_SIZE, RECEIVE_MAXIMUM, REQUEST_PROBLEM_INFORMATION,
                              REQUEST_RESPONSE_INFORMATION, SESSION_EXPIRY_INTERVAL, SUBSCRIPTION_IDENTIFIER,
                              TOPIC_ALIAS, WILL_DELAY_INTERVAL, prop)
from tests.mqtt_wire import DISCONNECT, PUBLISH, WireClient, split_packet
from tests.test_acl_broker import acl_broker
from tests.test_operations import scrape
from tests.test_rewind import queue as queue_info

WAIT_S = 10.0


class V5Client:
    """A paho-mqtt MQTT 5.0 client with bounded waits: each PUBLISH's acknowledgement (reason code and Reason
    String), each message with its User Properties, SUBACK reason codes, the CONNACK's properties and Session
    Present flag; ``username`` and ``password`` go in the CONNECT."""

    def __init__(self, port: int, client_id: str = "", manual_ack: bool = False, transport: str = "tcp",
                 clean_start: bool = True, username: str | None = None, password: str | None = None,
                 **connect_properties) -> None:
        self.messages: queue.Queue = queue.Queue()
        self.subacks: queue.Queue = queue.Queue()
        self.acks: dict[int, tuple[int, str | None]] = {}
        self._c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5,
                              manual_ack=manual_ack, transport=transport)
        self._c.on_publish = lambda _c, _u, mid, code, props: self.acks.__setitem__(
            mid, (code.value, getattr(props, "ReasonString", None)))
        self._c.on_message = lambda _c, _u, m: self.messages.put(m)
        self._c.on_subscribe = lambda _c, _u, _mid, codes, _p: self.subacks.put([c.value for c in codes])
        connected, self.connack = threading.Event(), []
        self._c.on_connect = lambda _c, _u, flags, reason, props: (
            self.connack.extend([reason, props]), setattr(self, "session_present", flags.session_present),
            connected.set())
        if username is not None:
            self._c.username_pw_set(username, password)
        properties = Properties(PacketTypes.CONNECT)
        for name, value in connect_properties.items():
            setattr(properties, name, value)
        self._c.connect("127.0.0.1", port, keepalive=30, clean_start=clean_start,
                        properties=properties if connect_properties else None)
        self._c.loop_start()
        assert connected.wait(WAIT_S), f"no CONNACK for {client_id!r}"
        assert not self.connack[0].is_failure, self.connack[0]

    def publish(self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False,
                **publish_properties) -> tuple[int, str | None]:
        """PUBLISH (QoS 1 by default) with paho ``Properties`` names as keywords and wait for the PUBACK (a QoS 0
        PUBLISH: until it is written): (reason code, Reason String or None)."""
        properties = Properties(PacketTypes.PUBLISH)
        for name, value in publish_properties.items():
            setattr(properties, name, value)
        info = self._c.publish(topic, payload, qos, retain, properties if publish_properties else None)
        if not qos:
            info.wait_for_publish(WAIT_S)
            return 0, None
        assert wait_until(lambda: info.mid in self.acks, WAIT_S), f"no PUBACK for {topic!r}"
        return self.acks[info.mid]

    def subscribe(self, *filters: str, subscription_id: int | None = None, **options) -> list[int]:
        """SUBSCRIBE to ``filters`` at QoS 1 (paho ``SubscribeOptions`` keywords apply to each), with a Subscription
        Identifier if given; the SUBACK codes."""
        properties = None
        if subscription_id is not None:
            properties = Properties(PacketTypes.SUBSCRIBE)
            properties.SubscriptionIdentifier = subscription_id
        self._c.subscribe([(f, mqtt.SubscribeOptions(qos=1, **options)) for f in filters], properties=properties)
        return self.subacks.get(timeout=WAIT_S)

    def expect(self, count: int) -> list:
        deadline = time.monotonic() + WAIT_S
        return [self.messages.get(timeout=max(0.01, deadline - time.monotonic())) for _ in range(count)]

    def close(self) -> None:
        self._c.disconnect()
        self._c.loop_stop()


@pytest.fixture
def v5():
    """Factory: v5(port, client_id, **kw) -> V5Client; all are closed at teardown."""
    clients: list[V5Client] = []

    def factory(*args, **kwargs) -> V5Client:
        clients.append(V5Client(*args, **kwargs))
        return clients[-1]

    yield factory
    for client in clients:
        client.close()


def wire(port: int, client_id: str, transport: str = "tcp", **connect_options) -> WireClient:
    """A raw connection that sent a v5 CONNECT and read a CONNACK accepting it."""
    client = WireClient(port, transport)
    client.send(mqtt5.ConnectPacket(client_id, clean_start=True, **connect_options).write())
    connack = v5_packet(client.next())
    assert isinstance(connack, mqtt5.ConnAckPacket) and connack.reason_code == 0, connack
    return client


def v5_packet(packet) -> object:
    """A tests.mqtt_wire Packet decoded as MQTT 5.0."""
    assert packet is not None, "the connection ended"
    length, encoded = len(packet.body), bytearray()
    while True:
        encoded.append((length & 0x7F) | (0x80 if length > 0x7F else 0))
        length >>= 7
        if not length:
            break
    return mqtt5.read(memoryview(bytes([packet.first]) + bytes(encoded) + packet.body))[0]


def stored(broker, clientid: str) -> int:
    """Entries stored in the queue of ``clientid`` (0 for a queue the broker does not know)."""
    try:
        return queue_info(broker, clientid)["stored"]
    except urllib.error.HTTPError as exc:
        assert exc.code == 404
        return 0


def user_properties(message) -> dict[str, str]:
    return dict(getattr(message.properties, "UserProperty", []))


def test_a_stored_write_is_acked_0_and_delivered_with_its_seqno_and_time(broker, v5):
    producer = v5(broker.port, "v5-producer")
    before_ms = time.time() * 1000
    assert [producer.publish(f"$ECQ/w/v5q/k{n}", f"v{n}") for n in range(3)] == [(0, None)] * 3
    after_ms = time.time() * 1000
    consumer = v5(broker.port, "v5q")
    assert consumer.subscribe("$ECQ/v5q/#") == [1]
    messages = consumer.expect(3)
    assert [(m.topic, m.payload) for m in messages] == [(f"$ECQ/v5q/k{n}", f"v{n}".encode()) for n in range(3)]
    properties = [user_properties(m) for m in messages]
    assert [int(p["ecq-seqno"]) for p in properties] == [1, 2, 3]
    assert all(before_ms - 1000 <= int(p["ecq-ts"]) <= after_ms + 1000 for p in properties), properties
    assert queue_info(broker, "v5q")["last_seqno"] == 3


REFUSALS = [  # (broker options, ACL rules, topic, payload, reason, v5 code)
    ({}, "{deny, all, publish, [\"$ECQ/w/#\"]}.\n{allow, all}.\n", "$ECQ/w/rq/k", "v", "acl_denied", 0x87),
    ({}, None, "$ECQ/ctl/rq/rewind", "earliest", "not_owner", 0x87),
    ({"max_queue_bytes": 10, "quota_policy": "refuse"}, None, "$ECQ/w/rq/k", "x" * 20, "quota_exceeded", 0x97),
    ({"max_payload_bytes": 8}, None, "$ECQ/w/rq/k", "x" * 20, "payload_too_large", 0x97),
    ({}, None, "$ECQ/w/ctl/k", "v", "bad_clientid", 0x90),
    ({}, None, "$ECQ/w/rq/", "v", "empty_key", 0x90),
    ({}, None, "$ECQ/rq/k", "v", "not_a_write", 0x90),
    ({}, None, "$ECQ/ctl/v5-producer/rewind", "nonsense", "bad_rewind", 0x99),
]


@pytest.mark.parametrize("options, rules, topic, payload, reason, code", REFUSALS, ids=[r[4] for r in REFUSALS])
def test_a_refused_write_gets_its_reason_code_and_string_and_nothing_is_stored(make_broker, tmp_path, v5, options,
                                                                               rules, topic, payload, reason, code):
    broker = acl_broker(make_broker, tmp_path, rules, **options)[0] if rules else make_broker(**options)
    producer = v5(broker.port, "v5-producer")
    acked, message = producer.publish(topic, payload)
    assert acked == code
    assert message and ("refused" in message), message
    assert scrape(broker).get(f"ecq_writes_refused_total{{reason={reason}}}") == 1
    assert stored(broker, "rq") == 0
    producer.close()
    quiet = v5(broker.port, "v5-producer", RequestProblemInformation=0)  # no Reason String unless asked for
    assert quiet.publish(topic, payload) == (code, None)


def test_a_refused_qos2_write_ends_its_flow_with_the_pubrec_code(broker):
    client = wire(broker.port, "v5-raw")
    client.send(mqtt5.PublishPacket("$ECQ/w/ctl/k", b"v", qos=mqtt5.QoS.EXACTLY_ONCE, packet_id=7).write())
    pubrec = v5_packet(client.next())
    assert isinstance(pubrec, mqtt5.PubRecPacket) and (pubrec.packet_id, pubrec.reason_code) == (7, 0x90)
    assert "cannot own a queue" in pubrec.reason_str
    # the packet id is free again: the same id is a new write, stored and PUBRECed 0x00
    client.send(mqtt5.PublishPacket("$ECQ/w/q2/k", b"v", qos=mqtt5.QoS.EXACTLY_ONCE, packet_id=7).write())
    assert (v5_packet(client.next()).reason_code) == 0
    assert stored(broker, "q2") == 1


def test_v5_and_3_1_1_clients_interoperate(broker, v5, connect):
    old = connect(broker.port, "old-consumer")
    assert old.subscribe("plain/#") == 1
    new = v5(broker.port, "new-consumer")
    assert new.subscribe("plain/#") == [1]
    producer = v5(broker.port, "new-producer")
    assert producer.publish("plain/a", "from-v5") == (0, None)
    connect(broker.port, "old-producer").publish("plain/b", "from-3.1.1")
    assert topics_payloads(old.expect(2)) == [("plain/a", b"from-v5"), ("plain/b", b"from-3.1.1")]
    assert [(m.topic, m.payload) for m in new.expect(2)] == [("plain/a", b"from-v5"), ("plain/b", b"from-3.1.1")]
    assert producer.publish("$ECQ/w/old-consumer/k", "queued") == (0, None)
    assert old.subscribe("$ECQ/old-consumer/#") == 1
    assert topics_payloads(old.expect(1)) == [("$ECQ/old-consumer/k", b"queued")]


def test_suback_says_why_a_filter_is_refused(broker, v5):
    client = v5(broker.port, "sub5")
    assert client.subscribe("$ECQ/someone-else/#") == [0x87]
    assert client.subscribe("$ECQ/sub5/#", "$share/g/$ECQ/sub5/#", "plain/#") == [1, 0x9E, 1]


def test_a_suback_refusal_carries_its_reason_string_unless_problem_information_is_off(broker):
    """MQTT 5.0 section 3.9.2.1.2: the SUBACK's Reason String says why ECQ refused its ``$ECQ/`` filters, as a refused
    write's PUBACK does; none for a client that set Request Problem Information 0 (section 3.1.2.11.7)."""
    def subscribe(client, *filters: tuple[str, int]):
        client.send(mqtt5.SubscribePacket(1, [mqtt5.TopicFilter(f, max_qos=mqtt5.QoS(qos), retain_as_published=False)
                                              for f, qos in filters]).write())
        return v5_packet(client.next())

    suback = subscribe(wire(broker.port, "why5"), ("$ECQ/someone-else/#", 1), ("$ECQ/why5/#", 0), ("plain/#", 1))
    assert suback.reason_codes == [0x87, 0x80, 1]
    assert suback.reason_str == ("'$ECQ/someone-else/#' is not this client's queue: a client may only read its own, "
                                 "'$ECQ/why5/#'; QoS 0 refused on '$ECQ/why5/#': ECQ queues are read at QoS 1")
    suback = subscribe(wire(broker.port, "quiet5", request_problem_info=False), ("$ECQ/someone-else/#", 1))
    assert (suback.reason_codes, suback.reason_str) == ([0x87], None)


def test_receive_maximum_bounds_the_deliveries_in_flight(broker, v5):
    producer = v5(broker.port, "rm-producer")
    for n in range(5):
        assert producer.publish(f"$ECQ/w/rm/k{n}", f"v{n}") == (0, None)
    consumer = wire(broker.port, "rm", receive_max=2)  # reader_batch_size is 5
    consumer.send(mqtt5.SubscribePacket(1, [mqtt5.TopicFilter("$ECQ/rm/#", max_qos=mqtt5.QoS.AT_LEAST_ONCE,
                                                               retain_as_published=False)]).write())
    packets = [v5_packet(p) for p in consumer.available(3.0)]
    deliveries = [p for p in packets if isinstance(p, mqtt5.PublishPacket)]
    assert [p.topic for p in deliveries] == ["$ECQ/rm/k0", "$ECQ/rm/k1"], packets
    consumer.send(mqtt5.PubAckPacket(deliveries[0].packet_id).write())
    third = v5_packet(consumer.next())
    assert third.topic == "$ECQ/rm/k2"
    assert [v5_packet(p) for p in consumer.available(1.0)] == []


def test_receive_maximum_bounds_what_is_in_flight_over_every_queue_and_topic_of_the_connection(broker, v5):
    """Section 4.9: the client's Receive Maximum bounds the QoS 1/2 PUBLISHes in flight to it on the connection, not
    per queue: its own ECQ queue, an SCQ it reads and an ordinary topic share the one window."""
    producer = v5(broker.port, "rmx-producer")
    for n in range(3):
        assert producer.publish(f"$ECQ/w/rmx/k{n}", f"e{n}") == (0, None)
        assert producer.publish(f"$SCQ/w/rmx-config/k{n}", f"s{n}") == (0, None)
    consumer = wire(broker.port, "rmx", receive_max=2)
    consumer.send(mqtt5.SubscribePacket(1, [mqtt5.TopicFilter("rmx-plain/#", max_qos=mqtt5.QoS.AT_LEAST_ONCE)]).write())
    assert isinstance(v5_packet(consumer.next()), mqtt5.SubAckPacket)
    for n in range(3):
        producer.publish(f"rmx-plain/{n}", f"p{n}")
    consumer.send(mqtt5.SubscribePacket(2, [mqtt5.TopicFilter(f, max_qos=mqtt5.QoS.AT_LEAST_ONCE)
                                            for f in ("$ECQ/rmx/#", "$SCQ/rmx-config/#")]).write())
    packets = [v5_packet(p) for p in consumer.available(3.0)]
    deliveries = [p for p in packets if isinstance(p, mqtt5.PublishPacket)]
    assert len(deliveries) == 2, [p.topic for p in deliveries]
    consumer.send(b"".join(mqtt5.PubAckPacket(p.packet_id).write() for p in deliveries))
    seen = [p.topic for p in deliveries]
    while len(seen) < 9:
        arrived = [consumer.next(), *consumer.available(0.5)]
        batch = [p for p in map(v5_packet, arrived) if isinstance(p, mqtt5.PublishPacket)]
        assert 1 <= len(batch) <= 2, (seen, [p.topic for p in batch])
        consumer.send(b"".join(mqtt5.PubAckPacket(p.packet_id).write() for p in batch))
        seen += [p.topic for p in batch]
    assert sorted(seen) == sorted([f"$ECQ/rmx/k{n}" for n in range(3)] + [f"$SCQ/rmx-config/k{n}" for n in range(3)]
                                  + [f"rmx-plain/{n}" for n in range(3)])
    assert [t for t in seen if t.startswith("$ECQ/")] == [f"$ECQ/rmx/k{n}" for n in range(3)]  # each queue in order
    assert [t for t in seen if t.startswith("$SCQ/")] == [f"$SCQ/rmx-config/k{n}" for n in range(3)]


def test_an_empty_client_id_gets_an_assigned_one(broker, v5):
    client = v5(broker.port, "")
    assigned = client.connack[1].AssignedClientIdentifier
    assert assigned
    assert client.publish(f"$ECQ/w/{assigned}/k", "mine") == (0, None)
    assert client.subscribe(f"$ECQ/{assigned}/#") == [1]
    assert [(m.topic, m.payload) for m in client.expect(1)] == [(f"$ECQ/{assigned}/k", b"mine")]


@pytest.mark.parametrize("bad, code", [
    (b"\x30\x06\x00\x02\xff\xfe\x00v", 0x81),  # a topic of ill-formed UTF-8
    (b"\x30\x0c\x00\x01t\x07\x26\x00\x01\xff\x00\x01av", 0x81),  # a User Property of it (mqtt5 panics on it)
    (b"\x82\x08\x00\x01\x00\x00\x02\xff\xfe\x01", 0x81),  # a SUBSCRIBE filter of it (mqtt5 panics on it)
    (mqtt5.PublishPacket("plain/t", b"v", topic_alias=65).write(), 0x94),  # CONNACK said Topic Alias Maximum 64
    (b"\x30\x08\x00\x01t\x03\x23\x00\x00v", 0x94),  # Topic Alias 0 (section 3.3.2.3.4; mqtt5 refuses to decode it)
    (mqtt5.PublishPacket("", b"v", topic_alias=3).write(), 0x82),  # an alias no PUBLISH of this connection set
    (b"\xf0\x00", 0x82),  # AUTH, with no Authentication Method in CONNECT: a Protocol Error
    (b"\x82\x04\x00\x00\x00\x00", 0x81),  # SUBSCRIBE with packet id 0 and no filter
    (raw5.publish(b"$ECQ/w/bq/a\x00b"), 0x81),  # U+0000 in a topic: Malformed Packet [MQTT-1.5.4-2]
    (raw5.publish(b"plain/a\x00b"), 0x81),
    (raw5.subscribe("plain/a\x00b"), 0x81),
    (raw5.publish("plain/t", bytes([0x7F, 1])), 0x81),  # an unknown property identifier: malformed, section 2.2.2.2
])
def test_a_bad_v5_packet_gets_disconnect_and_the_connection_closes(broker, v5, bad, code):
    bystander = v5(broker.port, "bystander")
    client = wire(broker.port, "bad5")
    client.send(bad)
    packets = client.until_closed()
    assert [(p.kind, p.body[:1]) for p in packets] == [(DISCONNECT, bytes([code]))]
    assert bystander.publish("$ECQ/w/bq/k", "still served") == (0, None)


def test_pubrecs_and_pubacks_of_ecq_and_plain_publishes_keep_arrival_order(make_broker, v5):
    """MQTT-4.6.0-2/3: an ``$ECQ/`` write commits after a plain PUBLISH behind it is routed, yet each PUBACK and PUBREC
    leaves in arrival order. Two rounds of ``receive_maximum`` PUBLISHes: the second is refused (0x93) unless each
    PUBCOMP of the first ended its PUBLISH's count."""
    broker = make_broker(receive_maximum=100)
    watcher = v5(broker.port, "order5-watcher")
    assert watcher.subscribe("plain/#") == [1]
    client = wire(broker.port, "order5")
    kinds = [("$ECQ/w/o5/k", 2), ("plain/q2-", 2), ("$ECQ/w/o5/j", 1), ("plain/q1-", 1)]
    for first_id in (1, 101):
        sent = [(f"{topic}{n}", qos, n) for n in range(first_id, first_id + 100)
                for topic, qos in [kinds[(n - 1) % len(kinds)]]]
        client.send(b"".join(mqtt5.PublishPacket(topic, b"p", qos=mqtt5.QoS(qos), packet_id=n).write()
                             for topic, qos, n in sent))
        answers = [v5_packet(client.next()) for _ in sent]
        assert [(type(a).__name__, a.packet_id) for a in answers] == [
            ("PubRecPacket" if qos == 2 else "PubAckPacket", n) for _, qos, n in sent]
        released = [n for _, qos, n in sent if qos == 2]
        client.send(b"".join(mqtt5.PubRelPacket(n).write() for n in released))
        assert sorted(v5_packet(client.next()).packet_id for _ in released) == released
    assert len(watcher.expect(100)) == 100  # the plain ones of both rounds, each once


@pytest.mark.parametrize("properties, will_properties", [
    (prop(SESSION_EXPIRY_INTERVAL, 1) + prop(SESSION_EXPIRY_INTERVAL, 2), None),  # section 3.1.2.11.2
    (prop(RECEIVE_MAXIMUM, 5) + prop(RECEIVE_MAXIMUM, 6), None),  # section 3.1.2.11.3
    (prop(RECEIVE_MAXIMUM, 0), None),
    (prop(MAXIMUM_PACKET_SIZE, 0), None),  # section 3.1.2.11.4
    (prop(REQUEST_PROBLEM_INFORMATION, 2), None),  # section 3.1.2.11.7
    (prop(REQUEST_RESPONSE_INFORMATION, 2), None),  # section 3.1.2.11.6
    (prop(TOPIC_ALIAS, 1), None),  # a property CONNECT may not carry (Mosquitto: Protocol Error)
    (b"", prop(WILL_DELAY_INTERVAL, 1) + prop(WILL_DELAY_INTERVAL, 2)),  # section 3.1.3.2.2
], ids=["session-expiry-twice", "receive-maximum-twice", "receive-maximum-0", "maximum-packet-size-0",
        "problem-information-2", "response-information-2", "topic-alias", "will-delay-twice"])
def test_a_connect_with_a_protocol_error_gets_connack_0x82_and_is_closed(broker, v5, properties, will_properties):
    """MQTT 5.0 section 4.13: a Protocol Error in CONNECT is answered CONNACK 0x82, not 0x81 Malformed Packet."""
    client = WireClient(broker.port)
    client.send(raw5.connect("protocol-error", properties, will_properties))
    connack = v5_packet(client.next())
    assert isinstance(connack, mqtt5.ConnAckPacket) and connack.reason_code == 0x82
    assert client.until_closed() == []
    assert v5(broker.port, "after-protocol-error").publish("$ECQ/w/pe/k", "still served") == (0, None)


@pytest.mark.parametrize("bad", [
    raw5.subscribe("a/b", prop(SUBSCRIPTION_IDENTIFIER, 0)),  # section 3.8.2.1.2
    raw5.subscribe("a/b", prop(SUBSCRIPTION_IDENTIFIER, 1) + prop(SUBSCRIPTION_IDENTIFIER, 2)),
    raw5.subscribe("a/b", options=0x31),  # Retain Handling 3, section 3.8.3.1
    raw5.publish("", qos=1),  # an empty topic and no Topic Alias, section 3.3.2.3.4
    raw5.publish("$ECQ/w/pe/k", prop(SUBSCRIPTION_IDENTIFIER, 1)),  # from a client [MQTT-3.3.4-6]
    raw5.publish("plain/t", prop(TOPIC_ALIAS, 1) + prop(TOPIC_ALIAS, 1)),
    b"\xe0\x0c\x00\x0a" + prop(SESSION_EXPIRY_INTERVAL, 1) * 2,  # DISCONNECT, section 3.14.2.2.2
], ids=["subscription-identifier-0", "subscription-identifier-twice", "retain-handling-3", "empty-topic",
        "subscription-identifier-in-publish", "topic-alias-twice", "disconnect-session-expiry-twice"])
def test_a_protocol_error_after_connect_gets_disconnect_0x82(broker, v5, bad):
    """MQTT 5.0 section 4.13: DISCONNECT 0x82 Protocol Error, not 0x81 Malformed Packet, then the close."""
    bystander = v5(broker.port, "bystander")
    client = wire(broker.port, "protocol-error")
    client.send(bad)
    assert [(p.kind, p.body[:1]) for p in client.until_closed()] == [(DISCONNECT, b"\x82")]
    assert stored(broker, "pe") == 0
    assert bystander.publish("$ECQ/w/bq/k", "still served") == (0, None)


def test_disconnect_with_will_keeps_the_will_and_a_normal_disconnect_drops_it(broker, connect):
    watcher = connect(broker.port, "watcher")
    assert watcher.subscribe("wills/#") == 1
    for client_id, reason in (("normal", 0x00), ("with-will", 0x04)):
        client = wire(broker.port, client_id, will=mqtt5.Will(f"wills/{client_id}", payload=b"gone"))
        client.send(mqtt5.DisconnectPacket(reason_code=mqtt5.DisconnectReasonCode(reason)).write())
        client.until_closed()
    assert topics_payloads(watcher.expect(1)) == [("wills/with-will", b"gone")]
    assert watcher.quiet(1.0) == []


def test_mqtt5_over_websocket(broker_process):
    port = free_port()
    broker = broker_process(listeners={"ws": {"type": "ws", "bind": f"127.0.0.1:{port}"}}).start()
    producer = wire(port, "ws5-producer", transport="ws")
    producer.send(mqtt5.PublishPacket("$ECQ/w/ws5/k", b"v", qos=mqtt5.QoS.AT_LEAST_ONCE, packet_id=1).write(),
                  mqtt5.PublishPacket("$ECQ/w/ctl/k", b"v", qos=mqtt5.QoS.AT_LEAST_ONCE, packet_id=2).write())
    assert [v5_packet(producer.next()).reason_code for _ in range(2)] == [0, 0x90]
    consumer = wire(port, "ws5", transport="ws")
    consumer.send(mqtt5.SubscribePacket(1, [mqtt5.TopicFilter("$ECQ/ws5/#", max_qos=mqtt5.QoS.AT_LEAST_ONCE,
                                                               retain_as_published=False)]).write())
    assert v5_packet(consumer.next()).reason_codes == [1]
    delivery = v5_packet(consumer.next())
    assert (delivery.topic, delivery.payload, dict(delivery.user_properties)["ecq-seqno"]) == ("$ECQ/ws5/k", b"v", "1")
    assert stored(broker, "ws5") == 1


def test_mosquitto_clients_over_mqtt5(broker):
    subscriber = subprocess.Popen(
        ["stdbuf", "-oL", "mosquitto_sub", "-V", "mqttv5", "-h", "127.0.0.1", "-p", str(broker.port), "-i", "mq5",
         "-q", "1", "-t", "$ECQ/mq5/#", "-C", "2", "-F", "%t %p %P"], stdout=subprocess.PIPE, text=True)
    try:
        for n in range(2):
            subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-h", "127.0.0.1", "-p", str(broker.port), "-q", "1",
                            "-t", f"$ECQ/w/mq5/k{n}", "-m", f"v{n}"], check=True, timeout=WAIT_S)
        out, _ = subscriber.communicate(timeout=WAIT_S)
    finally:
        subscriber.kill()
    assert out.splitlines() == ["$ECQ/mq5/k0 v0 ecq-seqno:1 ecq-ts:" + out.splitlines()[0].rsplit(":", 1)[1],
                                "$ECQ/mq5/k1 v1 ecq-seqno:2 ecq-ts:" + out.splitlines()[1].rsplit(":", 1)[1]]


def test_a_v5_connect_cut_short_is_closed_after_connect_timeout(make_broker):
    broker = make_broker(connect_timeout="1s")
    half = WireClient(broker.port)
    half.send(mqtt5.ConnectPacket("half5", clean_start=True).write()[:14])  # past the protocol level, not whole
    started = time.monotonic()
    assert half.until_closed() == []
    assert 0.8 < time.monotonic() - started < 5
    assert "no CONNECT from 127.0.0.1" in broker.log()


@pytest.mark.parametrize("connect, code", [
    (mqtt5.ConnectPacket("will5", clean_start=True, will=mqtt5.Will("$ECQ/victim/k", payload=b"x")), 0x87),
    (mqtt5.ConnectPacket("auth5", clean_start=True, authentication_method="SCRAM-SHA-1"), 0x8C),
    (b"\x10\x03\x00\x04MQTT\x05", 0x81),  # a remaining length shorter than what it announces
    (raw5.connect("will5", will_properties=b"", will_topic=b"wills/a\x00b"), 0x81),  # U+0000 [MQTT-1.5.4-2]
    (raw5.connect("nul\x00id"), 0x81),
], ids=["will-on-ecq", "enhanced-auth", "short-remaining-length", "nul-in-will-topic", "nul-in-client-id"])
def test_a_refused_v5_connect_gets_a_v5_connack(broker, connect, code):
    client = WireClient(broker.port)
    client.send(connect if isinstance(connect, bytes) else connect.write())
    connack = v5_packet(client.next())
    assert isinstance(connack, mqtt5.ConnAckPacket) and connack.reason_code == code
    assert client.until_closed() == []
