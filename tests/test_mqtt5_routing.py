"""MQTT 5.0 on ordinary topics (issue 25, point 3), against real ``ecq broker`` processes over TCP: PUBLISH properties
passed through, Message Expiry, subscription options (No Local, Retain As Published, Retain Handling), Subscription
Identifiers, Topic Aliases both ways, the client's Maximum Packet Size and Receive Maximum, the server's Receive
Maximum, UNSUBACK reason codes. Section numbers are MQTT 5.0's.

Where a test shows that something is NOT delivered, it publishes a marker after it and checks that the marker comes
first: no sleep decides the outcome."""

from __future__ import annotations

import time

import mqtt5

from tests.harness import topics_payloads
from tests.mqtt_wire import DISCONNECT, PUBREC
from tests.test_mqtt5 import V5Client, v5, v5_packet, wire  # noqa: F401  (v5 is a fixture)

REQUEST_PROPERTIES = {"UserProperty": [("a", "1"), ("a", "2"), ("b", "3")], "ContentType": "text/plain",
                      "PayloadFormatIndicator": 1, "ResponseTopic": "replies/r1", "CorrelationData": b"\x00id-7"}


def properties_of(message) -> dict:
    return {name: getattr(message.properties, name) for name in REQUEST_PROPERTIES
            if hasattr(message.properties, name)}


def next_topics(client: V5Client, count: int) -> list[tuple[str, bytes]]:
    return [(m.topic, m.payload) for m in client.expect(count)]


def test_publish_properties_reach_v5_subscribers_unaltered_and_3_1_1_ones_get_the_payload(broker, v5, connect):
    """Section 3.3.2.3: User Properties (order and repeats kept), Payload Format Indicator, Content Type, Response
    Topic, Correlation Data and the Message Expiry Interval left are forwarded; a 3.1.1 subscriber gets the same
    payload. They cross amqtt inside the payload object (``mqtt5_messages.Mqtt5Payload``): this fails if amqtt copies
    payloads another way (the seam's guard, issue 32)."""
    new, old = v5(broker.port, "props-v5"), connect(broker.port, "props-311")
    assert new.subscribe("req/#") == [1]
    assert old.subscribe("req/#") == 1
    producer = v5(broker.port, "props-producer")
    assert producer.publish("req/1", b"question", MessageExpiryInterval=60, **REQUEST_PROPERTIES) == (0, None)
    message = new.expect(1)[0]
    assert (message.topic, message.payload) == ("req/1", b"question")
    assert properties_of(message) == REQUEST_PROPERTIES
    assert 55 <= message.properties.MessageExpiryInterval <= 60
    assert topics_payloads(old.expect(1)) == [("req/1", b"question")]


def test_a_retained_message_keeps_its_properties(broker, v5):
    producer = v5(broker.port, "ret-props-producer")
    producer.publish("retprops/t", b"kept", retain=True, UserProperty=[("k", "v")], ContentType="x")
    late = v5(broker.port, "ret-props-late")
    assert late.subscribe("retprops/#") == [1]
    message = late.expect(1)[0]
    assert message.retain and properties_of(message) == {"UserProperty": [("k", "v")], "ContentType": "x"}


def test_an_expired_message_is_not_delivered_and_a_live_one_carries_what_is_left(broker, v5):
    """Section 3.3.2.3.3: a message is not delivered once its Message Expiry Interval has passed; the interval sent
    is the one received minus the time the message waited."""
    producer = v5(broker.port, "exp-producer")
    producer.publish("exp/short", b"gone", retain=True, MessageExpiryInterval=1)
    producer.publish("exp/long", b"live", retain=True, MessageExpiryInterval=60)
    time.sleep(1.6)  # let the first message's interval pass: what is tested is that it passed
    late = v5(broker.port, "exp-late")
    assert late.subscribe("exp/#") == [1]
    producer.publish("exp/marker", b"after")
    messages = late.expect(2)
    assert [(m.topic, m.payload) for m in messages] == [("exp/long", b"live"), ("exp/marker", b"after")]
    assert 57 <= messages[0].properties.MessageExpiryInterval <= 59


def test_an_expired_message_is_not_delivered_from_an_offline_queue(broker, v5):
    consumer = V5Client(broker.port, "exp-offline", clean_start=False, SessionExpiryInterval=600)
    assert consumer.subscribe("expq/#") == [1]
    consumer.close()
    producer = v5(broker.port, "expq-producer")
    producer.publish("expq/a", b"expires", MessageExpiryInterval=1)
    producer.publish("expq/b", b"stays", MessageExpiryInterval=120)
    time.sleep(1.6)  # let the first message's interval pass while the consumer is away
    back = V5Client(broker.port, "exp-offline", clean_start=False, SessionExpiryInterval=600)
    try:
        message = back.expect(1)[0]
        assert (message.topic, message.payload) == ("expq/b", b"stays")
        assert message.properties.MessageExpiryInterval <= 119
    finally:
        back.close()


def test_no_local_keeps_a_clients_own_messages_from_it(broker, v5):
    """Section 3.8.3.1: with No Local, a client does not get the messages it published itself."""
    a, b = v5(broker.port, "nl-a"), v5(broker.port, "nl-b")
    assert a.subscribe("nl/#", noLocal=True) == [1]
    assert b.subscribe("nl/#", noLocal=True) == [1]
    a.publish("nl/t", b"from a")
    assert next_topics(b, 1) == [("nl/t", b"from a")]
    b.publish("nl/t", b"from b")
    assert next_topics(a, 1) == [("nl/t", b"from b")]  # its own came first, had it been sent


def test_retain_as_published_keeps_the_retain_flag(broker, v5):
    """Section 3.8.3.1: Retain As Published 1 sends a message with the RETAIN flag it was published with; 0 clears
    it on messages that are not sent for a new subscription."""
    rap, plain = v5(broker.port, "rap-1"), v5(broker.port, "rap-0")
    assert rap.subscribe("rap/#", retainAsPublished=True) == [1]
    assert plain.subscribe("rap/#") == [1]
    producer = v5(broker.port, "rap-producer")
    producer.publish("rap/t", b"not retained")
    producer.publish("rap/t", b"retained", retain=True)
    assert [m.retain for m in rap.expect(2)] == [False, True]
    assert [m.retain for m in plain.expect(2)] == [False, False]
    producer.publish("rap/t", b"", retain=True)  # clear it


def test_retain_handling_decides_when_retained_messages_are_sent(broker, v5):
    """Section 3.8.3.1: Retain Handling 0 sends the retained messages at every SUBSCRIBE, 1 only when the
    subscription is new, 2 never."""
    producer = v5(broker.port, "rh-producer")
    producer.publish("rh/t", b"retained", retain=True)
    client = v5(broker.port, "rh-client")

    def retained_sent(handling: int) -> bool:
        assert client.subscribe("rh/#", retainHandling=handling) == [1]
        producer.publish("rh/marker", b"m")
        first = client.expect(1)[0]
        if first.topic == "rh/marker":
            return False
        assert next_topics(client, 1) == [("rh/marker", b"m")]
        return True

    assert [retained_sent(h) for h in (0, 0, 1, 2)] == [True, True, False, False]
    fresh = v5(broker.port, "rh-fresh")
    assert fresh.subscribe("rh/#", retainHandling=1) == [1]
    assert next_topics(fresh, 1) == [("rh/t", b"retained")]
    other = v5(broker.port, "rh-never")
    assert other.subscribe("rh/#", retainHandling=2) == [1]
    producer.publish("rh/marker", b"m2")
    assert next_topics(other, 1) == [("rh/marker", b"m2")]
    producer.publish("rh/t", b"", retain=True)


def test_a_delivery_carries_the_identifiers_of_every_matching_subscription(broker, v5):
    """Section 3.3.4: the PUBLISH carries the Subscription Identifiers of all the client's subscriptions it matches
    (one delivery, section 3.3.4 for overlapping subscriptions)."""
    client = v5(broker.port, "sid")
    assert client.subscribe("sid/#", subscription_id=7) == [1]
    assert client.subscribe("sid/+", subscription_id=9) == [1]
    assert client.subscribe("sid/x/none") == [1]
    producer = v5(broker.port, "sid-producer")
    producer.publish("sid/x", b"both")
    producer.publish("sid/x/y", b"one")
    producer.publish("sid/x/none", b"none")
    got = client.expect(3)
    assert [(m.payload, getattr(m.properties, "SubscriptionIdentifier", None)) for m in got] == [
        (b"both", [7, 9]), (b"one", [7]), (b"none", [7])]
    assert client.subscribe("sid/#") == [1]  # re-subscribed without an identifier: it no longer has one
    producer.publish("sid/x/none", b"again")
    assert getattr(client.expect(1)[0].properties, "SubscriptionIdentifier", None) is None


def test_topic_aliases_from_the_client_stand_for_their_topic(broker, v5):
    """Section 3.3.2.3.4: a PUBLISH with a Topic Name and an alias sets it; an empty Topic Name with the alias is that
    topic; a new name for the alias replaces it; aliases end with the connection."""
    consumer = v5(broker.port, "alias-consumer")
    assert consumer.subscribe("alias/#") == [1]
    raw = wire(broker.port, "alias-producer")
    raw.send(mqtt5.PublishPacket("alias/one", b"1", topic_alias=1).write(),
             mqtt5.PublishPacket("", b"2", topic_alias=1).write(),
             mqtt5.PublishPacket("alias/two", b"3", topic_alias=1).write(),
             mqtt5.PublishPacket("", b"4", qos=mqtt5.QoS.AT_LEAST_ONCE, packet_id=5, topic_alias=1).write())
    assert isinstance(v5_packet(raw.next()), mqtt5.PubAckPacket)
    assert next_topics(consumer, 4) == [("alias/one", b"1"), ("alias/one", b"2"), ("alias/two", b"3"),
                                        ("alias/two", b"4")]
    raw.close()
    again = wire(broker.port, "alias-producer")
    again.send(mqtt5.PublishPacket("", b"5", topic_alias=1).write())
    assert [(p.kind, p.body[:1]) for p in again.until_closed()] == [(DISCONNECT, b"\x82")]


def test_the_server_sends_topic_aliases_within_the_clients_maximum(broker, v5):
    """Section 3.3.2.3.4: the server may use up to the client's Topic Alias Maximum aliases; a topic is sent in full
    once with its alias, then as an empty Topic Name with the alias."""
    raw = wire(broker.port, "alias-sub", topic_alias_max=2)
    raw.send(mqtt5.SubscribePacket(1, [mqtt5.TopicFilter("salias/#")]).write())
    assert isinstance(v5_packet(raw.next()), mqtt5.SubAckPacket)
    producer = v5(broker.port, "salias-producer")
    for topic in ("salias/a", "salias/b", "salias/a", "salias/c", "salias/b"):
        producer.publish(topic, topic.encode(), qos=0)
    got = [v5_packet(raw.next()) for _ in range(5)]
    assert [(p.topic, p.topic_alias, p.payload) for p in got] == [
        ("salias/a", 1, b"salias/a"), ("salias/b", 2, b"salias/b"), ("", 1, b"salias/a"),
        ("salias/c", None, b"salias/c"), ("", 2, b"salias/b")]


def test_a_message_above_the_clients_maximum_packet_size_is_not_sent(broker, v5):
    """Section 3.1.2.11.4: the server does not send a packet above the client's Maximum Packet Size; it discards it."""
    client = v5(broker.port, "mps", MaximumPacketSize=100)
    assert client.subscribe("mps/#") == [1]
    producer = v5(broker.port, "mps-producer")
    producer.publish("mps/t", b"s" * 50)
    producer.publish("mps/t", b"L" * 200)
    producer.publish("mps/t", b"after")
    assert next_topics(client, 2) == [("mps/t", b"s" * 50), ("mps/t", b"after")]


def test_the_clients_receive_maximum_bounds_qos1_messages_in_flight(broker, v5):
    """Section 4.9: the server sends no more than the client's Receive Maximum QoS 1/2 PUBLISHes unacknowledged."""
    raw = wire(broker.port, "rmax", receive_max=2)
    raw.send(mqtt5.SubscribePacket(1, [mqtt5.TopicFilter("rmax/#", max_qos=mqtt5.QoS.AT_LEAST_ONCE)]).write())
    assert isinstance(v5_packet(raw.next()), mqtt5.SubAckPacket)
    producer = v5(broker.port, "rmax-producer")
    for n in range(3):
        producer.publish(f"rmax/{n}", b"m")
    first, second = v5_packet(raw.next()), v5_packet(raw.next())
    assert [first.topic, second.topic] == ["rmax/0", "rmax/1"]
    assert raw.available(timeout=1.0) == []  # a third would be over the window: nothing may come
    raw.send(mqtt5.PubAckPacket(first.packet_id).write())
    assert v5_packet(raw.next()).topic == "rmax/2"


def test_receive_maximum_and_topic_alias_maximum_are_options_told_in_connack_and_held_to(make_broker, v5):
    """Sections 3.2.2.3.3 and 3.2.2.3.8: the broker's ``receive_maximum`` and ``topic_alias_maximum`` are what CONNACK
    says and what a client is held to (0x93 for one more unacknowledged QoS 2 PUBLISH, 0x94 for an alias above)."""
    broker = make_broker(receive_maximum=3, topic_alias_maximum=0)
    connack = v5(broker.port, "limits-probe").connack[1]
    assert connack.ReceiveMaximum == 3 and getattr(connack, "TopicAliasMaximum", 0) == 0
    flood = wire(broker.port, "limits-flood")
    qos2 = [mqtt5.PublishPacket("limits/t", b"v", qos=mqtt5.QoS.EXACTLY_ONCE, packet_id=n).write() for n in (1, 2, 3, 4)]
    flood.send(*qos2[:3])
    assert [flood.next().kind for _ in range(3)] == [PUBREC] * 3  # within the limit; no PUBREL: all 3 stay in flight
    flood.send(qos2[3])
    assert [(p.kind, p.body[:1]) for p in flood.until_closed()] == [(DISCONNECT, b"\x93")]
    aliased = wire(broker.port, "limits-alias")
    aliased.send(mqtt5.PublishPacket("limits/a", b"v", topic_alias=1).write())
    assert [(p.kind, p.body[:1]) for p in aliased.until_closed()] == [(DISCONNECT, b"\x94")]


def test_more_qos2_publishes_in_flight_than_the_servers_receive_maximum_get_disconnect_0x93(broker, v5):
    """Section 3.3.4: a client that sends more QoS 1/2 PUBLISHes unacknowledged than the server's Receive Maximum
    (CONNACK) is disconnected with 0x93; it reads the DISCONNECT even while it is still sending."""
    client = wire(broker.port, "flood")
    limit = v5(broker.port, "flood-probe").connack[1].ReceiveMaximum
    assert limit == 1024
    client.send(*[mqtt5.PublishPacket("flood/t", b"v", qos=mqtt5.QoS.EXACTLY_ONCE, packet_id=n).write()
                  for n in range(1, limit + 2)])
    packets = client.until_closed(timeout=30)
    assert packets and packets[-1].kind == DISCONNECT and packets[-1].body[:1] == b"\x93"
    assert {p.kind for p in packets[:-1]} <= {PUBREC}  # PUBRECs of the ones within the limit, if they left first


def test_unsuback_says_which_filters_had_no_subscription(broker):
    """Section 3.11.3: UNSUBACK 0x00 for a filter the session had, 0x11 No subscription existed for another."""
    raw = wire(broker.port, "unsub")
    raw.send(mqtt5.SubscribePacket(1, [mqtt5.TopicFilter("un/a")]).write())
    assert isinstance(v5_packet(raw.next()), mqtt5.SubAckPacket)
    raw.send(mqtt5.UnsubscribePacket(2, ["un/a", "un/b"]).write())
    assert v5_packet(raw.next()).reason_codes == [0x00, 0x11]


def test_a_client_still_sending_after_a_server_disconnect_reads_it_rather_than_a_reset(broker, v5):
    """Section 4.13: the client is to learn why it is disconnected. A socket closed with unread bytes sends a reset,
    which fails the client's next write and discards the DISCONNECT unread (Paho's test_flow_control2 died of
    it): ECQ shuts its side and discards what still comes before it closes."""
    limit = v5(broker.port, "flood2-probe").connack[1].ReceiveMaximum
    client = wire(broker.port, "flood2")
    client.send(*[mqtt5.PublishPacket("flood2/t", b"v", qos=mqtt5.QoS.EXACTLY_ONCE, packet_id=n).write()
                  for n in range(1, limit + 2)])
    for _ in range(15):  # what a client does meanwhile: its PUBRELs, PINGREQs... every 20 ms for 0.3 s
        client.send(mqtt5.PingReqPacket().write())
        time.sleep(0.02)
    packets = client.until_closed(timeout=30)
    assert packets and packets[-1].kind == DISCONNECT and packets[-1].body[:1] == b"\x93"


def test_a_shared_subscription_keeps_its_identifier_and_no_local_on_it_is_a_protocol_error(broker, v5):
    """Section 3.8.2.1.2: a delivery through a shared subscription carries its Subscription Identifier; section
    3.8.3.1: No Local on a shared subscription is a Protocol Error (DISCONNECT 0x82)."""
    member = v5(broker.port, "share-id")
    assert member.subscribe("$share/g/shid/#", subscription_id=42) == [1]
    v5(broker.port, "share-id-producer").publish("shid/t", b"m")
    assert getattr(member.expect(1)[0].properties, "SubscriptionIdentifier", None) == [42]
    raw = wire(broker.port, "share-nl")
    raw.send(mqtt5.SubscribePacket(1, [mqtt5.TopicFilter("$share/g/shnl/#", no_local=True)]).write())
    assert [(p.kind, p.body[:1]) for p in raw.until_closed()] == [(DISCONNECT, b"\x82")]
