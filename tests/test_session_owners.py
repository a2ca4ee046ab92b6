"""A persistent session is resumed only by the username that owns it (issue 31, point 1), over TCP against real
``ecq broker`` processes with ``FileAuthPlugin`` and docs/examples/acl-users.conf as shipped: paho 3.1.1 (CleanSession
0) and MQTT 5.0 (Clean Start 0, Session Expiry 600) clients, bob's session offline or online, on the embedded
backend and across two cluster nodes on JetStream (handed over by the node that held it, or read from the cluster's
KV after that node died).

alice, authenticated as alice, connects with client id ``bob``: CONNACK session present 0, none of bob's
subscriptions (his ``$ECQ/bob/#`` and a plain one) nor queue entries reach her, her own SUBSCRIBE to ``$ECQ/bob/#``
is refused by the ACL, and bob's queue entry waits for bob, who gets it once he subscribes again.

Where a test shows that something is NOT delivered, a marker published after it must come first."""

from __future__ import annotations

import asyncio
import json
import signal
import struct

import mqtt5
import pytest
import yaml
from pwdlib.hashers.argon2 import Argon2Hasher

from ecq.store.jsapi import token
from tests.harness import BrokerProcess, Client, fixed_header, wait_until, write
from tests.mqtt_wire import CONNACK, SUBACK, WireClient, subscribe_packet
from tests.test_cluster_state import PROPAGATION_BOUND_S, kv_value, started
from tests.test_mqtt5 import V5Client, v5_packet
from tests.test_transports import REPO

USERS = ("alice", "bob", "backend")
ACL_USERS = REPO / "docs/examples/acl-users.conf"
SESSION = {"SessionExpiryInterval": 600}


@pytest.fixture(scope="module")
def passwd(tmp_path_factory):
    """A password file for alice, bob and backend (password ``<user>-secret``)."""
    path = tmp_path_factory.mktemp("users") / "passwd"
    path.write_text("".join(f"{user}:{Argon2Hasher().hash(user + '-secret')}\n" for user in USERS))
    return path


def authenticated(node: BrokerProcess, passwd, acl=ACL_USERS) -> BrokerProcess:
    """``node`` (not started) with FileAuthPlugin on ``passwd`` instead of anonymous access, and the ACL file ``acl``
    (the shipped docs/examples/acl-users.conf by default)."""
    config = yaml.safe_load(node.config_path.read_text())
    plugins = config["plugins"]
    plugins.pop("amqtt.plugins.authentication.AnonymousAuthPlugin")
    plugins = {"amqtt.plugins.authentication.FileAuthPlugin": {"password_file": str(passwd)}, **plugins}
    plugins["ecq.broker.plugin.EcqPlugin"]["acl_file"] = str(acl)
    config["plugins"] = plugins
    node.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return node


def persistent(protocol: str, port: int, clientid: str, user: str, manual_ack: bool = False) -> Client | V5Client:
    """A paho client of ``user`` with client id ``clientid`` in a persistent session (3.1.1: CleanSession 0; 5:
    Clean Start 0 and Session Expiry 600); ``manual_ack``: it acknowledges nothing."""
    if protocol == "3.1.1":
        return Client(port, clientid, clean_session=False, username=user, password=f"{user}-secret",
                      manual_ack=manual_ack)
    return V5Client(port, clientid, manual_ack=manual_ack, clean_start=False, username=user,
                    password=f"{user}-secret", **SESSION)


def granted(client: Client | V5Client, topic_filter: str) -> int:
    """The SUBACK code of a QoS 1 SUBSCRIBE to ``topic_filter``."""
    code = client.subscribe(topic_filter)
    return code if isinstance(code, int) else code[0]


def next_topics(client: Client | V5Client, count: int) -> list[tuple[str, bytes]]:
    return [(m.topic, m.payload) for m in client.expect(count)]


def online_bob(protocol: str, port: int) -> WireClient:
    """bob connected in a persistent session on raw TCP (paho would reconnect once taken over), subscribed to his
    queue and to ``news/#``."""
    client = WireClient(port)
    if protocol == "3.1.1":
        body = (b"\x00\x04MQTT\x04\xc0\x00\x3c" + b"".join(struct.pack(">H", len(s)) + s
                                                         for s in (b"bob", b"bob", b"bob-secret")))
        client.send(fixed_header(0x10, len(body)) + body)
        connack = client.next()
        assert connack.kind == CONNACK and connack.body[1] == 0, connack
        client.send(subscribe_packet(1, ("$ECQ/bob/#", 1), ("news/#", 1)))
        assert client.next().kind == SUBACK
        return client
    client.send(mqtt5.ConnectPacket("bob", clean_start=False, session_expiry_interval=600, username="bob",
                                    password=b"bob-secret").write())
    assert v5_packet(client.next()).reason_code == 0
    client.send(mqtt5.SubscribePacket(1, [mqtt5.TopicFilter(f, max_qos=mqtt5.QoS.AT_LEAST_ONCE)
                                          for f in ("$ECQ/bob/#", "news/#")]).write())
    assert v5_packet(client.next()).reason_codes == [1, 1]
    return client


def leave_bob_offline(protocol: str, port: int, resumed_on: int) -> None:
    """bob's persistent session, subscribed on ``port`` to his queue and to ``news/#``, resumed once by bob himself on
    ``resumed_on`` (the owner still resumes it, also on another node of a cluster), then left offline."""
    bob = persistent(protocol, port, "bob", "bob")
    assert granted(bob, "$ECQ/bob/#") == 1 and granted(bob, "news/#") == 1
    bob.close()
    bob = persistent(protocol, resumed_on, "bob", "bob")
    assert bob.session_present
    bob.close()


def alice_as_bob_gets_nothing_of_his(protocol: str, port: int, backend: Client) -> None:
    """alice connects with client id bob: a new session, nothing of bob's delivered, his queue refused to her."""
    alice = persistent(protocol, port, "bob", "alice")
    try:
        assert not alice.session_present
        assert granted(alice, "marker/#") == 1
        write(backend, "bob", "after", b"written once alice holds the client id")
        backend.publish("news/1", b"for bob's news subscription")
        backend.publish("marker/1", b"marker")
        assert next_topics(alice, 1) == [("marker/1", b"marker")]
        assert granted(alice, "$ECQ/bob/#") == 0x80  # the ACL: a user reads only the queue named as its username
    finally:
        alice.close()


def bob_gets_his_queue_back(protocol: str, port: int) -> None:
    """bob's queue lost nothing to alice: his new session (alice's CONNECT discarded the old one) reads it."""
    bob = persistent(protocol, port, "bob", "bob")
    try:
        assert not bob.session_present
        assert granted(bob, "$ECQ/bob/#") == 1
        assert next_topics(bob, 2) == [("$ECQ/bob/secret", b"for bob only"),
                                       ("$ECQ/bob/after", b"written once alice holds the client id")]
    finally:
        bob.close()


def backend_of(port: int) -> Client:
    return Client(port, "backend-1", username="backend", password="backend-secret")


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
@pytest.mark.parametrize("bob_is", ["offline", "online"])
def test_another_username_does_not_resume_a_session_on_one_broker(broker_process, passwd, protocol, bob_is):
    broker = authenticated(broker_process(), passwd).start()
    backend = backend_of(broker.port)
    try:
        if bob_is == "online":
            bob = online_bob(protocol, broker.port)
        else:
            leave_bob_offline(protocol, broker.port, broker.port)
        write(backend, "bob", "secret", b"for bob only")
        alice_as_bob_gets_nothing_of_his(protocol, broker.port, backend)
        if bob_is == "online":
            bob.until_closed()  # the takeover closed bob's connection (MQTT 3.1.1 section 3.1.4)
        bob_gets_his_queue_back(protocol, broker.port)
    finally:
        backend.close()


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
@pytest.mark.parametrize("bob_is", ["offline", "online", "on a dead node"])
def test_another_username_does_not_resume_a_session_from_the_other_node(cluster_nodes, passwd, jetstream_options,
                                                                         nats_cluster, protocol, bob_is):
    """bob's session is held by node 2 (online: his connection there) when alice connects to node 1."""
    node1, node2 = started([authenticated(node, passwd) for node in cluster_nodes()])
    backend = backend_of(node1.port)
    try:
        if bob_is == "online":
            bob = online_bob(protocol, node2.port)
        else:
            leave_bob_offline(protocol, node1.port, node2.port)
        write(backend, "bob", "secret", b"for bob only")
        if bob_is == "on a dead node":
            bucket = f"{jetstream_options['jetstream_namespace']}_sessions"
            stored = lambda: asyncio.run(kv_value(nats_cluster.urls, bucket, token("bob")))  # noqa: E731
            assert wait_until(lambda: stored() is not None, PROPAGATION_BOUND_S, 0.1)
            assert json.loads(stored())["username"] == "bob"
            node2.kill()
        alice_as_bob_gets_nothing_of_his(protocol, node1.port, backend)
        if bob_is == "online":
            bob.until_closed()
        bob_gets_his_queue_back(protocol, node1.port if bob_is == "on a dead node" else node2.port)
    finally:
        backend.close()


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_a_resumed_session_keeps_only_the_subscriptions_the_acl_grants_now(broker_process, passwd, tmp_path, protocol):
    """bob resumes his own session after the ACL, reloaded meanwhile, stopped granting him ``news/#``: his queue's
    subscription is resumed (its entry delivered without a SUBSCRIBE), ``news/#`` is dropped with the messages
    queued and left unacknowledged for it."""
    acl = tmp_path / "acl.conf"
    acl.write_text(ACL_USERS.read_text())
    broker = authenticated(broker_process(), passwd, acl).start()
    backend = backend_of(broker.port)
    try:
        bob = persistent(protocol, broker.port, "bob", "bob", manual_ack=True)
        assert granted(bob, "news/#") == 1
        backend.publish("news/unacked", b"sent, never acknowledged")
        assert next_topics(bob, 1) == [("news/unacked", b"sent, never acknowledged")]
        assert granted(bob, "$ECQ/bob/#") == 1
        bob.close()
        write(backend, "bob", "secret", b"for bob only")
        backend.publish("news/queued", b"queued while bob was offline")
        acl.write_text('{deny, {user, "bob"}, subscribe, ["news/#"]}.\n' + ACL_USERS.read_text())
        broker.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "ACL reloaded" in broker.log(), 5)
        bob = persistent(protocol, broker.port, "bob", "bob")
        try:
            assert bob.session_present
            assert next_topics(bob, 1) == [("$ECQ/bob/secret", b"for bob only")]
            assert granted(bob, "marker/#") == 1
            backend.publish("news/live", b"after the reload")
            backend.publish("marker/1", b"marker")
            assert next_topics(bob, 1) == [("marker/1", b"marker")]
        finally:
            bob.close()
    finally:
        backend.close()
