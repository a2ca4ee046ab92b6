"""A refused CONNECT changes nothing (issue 31, follow-up of point 1), over TCP against real ``ecq broker`` processes
with ``FileAuthPlugin`` and docs/examples/acl-users.conf: CONNECTs with a wrong password naming client id ``bob``
(as bob with CleanSession 1 and 0, as alice with both; MQTT 5: Clean Start 1 and 0, Session Expiry 600), sent on raw
sockets, get CONNACK 0x05 (MQTT 5: 0x87) with session present 0 and are closed. bob's persistent session, with an
ordinary QoS 1 message queued for it and an ECQ queue entry, is not deleted, discarded, resumed or claimed by them:
bob resumes it with session present 1 and gets both; an online bob stays connected (no DISCONNECT, no close) and
keeps receiving. On two cluster nodes (JetStream) the refused CONNECTs go to the node that does not hold bob's
session (MQTT 3.1.1 section 3.1.4: the server authenticates, and on refusal answers and closes, before any takeover).
"""

from __future__ import annotations

import struct

import mqtt5
import pytest

from tests.harness import fixed_header, write
from tests.mqtt_wire import CONNACK, PUBLISH, WireClient, puback_packet
from tests.test_cluster_state import started
from tests.test_mqtt5 import v5_packet
from tests.test_session_owners import (authenticated, backend_of, granted, leave_bob_offline, online_bob,  # noqa: F401
                                       passwd, persistent)  # passwd: a fixture

REFUSED = [("bob", True), ("bob", False), ("alice", True), ("alice", False)]  # (username, clean session) of each


def refused_connect(protocol: str, port: int, user: str, clean: bool) -> None:
    """A CONNECT with client id bob as ``user`` with a wrong password, on a raw socket: CONNACK 0x05 (MQTT 5: 0x87),
    session present 0, then the connection closed with nothing else sent."""
    client = WireClient(port)
    try:
        if protocol == "3.1.1":
            body = (b"\x00\x04MQTT\x04" + bytes([0xC0 | (0x02 if clean else 0)]) + b"\x00\x3c"
                    + b"".join(struct.pack(">H", len(s)) + s for s in (b"bob", user.encode(), b"wrong")))
            client.send(fixed_header(0x10, len(body)) + body)
            connack = client.next()
            assert connack is not None and connack.kind == CONNACK and connack.body == b"\x00\x05", connack
        else:
            client.send(mqtt5.ConnectPacket("bob", clean_start=clean, session_expiry_interval=600, username=user,
                                            password=b"wrong").write())
            connack = v5_packet(client.next())
            assert connack.reason_code == 0x87 and not connack.session_present, connack
        assert client.until_closed() == []
    finally:
        client.close()


def queue_for_bob(backend, tag: str) -> set[tuple[str, bytes]]:
    """An ECQ queue entry for bob and an ordinary QoS 1 message on his ``news/#``: what he should get."""
    write(backend, "bob", tag, f"queue entry {tag}".encode())
    backend.publish(f"news/{tag}", f"news {tag}".encode())
    return {(f"$ECQ/bob/{tag}", f"queue entry {tag}".encode()), (f"news/{tag}", f"news {tag}".encode())}


def received_online(protocol: str, bob: WireClient, count: int) -> set[tuple[str, bytes]]:
    """The next ``count`` packets of online bob's raw connection, each a PUBLISH (not a DISCONNECT nor the end of the
    connection), acknowledged: their (topic, payload)."""
    got = set()
    for _ in range(count):
        packet = bob.next()
        assert packet is not None and packet.kind == PUBLISH, f"bob's connection got {packet} instead of a PUBLISH"
        message = packet.publish() if protocol == "3.1.1" else v5_packet(packet)
        got.add((message.topic, bytes(message.payload)))
        bob.send(puback_packet(message.packet_id))
    return got


def bob_resumes_everything(protocol: str, port: int, expected: set[tuple[str, bytes]]) -> None:
    bob = persistent(protocol, port, "bob", "bob")
    try:
        assert bob.session_present
        assert {(m.topic, m.payload) for m in bob.expect(len(expected))} == expected
    finally:
        bob.close()


def refused_connects_change_nothing(protocol: str, bob_is: str, bob_port: int, refusing_port: int, backend,
                                    refusals: list[tuple[str, bool]]) -> None:
    """bob's session on ``bob_port`` (offline, or online on a raw socket) survives the refused CONNECTs
    ``refusals`` ((username, clean session) each) sent to ``refusing_port``."""
    if bob_is == "online":
        bob = online_bob(protocol, bob_port)
        try:
            before = queue_for_bob(backend, "before")
            assert received_online(protocol, bob, 2) == before
            for user, clean in refusals:
                refused_connect(protocol, refusing_port, user, clean)
            after = queue_for_bob(backend, "after")
            assert received_online(protocol, bob, 2) == after
            assert not bob.available(0.2) and not bob.ended
        finally:
            bob.close()
    else:
        leave_bob_offline(protocol, bob_port, bob_port)
        before = queue_for_bob(backend, "before")
        for user, clean in refusals:
            refused_connect(protocol, refusing_port, user, clean)
        bob_resumes_everything(protocol, bob_port, before | queue_for_bob(backend, "after"))


# (username, clean session) of the refused CONNECT, bob's state, protocol. Not here: bob's own refused resume of his
# offline v5 session, whose only trace was a Will it stopped (test_a_refused_connect_leaves_a_pending_will_pending).
CASES = [(refused, bob_is, protocol) for refused in REFUSED for bob_is in ("offline", "online")
         for protocol in ("3.1.1", "5") if (refused, bob_is, protocol) != (("bob", False), "offline", "5")]


@pytest.mark.parametrize("refused, bob_is, protocol", CASES,
                         ids=[f"{user}-clean{int(clean)}-{bob_is}-{protocol}"
                              for (user, clean), bob_is, protocol in CASES])
def test_a_refused_connect_changes_no_session(broker_process, passwd, protocol, bob_is, refused):
    broker = authenticated(broker_process(), passwd).start()
    backend = backend_of(broker.port)
    try:
        refused_connects_change_nothing(protocol, bob_is, broker.port, broker.port, backend, [refused])
    finally:
        backend.close()
    log = broker.log()
    assert "refused (CONNACK 0x05, MQTT 5 0x87): refused by FileAuthPlugin" in log  # once, rate-limited: not amqtt's
    assert "refused with 0x05: not authorized" not in log and "Invalid connection from" not in log


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
@pytest.mark.parametrize("bob_is", ["offline", "online"])
def test_a_refused_connect_on_another_node_claims_nothing(cluster_nodes, passwd, protocol, bob_is):
    """bob's session is held by node 2 (online: his connection there); the refused CONNECTs go to node 1, whose claim
    would have taken the session and closed bob's connection on node 2 (every kind of REFUSED, one after another)."""
    node1, node2 = started([authenticated(node, passwd) for node in cluster_nodes()])
    backend = backend_of(node1.port)
    try:
        refused_connects_change_nothing(protocol, bob_is, node2.port, node1.port, backend, REFUSED)
    finally:
        backend.close()


def test_a_refused_connect_leaves_a_pending_will_pending(broker_process, passwd):
    """MQTT 5: bob's connection ends with a Will delayed 2 s; a refused CONNECT as bob with Clean Start 0 within the
    delay resumes nothing (MQTT 5.0 section 3.1.3.2.2 cancels the Will only for a resumption): the Will is published."""
    broker = authenticated(broker_process(), passwd).start()
    backend = backend_of(broker.port)
    try:
        assert granted(backend, "news/#") == 1
        bob = WireClient(broker.port)
        bob.send(mqtt5.ConnectPacket("bob", clean_start=True, session_expiry_interval=600, username="bob",
                                     password=b"bob-secret",
                                     will=mqtt5.Will("news/bob-gone", payload=b"gone", will_delay_interval=2)).write())
        assert v5_packet(bob.next()).reason_code == 0
        bob.close()
        refused_connect("5", broker.port, "bob", False)
        assert [(m.topic, m.payload) for m in backend.expect(1)] == [("news/bob-gone", b"gone")]
    finally:
        backend.close()
