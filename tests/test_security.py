"""Nothing reaches ``$ECQ/<clientid>/...`` except ECQ's own delivery.

A Will under ``$ECQ/`` (or one the ACL denies for publish) is refused at CONNECT with CONNACK 0x05; amqtt
never broadcasts to nor retains an ``$ECQ/`` topic, whoever asks (a Will, a plugin); a retained ECQ write
is an ordinary write. Real broker subprocess, paho clients and raw sockets over TCP.
"""

from __future__ import annotations

import socket
import struct

from ecq.broker.access import WILL_REFUSAL_LOG_BURST
from tests.forger_plugin import PLUGIN_PATH as FORGER
from tests.harness import RawClient, topics_payloads, write

CONNACK_ACCEPTED = (0x20, b"\x00\x00")
CONNACK_NOT_AUTHORIZED = (0x20, b"\x00\x05")


class WillClient(RawClient):
    """A raw MQTT 3.1.1 CONNECT with a Will (clean session); the CONNACK is kept in ``connack``, whatever it is.

    ``drop()`` closes the socket without DISCONNECT, which makes the broker publish an accepted Will.
    """

    def __init__(self, port: int, client_id: str, will_topic: str, will_payload: bytes = b"forged",
                 will_qos: int = 1, will_retain: bool = False, username: str | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        flags = 0x02 | 0x04 | will_qos << 3 | (0x20 if will_retain else 0) | (0x80 if username is not None else 0)
        payload = b"".join(_string(s) for s in (client_id.encode(), will_topic.encode(), will_payload))
        if username is not None:
            payload += _string(username.encode())
        self.send(0x10, b"\x00\x04MQTT\x04" + bytes([flags]) + b"\x00\x3c" + payload)
        self.connack = self._recv()

    def closed_by_broker(self) -> bool:
        """True when the broker closed the connection (EOF or reset within the socket timeout)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def drop(self) -> None:
        self.sock.close()


def _string(data: bytes) -> bytes:
    return struct.pack(">H", len(data)) + data


def acl_file(tmp_path, rules: str) -> str:
    path = tmp_path / "acl.conf"
    path.write_text(rules)
    return str(path)


def subscribed(connect, port: int, clientid: str):
    client = connect(port, clientid)
    assert client.subscribe(f"$ECQ/{clientid}/#") == 1
    return client


def test_a_will_under_ecq_is_refused_and_never_reaches_the_queue(broker, connect):
    victim = subscribed(connect, broker.port, "victim")
    for retain in (False, True):
        attacker = WillClient(broker.port, f"attacker-{retain}", "$ECQ/victim/k", will_retain=retain)
        assert attacker.connack == CONNACK_NOT_AUTHORIZED
        assert attacker.closed_by_broker()
        attacker.drop()
    write(connect(broker.port, "producer"), "victim", "control", "c")
    assert topics_payloads(victim.expect(1)) == [("$ECQ/victim/control", b"c")]
    assert victim.quiet(1.0) == []
    victim.close()
    assert subscribed(connect, broker.port, "victim").quiet(1.0) == []  # no retained forgery on re-subscribe
    assert "ECQ refused CONNECT of 'attacker-True'" in broker.log() and "is under $ECQ/" in broker.log()


def test_a_refused_connect_leaves_the_live_session_of_its_clientid_alone(broker, connect):
    victim = subscribed(connect, broker.port, "victim")
    impostor = WillClient(broker.port, "victim", "$ECQ/victim/k")
    assert impostor.connack == CONNACK_NOT_AUTHORIZED
    impostor.drop()
    write(connect(broker.port, "producer"), "victim", "k", "real")
    assert topics_payloads(victim.expect(1)) == [("$ECQ/victim/k", b"real")]
    assert not victim.disconnected.is_set()


def test_a_will_the_acl_denies_is_refused_and_an_allowed_one_still_goes_out(make_broker, connect, tmp_path):
    rules = '{deny, {username, "guest"}, publish, ["alerts/#"]}.\n{allow, all}.\n'
    broker = make_broker(acl_file=acl_file(tmp_path, rules))
    listener = connect(broker.port, "listener")
    assert listener.subscribe("alerts/#") == 1
    guest = WillClient(broker.port, "g1", "alerts/down", b"from-guest", username="guest")
    assert guest.connack == CONNACK_NOT_AUTHORIZED
    assert guest.closed_by_broker()
    guest.drop()
    ops = WillClient(broker.port, "o1", "alerts/down", b"from-ops", username="ops")
    assert ops.connack == CONNACK_ACCEPTED
    ops.drop()
    assert topics_payloads(listener.expect(1)) == [("alerts/down", b"from-ops")]
    assert listener.quiet(1.0) == []
    assert "denied for publish by the ACL" in broker.log()


def test_the_ecq_will_refusal_holds_whatever_the_acl_says(make_broker, tmp_path):
    broker = make_broker(acl_file=acl_file(tmp_path, "{allow, all}.\n"))
    attacker = WillClient(broker.port, "a1", "$ECQ/victim/k")
    assert attacker.connack == CONNACK_NOT_AUTHORIZED
    attacker.drop()


def test_a_plugin_broadcast_or_retain_under_ecq_reaches_no_queue(connect, broker_with_plugin):
    broker = broker_with_plugin(FORGER)
    try:
        victim = subscribed(connect, broker.port, "victim")
        plain = connect(broker.port, "plain")
        assert plain.subscribe("plain/#") == 1
        forger = connect(broker.port, "forger")
        forger.publish("forge/plain/t", "works")  # the forger plugin does work on a plain topic
        assert topics_payloads(plain.expect(1)) == [("plain/t", b"works")]
        forger.publish("forge/$ECQ/victim/k", "forged")
        forger.publish("forge/plain/after", "sync")  # the plugin handles them in order
        assert topics_payloads(plain.expect(1)) == [("plain/after", b"sync")]
        write(forger, "victim", "control", "c")
        assert topics_payloads(victim.expect(1)) == [("$ECQ/victim/control", b"c")]
        assert victim.quiet(1.0) == []
        victim.close()
        # amqtt sends a new connection the retained messages of every broker subscription, so plain/t comes too
        again = subscribed(connect, broker.port, "victim").quiet(1.0)
        assert [m.topic for m in again if m.topic.startswith("$ECQ/")] == []
        assert "dropped an amqtt broadcast to '$ECQ/victim/k'" in broker.log()
        assert "did not retain a message on '$ECQ/victim/k'" in broker.log()
    finally:
        broker.kill()


def test_a_retained_ecq_write_is_an_ordinary_write_and_never_retained(broker, connect):
    producer = connect(broker.port, "producer")
    info = producer._c.publish("$ECQ/w/rw/k", "v", qos=1, retain=True)
    info.wait_for_publish(10)
    assert info.is_published()
    consumer = subscribed(connect, broker.port, "rw")
    assert [(m.topic, m.payload) for m in consumer.expect(1)] == [("$ECQ/rw/k", b"v")]
    assert consumer.quiet(1.0) == []
    consumer.close()
    assert subscribed(connect, broker.port, "rw").quiet(1.0) == []


def test_refused_wills_of_a_client_reconnecting_in_a_loop_are_logged_in_a_bounded_number_of_lines(broker):
    """40 refused Will CONNECTs in a row: at most WILL_REFUSAL_LOG_BURST lines of ECQ's reason (the next one says how
    many were held back), and none of amqtt's two warnings per refused connection."""
    for n in range(40):
        attacker = WillClient(broker.port, f"looping-{n}", "$ECQ/victim/k")
        assert attacker.connack == CONNACK_NOT_AUTHORIZED
        attacker.drop()
    log = broker.log()
    assert "ECQ refused CONNECT of 'looping-0'" in log
    assert 1 <= log.count("ECQ refused CONNECT of 'looping-") <= WILL_REFUSAL_LOG_BURST
    assert "Invalid connection from" not in log and "refused with 0x05" not in log  # amqtt's two lines, quoting ours
