"""MQTT 5.0 messages of ordinary topics across two ECQ nodes on the session's NATS cluster, over TCP with paho MQTTv5
clients: the properties (MQTT 5.0 section 3.3.2.3), RETAIN flag (for Retain As Published, 3.8.3.1) and Message Expiry
(3.3.2.3.3) of a message stay with it when it is forwarded to the other node, retained in the cluster's KV, or queued
for an offline session that resumes on the other node, also after the node that held the session died; a session
that expired (3.1.2.11.2) is not resumed anywhere; a takeover from the other node is told 0x8E (3.14.2.1); a session
resumed on the other node (taken over, or after its node died) keeps No Local, Retain As Published and its
Subscription Identifiers (3.8.3.1, 3.8.2.1.2).

Where a test shows that something is NOT delivered, a marker published after it must come first: no sleep decides
the outcome."""

from __future__ import annotations

import asyncio
import json
import queue
import time

import mqtt5
import pytest

from ecq.store.jsapi import token
from tests.harness import wait_until
from tests.test_cluster_state import PROPAGATION_BOUND_S, kv_value, started, stored_count
from tests.test_mqtt5 import V5Client, v5, v5_packet  # noqa: F401  (v5 is a fixture)
from tests.test_mqtt5_routing import REQUEST_PROPERTIES, properties_of
from tests.test_mqtt5_sessions import QOS_1, connect5, disconnect, server_disconnect

SESSION = {"SessionExpiryInterval": 600}


def test_a_message_forwarded_to_the_other_node_keeps_its_properties_retain_flag_and_expiry(cluster_nodes, v5):
    node1, node2 = started(cluster_nodes())
    subscriber = v5(node2.port, "fwd-sub")
    assert subscriber.subscribe("fwd/#", retainAsPublished=True) == [1]
    producer = v5(node1.port, "fwd-producer")
    assert producer.publish("fwd/1", b"question", **REQUEST_PROPERTIES, MessageExpiryInterval=60) == (0, None)
    assert producer.publish("fwd/2", b"kept", retain=True) == (0, None)
    first, second = subscriber.expect(2)
    assert (first.topic, first.payload, first.retain) == ("fwd/1", b"question", False)
    assert properties_of(first) == REQUEST_PROPERTIES
    assert 58 <= first.properties.MessageExpiryInterval <= 60
    assert (second.topic, second.payload, second.retain) == ("fwd/2", b"kept", True)


def test_a_retained_message_keeps_its_properties_on_the_other_node_until_it_expires(cluster_nodes, v5):
    node1, node2 = started(cluster_nodes())
    producer = v5(node1.port, "kv-producer")
    producer.publish("kv/short", b"gone", retain=True, MessageExpiryInterval=1)
    published = time.monotonic()
    producer.publish("kv/long", b"kept", retain=True, UserProperty=[("k", "v")], ContentType="x",
                     MessageExpiryInterval=60)
    probes = iter(range(1000))

    def retained_on_node2() -> bool:  # node 2 applies the KV's changes in order: kv/short is there before kv/long
        probe = V5Client(node2.port, f"kv-probe-{next(probes)}")
        try:
            probe.subscribe("kv/long")
            return probe.messages.get(timeout=0.5) is not None
        except queue.Empty:
            return False
        finally:
            probe.close()
    assert wait_until(retained_on_node2, PROPAGATION_BOUND_S, 0.1)
    time.sleep(max(0.0, published + 1.6 - time.monotonic()))  # let kv/short's interval pass: that is what is tested
    late = v5(node2.port, "kv-late")
    assert late.subscribe("kv/#") == [1]
    producer.publish("kv/marker", b"after")
    kept, marker = late.expect(2)
    assert (kept.topic, kept.payload, kept.retain) == ("kv/long", b"kept", True)
    assert properties_of(kept) == {"UserProperty": [("k", "v")], "ContentType": "x"}
    assert 50 <= kept.properties.MessageExpiryInterval <= 59
    assert (marker.topic, marker.payload) == ("kv/marker", b"after")


def queue_for_offline_session(v5, node1, node2, clientid: str) -> None:
    """``clientid`` subscribes ``<clientid>/#`` in a v5 session of 600 s on node 1 and leaves; then node 1 takes a
    message that expires in 1 s and one with the request properties, node 2 one without properties, each once a
    witness on node 1 saw the one before (so they reach the offline session in this order)."""
    client = V5Client(node1.port, clientid, clean_start=False, **SESSION)
    assert client.subscribe(f"{clientid}/#") == [1]
    client.close()
    witness = v5(node1.port, f"{clientid}-witness")
    witness.subscribe(f"{clientid}/#")
    for node, topic, properties in ((node1, "expires", {"MessageExpiryInterval": 1}),
                                    (node1, "asks", {**REQUEST_PROPERTIES, "MessageExpiryInterval": 120}),
                                    (node2, "plain", {})):
        v5(node.port, f"{clientid}-{topic}").publish(f"{clientid}/{topic}", topic.encode(), **properties)
        assert witness.expect(1)[0].topic == f"{clientid}/{topic}"


def resumed_on(node, clientid: str) -> list:
    """The two messages the session of ``clientid`` gets when it resumes on ``node`` 1.6 s after it was queued
    (the first message's expiry has passed), checked for what the session kept."""
    time.sleep(1.6)  # let the first message's interval pass while the session is offline
    back = V5Client(node.port, clientid, clean_start=False, **SESSION)
    try:
        asks, plain = back.expect(2)
    finally:
        back.close()
    assert (asks.topic, asks.payload) == (f"{clientid}/asks", b"asks")
    assert properties_of(asks) == REQUEST_PROPERTIES
    assert 116 <= asks.properties.MessageExpiryInterval <= 119
    assert (plain.topic, plain.payload, properties_of(plain)) == (f"{clientid}/plain", b"plain", {})
    return [asks, plain]


def test_an_offline_session_handed_over_keeps_its_messages_properties_and_expiry(cluster_nodes, v5):
    node1, node2 = started(cluster_nodes())
    queue_for_offline_session(v5, node1, node2, "handed")
    resumed_on(node2, "handed")


def test_an_offline_session_of_a_dead_node_keeps_its_messages_properties_and_expiry(cluster_nodes, v5,
                                                                                     jetstream_options, nats_cluster):
    node1, node2 = started(cluster_nodes())
    stream = f"{jetstream_options['jetstream_namespace']}_SESSIONS"
    queue_for_offline_session(v5, node1, node2, "orphan5")
    assert wait_until(lambda: asyncio.run(stored_count(nats_cluster.urls, stream)) == 3, PROPAGATION_BOUND_S, 0.1)
    node1.kill()
    resumed_on(node2, "orphan5")


def test_a_takeover_from_the_other_node_tells_the_old_v5_connection_0x8e(cluster_nodes, v5):
    node1, node2 = started(cluster_nodes())
    old, _connack = connect5(node1.port, "moving", session_expiry_interval=60)
    v5(node2.port, "moving", clean_start=False, **SESSION)
    assert server_disconnect(old) == [0x8E]  # MQTT 5.0 section 3.14.2.1: Session taken over


def subscribe_with_options(client) -> None:
    """On the raw v5 connection ``client``: ``opt/local/#`` with No Local, ``opt/rap/#`` with Retain As Published,
    ``opt/id/#`` with Subscription Identifier 7 (MQTT 5.0 sections 3.8.3.1, 3.8.2.1.2)."""
    client.send(mqtt5.SubscribePacket(1, [mqtt5.TopicFilter("opt/local/#", max_qos=QOS_1, no_local=True,
                                                            retain_as_published=False),
                                          mqtt5.TopicFilter("opt/rap/#", max_qos=QOS_1,
                                                            retain_as_published=True)]).write())
    assert v5_packet(client.next()).reason_codes == [1, 1]
    client.send(mqtt5.SubscribePacket(2, [mqtt5.TopicFilter("opt/id/#", max_qos=QOS_1, retain_as_published=False)],
                                      subscription_id=7).write())
    assert v5_packet(client.next()).reason_codes == [1]


def options_kept(v5, resumed_on: int, producer_on: int) -> None:
    """The session of ``opts`` resumed on port ``resumed_on`` by paho without subscribing: its own PUBLISH to a No
    Local filter does not come back, a retained PUBLISH (through ``producer_on``) keeps RETAIN=1 on the Retain As
    Published filter, and the identified filter's message carries its identifier."""
    moved = v5(resumed_on, "opts", clean_start=False, **SESSION)
    assert moved.session_present
    assert moved.publish("opt/local/self", b"not back to its publisher") == (0, None)
    producer = v5(producer_on, "opts-producer")
    for topic, retain in (("opt/local/other", False), ("opt/rap/r", True), ("opt/id/x", False)):
        assert producer.publish(topic, topic.encode(), retain=retain) == (0, None)
    local, rap, identified = moved.expect(3)
    assert (local.topic, rap.topic, rap.retain, identified.topic) == ("opt/local/other", "opt/rap/r", True, "opt/id/x")
    assert identified.properties.SubscriptionIdentifier == [7]
    assert not hasattr(local.properties, "SubscriptionIdentifier")


def test_a_v5_session_taken_over_from_the_other_node_keeps_its_subscription_options(cluster_nodes, v5):
    node1, node2 = started(cluster_nodes())
    old, _connack = connect5(node1.port, "opts", session_expiry_interval=600)
    subscribe_with_options(old)
    options_kept(v5, node2.port, node1.port)
    assert server_disconnect(old) == [0x8E]


def test_a_v5_session_of_a_dead_node_keeps_its_subscription_options(cluster_nodes, v5, jetstream_options,
                                                                     nats_cluster):
    node1, node2 = started(cluster_nodes())
    old, _connack = connect5(node1.port, "opts", session_expiry_interval=600)
    subscribe_with_options(old)
    disconnect(old)
    bucket = f"{jetstream_options['jetstream_namespace']}_sessions"
    stored = lambda: asyncio.run(kv_value(nats_cluster.urls, bucket, token("opts")))  # noqa: E731
    assert wait_until(lambda: stored() is not None, PROPAGATION_BOUND_S, 0.1)
    assert {f: len(entry) for f, *entry in json.loads(stored())["subscriptions"]} == {
        "opt/local/#": 2, "opt/rap/#": 2, "opt/id/#": 2}  # each with its options
    node1.kill()
    options_kept(v5, node2.port, node2.port)


def test_a_session_that_expired_on_its_node_is_not_resumed_on_the_other_after_that_node_died(cluster_nodes,
                                                                                              jetstream_options,
                                                                                              nats_cluster):
    """MQTT 5.0 section 3.1.2.11.2: the session ends when its interval (2 s) has passed; the cluster's copy of it,
    kept for ``session_expiry``, ends with it."""
    node1, node2 = started(cluster_nodes())
    bucket = f"{jetstream_options['jetstream_namespace']}_sessions"
    client = V5Client(node1.port, "brief", clean_start=False, SessionExpiryInterval=2)
    assert client.subscribe("brief/#") == [1]
    client.close()
    assert wait_until(lambda: asyncio.run(kv_value(nats_cluster.urls, bucket, token("brief"))) is not None,
                      PROPAGATION_BOUND_S, 0.1)
    assert wait_until(lambda: asyncio.run(kv_value(nats_cluster.urls, bucket, token("brief"))) is None,
                      2 + PROPAGATION_BOUND_S, 0.1), "the cluster kept the expired session"
    node1.kill()
    _back, connack = connect5(node2.port, "brief", clean_start=False, session_expiry_interval=2)
    assert not connack.session_present


def test_the_cluster_form_round_trips_reads_what_earlier_versions_stored_and_refuses_garbage():
    from ecq.broker.amqtt_hooks.mqtt5_messages import cluster_form, from_cluster_form, make_payload
    from ecq.broker.cluster_state import SessionState, retained_message, retained_value

    properties = {"user_properties": [("a", "1"), ("a", "2")], "content_type": "text/plain",
                  "correlation_data": b"\x00id"}
    message = make_payload(b"data", properties, time.monotonic() + 30, "publisher", True)
    carried, qos = retained_message(retained_value(message, 1))
    assert (bytes(carried), qos, carried.properties, carried.retain, carried.publisher) == (
        b"data", 1, properties, True, None)
    assert 29 <= carried.expires_at - time.monotonic() <= 30.001  # the deadline travels in whole ms, rounded
    assert retained_message(b"\x03plain") == (b"plain", None)  # a value stored before MQTT 5 messages were carried
    assert cluster_form(b"a 3.1.1 payload") is None
    old_session = b'{"present": true, "subscriptions": [], "messages": [["t", 1, "eA=="]]}'
    assert SessionState.from_bytes(old_session).messages == [("t", 1, b"x")]
    moved = SessionState.from_bytes(SessionState(True, [], [("t", 2, message)]).to_bytes()).messages[0][2]
    assert moved.properties == properties
    for garbage in ("", "no-colon", ":not base64!", "12:AAAA", "soon:" + cluster_form(message).split(":")[1]):
        with pytest.raises(ValueError, match="unreadable MQTT 5 properties"):
            from_cluster_form(b"x", garbage)
    with pytest.raises(ValueError, match="announces"):
        retained_message(b"\x81\x00\x00\x01\x00short")


def test_a_session_state_carries_its_owner_and_subscription_options_and_reads_what_earlier_versions_stored():
    from ecq.broker.amqtt_hooks import Subscription
    from ecq.broker.cluster_state import SessionState

    subscriptions = [("plain/#", 1, None), ("opt/#", 1, Subscription(True, True, 2, 7))]
    moved = SessionState.from_bytes(SessionState(True, subscriptions, [("t", 1, b"x")], "bob").to_bytes())
    assert (moved.subscriptions, moved.messages, moved.username, moved.owner_known) == (
        subscriptions, [("t", 1, b"x")], "bob", True)
    stored = SessionState.from_kv(json.dumps({"username": None, "subscriptions": [["a/#", 2]]}).encode())
    assert (stored.present, stored.subscriptions, stored.username, stored.owner_known) == (
        True, [("a/#", 2, None)], None, True)
    earlier_kv = SessionState.from_kv(b'[["a/#", 1]]')  # the subscriptions alone: no known owner
    earlier_bus = SessionState.from_bytes(b'{"present": true, "subscriptions": [["a/#", 1]], "messages": []}')
    for earlier in (earlier_kv, earlier_bus):
        assert (earlier.subscriptions, earlier.owner_known) == ([("a/#", 1, None)], False)
    with pytest.raises(TypeError):
        SessionState.from_kv(b'{"username": 7, "subscriptions": []}')
