"""State of ordinary MQTT that follows the client across two ECQ nodes on the session's 3-server NATS cluster
(issue 24, point 7), over TCP with paho clients: retained messages in the cluster's KV, persistent sessions handed
over by the node that held them (or read from the KV when it died), clean sessions discarded everywhere."""

from __future__ import annotations

import asyncio

import pytest

from ecq.store.jsapi import token
from tests.harness import BrokerProcess, RawClient, wait_until, write

PROPAGATION_BOUND_S = 5.0   # a KV write seen by the other node's watch


def started(nodes: list[BrokerProcess]) -> list[BrokerProcess]:
    return [node.start() for node in nodes]


def retained_seen(connect, node: BrokerProcess, topic_filter: str, name: str) -> list[tuple[str, bytes]]:
    """What a new subscription to ``topic_filter`` on ``node`` gets at once (its retained messages)."""
    client = connect(node.port, name)
    client.subscribe(topic_filter)
    seen = [(m.topic, m.payload) for m in client.quiet(0.3)]
    client.close()
    return seen


def eventually_retained(connect, node: BrokerProcess, topic_filter: str, expected: list[tuple[str, bytes]]) -> None:
    seen: list = []
    attempts = iter(range(1000))

    def matches() -> bool:
        seen[:] = retained_seen(connect, node, topic_filter, f"probe-{next(attempts)}")
        return seen == expected
    assert wait_until(matches, PROPAGATION_BOUND_S, 0.1), f"retained on {topic_filter}: {seen}, expected {expected}"


# --- retained messages -----------------------------------------------------------------------------


def test_a_retained_message_on_one_node_is_retained_on_the_other_and_cleared_from_either(cluster_nodes, connect):
    node1, node2 = started(cluster_nodes())
    connect(node1.port, "pub-1").publish("state/lamp", b"on", qos=1, retain=True)
    eventually_retained(connect, node2, "state/#", [("state/lamp", b"on")])
    connect(node2.port, "pub-2").publish("state/lamp", b"", qos=1, retain=True)  # MQTT 3.1.1 section 3.3.1.3
    eventually_retained(connect, node1, "state/#", [])
    assert retained_seen(connect, node2, "state/#", "after-clear") == []


def test_a_node_started_after_the_retain_and_the_first_node_stopped_has_it(cluster_nodes, connect):
    [node1] = started(cluster_nodes(1))
    connect(node1.port, "pub").publish("state/door", b"open", qos=1, retain=True)
    connect(node1.port, "pub").publish("state/fan", b"off", qos=0, retain=True)
    eventually_retained(connect, node1, "state/#", [("state/door", b"open"), ("state/fan", b"off")])
    assert node1.stop() == 0  # the KV writes go before the NATS link closes
    [node2] = started(cluster_nodes(1))
    assert sorted(retained_seen(connect, node2, "state/#", "late")) == [("state/door", b"open"), ("state/fan", b"off")]


# --- persistent sessions ---------------------------------------------------------------------------


def queued_while_offline(connect, node1: BrokerProcess, node2: BrokerProcess, clientid: str, count: int) -> list:
    """``clientid`` subscribes ``<clientid>/#`` at QoS 1 on node 1 in a persistent session and disconnects; then
    ``count`` messages ``m0``.. on ``<clientid>/m`` are published through both nodes in turn, each once a witness
    on node 1 saw the one before (so they reach the offline session in order). Returns the two publishers."""
    client = connect(node1.port, clientid, clean_session=False)
    assert client.subscribe(f"{clientid}/#", 1) == 1
    client.close()
    witness = connect(node1.port, "witness")
    witness.subscribe(f"{clientid}/#", 1)
    publishers = [connect(node1.port, "pub-1"), connect(node2.port, "pub-2")]
    for i in range(count):
        publishers[i % 2].publish(f"{clientid}/m", f"m{i}".encode(), qos=1)
        assert witness.expect(1)[0].payload == f"m{i}".encode()
    return publishers


def test_a_persistent_session_moves_to_the_node_where_the_client_reconnects(cluster_nodes, connect):
    node1, node2 = started(cluster_nodes())
    publishers = queued_while_offline(connect, node1, node2, "ps", 6)

    moved = connect(node2.port, "ps", clean_session=False)  # no SUBSCRIBE from here on
    assert moved.session_present is True
    assert [(m.topic, m.payload, m.qos) for m in moved.expect(6)] == [("ps/m", f"m{i}".encode(), 1) for i in range(6)]
    for i, publisher in enumerate(publishers):
        publisher.publish("ps/m", f"live{i}".encode(), qos=1)
    assert sorted(m.payload for m in moved.expect(2)) == [b"live0", b"live1"]
    assert moved.quiet(1.0) == []  # node 1 dropped its copy: no second delivery
    moved.close()

    cleaner = connect(node2.port, "ps", clean_session=True)  # discards the session everywhere
    cleaner.close()
    back = connect(node1.port, "ps", clean_session=False)
    assert back.session_present is False
    publishers[1].publish("ps/m", b"after-clean", qos=1)
    assert back.quiet(1.0) == []


def test_a_persistent_session_outlives_the_death_of_its_node(cluster_nodes, connect, jetstream_options, nats_cluster):
    node1, node2 = started(cluster_nodes())
    client = connect(node1.port, "orphan", clean_session=False)
    assert client.subscribe("orphan/#", 1) == 1
    client.close()
    bucket = f"{jetstream_options['jetstream_namespace']}_sessions"
    assert wait_until(lambda: asyncio.run(kv_value(nats_cluster.urls, bucket, token("orphan"))) is not None,
                      PROPAGATION_BOUND_S, 0.1)
    node1.kill()
    moved = connect(node2.port, "orphan", clean_session=False)
    assert moved.session_present is True
    connect(node2.port, "pub").publish("orphan/x", b"still subscribed", qos=1)
    [message] = moved.expect(1)
    assert (message.topic, message.payload, message.qos) == ("orphan/x", b"still subscribed", 1)


async def kv_value(urls: list[str], bucket: str, key: str) -> bytes | None:
    """The value of ``key`` in the KV ``bucket`` as NATS has it (None: no such key or bucket)."""
    import nats
    client = await nats.connect(urls, connect_timeout=2, max_reconnect_attempts=2)
    try:
        return (await (await client.jetstream(timeout=5).key_value(bucket)).get(key)).value
    except Exception:
        return None
    finally:
        await client.close()


def test_a_clean_connect_on_one_node_discards_the_session_the_other_node_holds(cluster_nodes, connect):
    node1, node2 = started(cluster_nodes())
    client = connect(node1.port, "wiped", clean_session=False)
    assert client.subscribe("wiped/#", 1) == 1
    client.close()
    connect(node1.port, "pub").publish("wiped/queued", b"dropped with the session", qos=1)
    connect(node2.port, "wiped", clean_session=True).close()  # MQTT 3.1.1 section 3.1.2.4
    back = connect(node1.port, "wiped", clean_session=False)
    assert back.session_present is False
    connect(node2.port, "pub-2").publish("wiped/new", b"no subscription left", qos=1)
    assert back.quiet(1.0) == []


def test_a_persistent_queue_consumer_resumes_on_the_other_node_without_subscribing(cluster_nodes, connect):
    node1, node2 = started(cluster_nodes())
    consumer = connect(node1.port, "pq", clean_session=False)
    assert consumer.subscribe("$ECQ/pq/#", 1) == 1
    producer = connect(node2.port, "producer")
    write(producer, "pq", "k1", "v1")
    assert [(m.topic, m.payload) for m in consumer.expect(1)] == [("$ECQ/pq/k1", b"v1")]
    consumer.close()
    write(producer, "pq", "k2", "v2")
    moved = connect(node2.port, "pq", clean_session=False)
    assert moved.session_present is True
    assert [(m.topic, m.payload) for m in moved.expect(1)] == [("$ECQ/pq/k2", b"v2")]
    assert moved.quiet(1.0) == []


def test_a_persistent_connection_taken_over_from_the_other_node_brings_its_subscriptions(cluster_nodes, connect):
    node1, node2 = started(cluster_nodes())
    old = RawClient(node1.port, "live", clean_session=False)  # raw: paho would reconnect by itself
    assert old.subscribe(b"live/#")[0] == 0x90
    new = connect(node2.port, "live", clean_session=False)  # MQTT 3.1.1 section 3.1.4: the old connection is closed
    assert new.session_present is True
    old.read_until_closed(timeout=5)
    old.close()
    connect(node1.port, "pub").publish("live/x", b"to the new connection", qos=1)
    assert [(m.topic, m.payload) for m in new.expect(1)] == [("live/x", b"to the new connection")]
    assert new.quiet(1.0) == []


def test_the_queue_of_a_persistent_session_outlives_the_death_of_its_node(cluster_nodes, connect, jetstream_options,
                                                                          nats_cluster):
    node1, node2 = started(cluster_nodes())
    queued_while_offline(connect, node1, node2, "orphanq", 4)
    stream = f"{jetstream_options['jetstream_namespace']}_SESSIONS"
    assert wait_until(lambda: asyncio.run(stored_count(nats_cluster.urls, stream)) == 4, PROPAGATION_BOUND_S, 0.1)
    node1.kill()
    moved = connect(node2.port, "orphanq", clean_session=False)
    assert moved.session_present is True
    expected = [("orphanq/m", f"m{i}".encode(), 1) for i in range(4)]
    assert [(m.topic, m.payload, m.qos) for m in moved.expect(4)] == expected
    assert wait_until(lambda: asyncio.run(stored_count(nats_cluster.urls, stream)) == 0, PROPAGATION_BOUND_S, 0.1)


async def stored_count(urls: list[str], stream: str) -> int | None:
    """How many messages ``stream`` holds (None: no such stream)."""
    import nats
    client = await nats.connect(urls, connect_timeout=2, max_reconnect_attempts=2)
    try:
        return (await client.jetstream(timeout=5).stream_info(stream)).state.messages
    except Exception:
        return None
    finally:
        await client.close()


def test_a_qos2_message_the_client_received_is_released_not_sent_again_on_the_other_node(cluster_nodes, connect):
    """MQTT 3.1.1 section 4.3.3: once the client sent PUBREC it holds the message; the sender may only send PUBREL
    for that packet id (section 4.4: again on reconnect), never the PUBLISH again, or a QoS 2 message is
    delivered twice."""
    node1, node2 = started(cluster_nodes())
    old = RawClient(node1.port, "q2", clean_session=False)
    assert old.subscribe(b"q2/#", qos=2)[0] == 0x90
    connect(node1.port, "pub").publish("q2/m", b"exactly once", qos=2)
    header, body = old.receive()
    assert header & 0xF6 == 0x34, f"expected a QoS 2 PUBLISH, got {header:#x}"
    packet_id = body[2 + int.from_bytes(body[:2], "big"):][:2]
    old.send(0x50, packet_id)  # PUBREC; the broker's PUBREL is left without PUBCOMP
    assert old.receive() == (0x62, packet_id)
    old.close()

    moved = RawClient(node2.port, "q2", clean_session=False)
    assert moved.receive() == (0x62, packet_id)  # PUBREL again, the same packet id (DUP-free: section 4.4)
    moved.send(0x70, packet_id)  # PUBCOMP
    assert moved.ping()  # nothing else came before the PINGRESP: the message was not sent again
    moved.close()


# --- sends not acknowledged when their node dies ----------------------------------------------------


def stored_copies(nats_cluster, jetstream_options) -> int | None:
    """How many messages the stream of persistent sessions' queues and sends holds now."""
    stream = f"{jetstream_options['jetstream_namespace']}_SESSIONS"
    return asyncio.run(stored_count(nats_cluster.urls, stream))


def reconnected_after_kill9(node1: BrokerProcess, node2: BrokerProcess, device: RawClient, clientid: str,
                            back_on: str) -> RawClient:
    """kill -9 of ``node1`` while ``device`` is connected to it, then ``clientid``'s CleanSession 0 reconnect, without
    a SUBSCRIBE, to ``node1`` restarted or to ``node2`` (``back_on``): session present 1."""
    node1.kill()
    device.close()
    back = RawClient((node1.start() if back_on == "the restarted node" else node2).port, clientid, clean_session=False)
    assert back.session_present
    return back


@pytest.mark.timeout(90)
@pytest.mark.parametrize("back_on", ["the restarted node", "the other node"])
def test_a_message_sent_and_not_acknowledged_outlives_a_kill9_of_its_node(cluster_nodes, connect, jetstream_options,
                                                                         nats_cluster, back_on):
    """A QoS 1 message of an ordinary topic sent to a connected persistent session is in JetStream before its
    publisher's PUBACK and deleted at its subscriber's PUBACK (``ClusterState.store_sends``, ``settle_sends``): after
    a kill -9 of the node, the CleanSession 0 CONNECT gets session present 1 and the message not acknowledged, not
    the one acknowledged (MQTT 3.1.1 sections 4.4, 3.1.2.4), on the restarted node and on the other node alike."""
    node1, node2 = started(cluster_nodes())
    device = RawClient(node1.port, "inflight", clean_session=False)  # raw: it acknowledges only what it is told to
    assert device.subscribe(b"cmd/#")[0] == 0x90
    producer = connect(node1.port, "backend")
    producer.publish("cmd/inflight", b"acknowledged")
    _topic, packet_id, payload = device.receive_publish()
    assert payload == b"acknowledged"
    device.puback(packet_id)
    assert device.ping()
    producer.publish("cmd/inflight", b"not acknowledged")  # PUBACKed: stored by then
    assert device.receive_publish()[2] == b"not acknowledged"
    assert wait_until(lambda: stored_copies(nats_cluster, jetstream_options) == 1, PROPAGATION_BOUND_S, 0.1)
    back = reconnected_after_kill9(node1, node2, device, "inflight", back_on)
    _topic, packet_id, payload = back.receive_publish()
    assert payload == b"not acknowledged"
    back.puback(packet_id)
    assert back.ping()  # nothing else came before the PINGRESP: the acknowledged one did not come again
    assert wait_until(lambda: stored_copies(nats_cluster, jetstream_options) == 0, PROPAGATION_BOUND_S, 0.1)
    back.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("back_on", ["the restarted node", "the other node"])
def test_a_resumed_queue_sent_and_not_acknowledged_outlives_a_kill9_of_its_node(cluster_nodes, connect,
                                                                               jetstream_options, nats_cluster,
                                                                               back_on):
    """The messages queued for an offline session stay in JetStream while its reconnect sends them, each until its
    PUBACK (``ClusterState.take_queue``): after a kill -9 of the node, the next reconnect gets the one not
    acknowledged, not the one acknowledged."""
    node1, node2 = started(cluster_nodes())
    device = RawClient(node1.port, "resumed", clean_session=False)
    assert device.subscribe(b"cmd/#")[0] == 0x90
    device.close()
    producer = connect(node1.port, "backend")
    producer.publish("cmd/resumed", b"q0")
    producer.publish("cmd/resumed", b"q1")
    device = RawClient(node1.port, "resumed", clean_session=False)
    assert device.session_present
    sent = [device.receive_publish() for _ in range(2)]
    assert [payload for _topic, _packet_id, payload in sent] == [b"q0", b"q1"]
    device.puback(sent[0][1])
    assert device.ping()
    assert wait_until(lambda: stored_copies(nats_cluster, jetstream_options) == 1, PROPAGATION_BOUND_S, 0.1)
    back = reconnected_after_kill9(node1, node2, device, "resumed", back_on)
    assert back.receive_publish()[2] == b"q1"
    assert back.ping()
    back.close()


@pytest.mark.timeout(60)
def test_a_clean_connect_deletes_the_stored_sends_of_the_session_it_ends(cluster_nodes, connect, jetstream_options,
                                                                         nats_cluster):
    """A CleanSession 1 CONNECT on another node ends the session (MQTT 3.1.1 section 3.1.2.4): its sends not
    acknowledged are purged from JetStream with its queue (``ClusterState.drop_queue``), none left to a later crash."""
    node1, node2 = started(cluster_nodes())
    device = RawClient(node1.port, "ended", clean_session=False)
    assert device.subscribe(b"cmd/#")[0] == 0x90
    connect(node1.port, "backend").publish("cmd/ended", b"never acknowledged")
    assert device.receive_publish()[2] == b"never acknowledged"
    assert wait_until(lambda: stored_copies(nats_cluster, jetstream_options) == 1, PROPAGATION_BOUND_S, 0.1)
    connect(node2.port, "ended", clean_session=True).close()
    assert wait_until(lambda: stored_copies(nats_cluster, jetstream_options) == 0, PROPAGATION_BOUND_S, 0.1)
    device.close()
