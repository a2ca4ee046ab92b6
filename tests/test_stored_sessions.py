"""Persistent sessions survive a restart on the embedded LevelDB store (issue 32, point 4;
``ecq.broker.stored_sessions``), over TCP against real ``ecq broker`` processes restarted on the same data dir, after
SIGTERM and after kill -9: a client reconnecting with CleanSession 0 (MQTT 5: Clean Start 0, Session Expiry > 0) gets
CONNACK session present 1, the QoS 1 messages of ordinary topics queued while it was offline (before the restart,
and after it before it came back) and its ECQ queue, all without SUBSCRIBE; an expired session, one a clean session
discarded and one of another username are not resumed. Where a test shows that something is NOT delivered, a
marker published after it must come first."""

from __future__ import annotations

import re
import time

import pytest

from tests.harness import BrokerProcess, Client, wait_until, write
from tests.test_mqtt5 import V5Client
from tests.test_session_owners import authenticated, passwd, persistent  # noqa: F401 (passwd: a fixture)

PROTOCOLS = ("3.1.1", "5")


def restart(broker: BrokerProcess, how: str) -> BrokerProcess:
    """Stop ``broker`` (SIGTERM, clean exit checked; or kill -9) and start it again on the same data dir and port."""
    if how == "sigterm":
        assert broker.stop() == 0
    else:
        broker.kill()
    return broker.start()


def session_client(protocol: str, port: int, clientid: str, **options) -> Client | V5Client:
    """A persistent session of ``clientid`` (3.1.1: CleanSession 0; 5: Clean Start 0, Session Expiry ``expiry_s``,
    600 s by default)."""
    expiry_s = options.pop("expiry_s", 600)
    if protocol == "3.1.1":  # its expiry is the broker's session_expiry
        return Client(port, clientid, clean_session=False, **options)
    return V5Client(port, clientid, clean_start=False, SessionExpiryInterval=expiry_s, **options)


def received(client: Client | V5Client, count: int) -> list[tuple[str, bytes]]:
    return [(m.topic, bytes(m.payload)) for m in client.expect(count)]


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_persistent_session_is_back_after_a_restart(make_broker, connect, protocol, how):
    broker = make_broker()
    device = session_client(protocol, broker.port, "car1")
    device.subscribe("cmd/car1/#", **({} if protocol == "3.1.1" else {"subscription_id": 7}))
    device.subscribe("$ECQ/car1/#")
    device.close()
    producer = connect(broker.port, "backend")
    producer.publish("cmd/car1/a", b"queued before the restart")
    write(producer, "car1", "k1", "queue entry")
    producer.close()
    broker = restart(broker, how)
    producer = connect(broker.port, "backend")
    producer.publish("cmd/car1/b", b"queued after the restart")
    device = session_client(protocol, broker.port, "car1")
    try:
        assert device.session_present
        messages = device.expect(3)
        assert sorted((m.topic, bytes(m.payload)) for m in messages) == [
            ("$ECQ/car1/k1", b"queue entry"), ("cmd/car1/a", b"queued before the restart"),
            ("cmd/car1/b", b"queued after the restart")]
        if protocol == "5":  # the subscription's options came back with it
            assert [m.properties.SubscriptionIdentifier for m in messages if m.topic.startswith("cmd/")] == [[7], [7]]
        producer.publish("cmd/car1/c", b"live")  # its subscriptions are amqtt's again
        assert received(device, 1) == [("cmd/car1/c", b"live")]
    finally:
        device.close()
    assert "Traceback" not in broker.log()


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_a_message_queued_while_offline_survives_kill9_after_its_puback(make_broker, connect, how):
    broker = make_broker()
    device = session_client("3.1.1", broker.port, "meter7")
    device.subscribe("cmd/meter7")
    device.close()
    producer = connect(broker.port, "backend")
    producer.publish("cmd/meter7", b"first")
    producer.publish("cmd/meter7", b"second")  # PUBACKed after the first was queued (arrival order)
    broker = restart(broker, how)
    device = session_client("3.1.1", broker.port, "meter7")
    assert device.session_present
    assert received(device, 2)[0] == ("cmd/meter7", b"first")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_expired_session_is_not_restored(make_broker, connect, protocol):
    broker = make_broker(session_expiry="2s")
    device = session_client(protocol, broker.port, "old1", expiry_s=2)
    device.subscribe("cmd/old1")
    device.close()
    gone_at = time.monotonic() + 2.5
    broker.stop()
    wait_until(lambda: time.monotonic() > gone_at, 5)
    broker.start()
    device = session_client(protocol, broker.port, "old1")
    assert not device.session_present
    assert re.search(r"0 to restore at their CONNECT, 1 expired", broker.log())


def test_a_clean_session_discards_the_stored_one(make_broker, connect):
    broker = make_broker()
    device = session_client("3.1.1", broker.port, "van2")
    device.subscribe("cmd/van2")
    device.close()
    broker = restart(broker, "kill9")
    clean = connect(broker.port, "van2")
    assert not clean.session_present
    clean.close()
    producer = connect(broker.port, "backend")
    producer.publish("cmd/van2", b"for nobody")
    broker = restart(broker, "sigterm")
    device = session_client("3.1.1", broker.port, "van2")
    assert not device.session_present
    device.subscribe("cmd/van2")
    producer = connect(broker.port, "backend")
    producer.publish("cmd/van2", b"marker")
    assert received(device, 1) == [("cmd/van2", b"marker")]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_restored_session_is_resumed_only_by_its_owner(broker_process, passwd, protocol):
    broker = authenticated(broker_process(), passwd).start()
    bob = persistent(protocol, broker.port, "bob", "bob")
    bob.subscribe("$ECQ/bob/#")
    bob.close()
    backend = Client(broker.port, "backend", username="backend", password="backend-secret")
    write(backend, "bob", "k1", "for bob")
    backend.close()
    broker = restart(broker, "kill9")
    bob = persistent(protocol, broker.port, "bob", "bob", manual_ack=True)  # k1 stays pending
    assert bob.session_present
    assert received(bob, 1) == [("$ECQ/bob/k1", b"for bob")]
    bob.close()
    broker = restart(broker, "kill9")
    alice = persistent(protocol, broker.port, "bob", "alice")
    assert not alice.session_present
    time.sleep(1.0)  # shows only that nothing came
    assert alice.messages.empty()
    alice.close()
    bob = persistent(protocol, broker.port, "bob", "bob")
    assert not bob.session_present  # alice's CONNECT discarded it, as it does before a restart
    bob.close()


def test_thousands_of_sessions_restored_lazily(make_broker, connect):
    broker = make_broker()
    count = 2000
    clients = [f"dev{i}" for i in range(count)]
    for clientid in clients:
        device = Client(broker.port, clientid, clean_session=False)
        device.subscribe(f"cmd/{clientid}")
        device.close()
    broker.kill()
    began = time.monotonic()
    broker.start()
    print(f"\nstart-up with {count} stored sessions: {time.monotonic() - began:.2f} s to accept; broker's own line: "
          + re.findall(r"ECQ stored sessions: .*", broker.log())[-1])
    producer = connect(broker.port, "backend")
    producer.publish_many([(f"cmd/{c}", c.encode()) for c in clients])
    for clientid in clients[::97]:
        device = Client(broker.port, clientid, clean_session=False)
        assert device.session_present, clientid
        assert received(device, 1) == [(f"cmd/{clientid}", clientid.encode())]
        device.close()
