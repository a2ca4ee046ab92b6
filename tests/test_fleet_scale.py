"""A fleet's sessions at a cost per client (issue 32, ``amqtt_hooks.fleet_scale``): a session's deletion takes its
own subscriptions only and offline sessions expire at their deadlines. Against a real `ecq broker` process over TCP,
MQTT 3.1.1. That connects and a stop do not slow down with the number of sessions held is a matter of speed, measured
by `scripts/bench --scenario fleet` (the flatness rows and the SIGTERM times), not by a timed test."""

from __future__ import annotations

import time

from tests.test_mqtt_conformance import Mqtt


def test_a_deleted_session_takes_only_its_own_subscriptions(make_broker):
    """A Clean Session CONNECT deletes the client's old session (MQTT 3.1.1 section 3.1.2.4) and with it exactly that
    session's subscriptions: the other sessions on the same filters, online or offline, keep theirs."""
    broker = make_broker()
    subscribers = {name: Mqtt(broker.port, name, clean=False) for name in ("gone", "online", "offline")}
    for name, client in subscribers.items():
        assert client.subscribe("news/#", 1) == 1
        assert client.subscribe(f"own/{name}", 1, packet_id=2) == 1
    subscribers["gone"].disconnect()
    subscribers["offline"].disconnect()
    gone = Mqtt(broker.port, "gone", clean=True)
    assert not gone.session_present

    sender = Mqtt(broker.port, "sender")
    for packet_id, topic in enumerate(("news/1", "own/gone", "own/online", "own/offline"), 1):
        sender.publish(topic, topic.encode(), qos=1, packet_id=packet_id)
    assert sorted(subscribers["online"].next_publish().topic for _ in range(2)) == ["news/1", "own/online"]
    offline = Mqtt(broker.port, "offline", clean=False)
    assert offline.session_present
    assert sorted(offline.next_publish().topic for _ in range(2)) == ["news/1", "own/offline"]
    assert gone.nothing_within(0.5)
    assert subscribers["online"].nothing_within(0.1) and offline.nothing_within(0.1)


def test_offline_sessions_expire_on_time_from_their_last_disconnect(make_broker):
    """``session_expiry`` counts from a session's last disconnect: a session is forgotten within 1 s after it runs out
    (amqtt's monitor, once a second, took up to 2 s; a session amqtt keeps is forgotten in whole seconds as amqtt
    does, one kept in the store, as these, on time), and one that came back and left again runs from then."""
    expiry_s = 3
    broker = make_broker(session_expiry=f"{expiry_s}s")
    for name in ("leaves", "returns"):
        assert Mqtt(broker.port, name, clean=False).subscribe("a/b", 1) == 1  # closed without DISCONNECT: offline
    left = time.monotonic()
    time.sleep(1.5)
    returning = Mqtt(broker.port, "returns", clean=False)
    assert returning.session_present
    returning.disconnect()
    returned = time.monotonic()

    time.sleep(max(0.0, left + expiry_s + 1.0 - time.monotonic()))
    assert time.monotonic() < returned + expiry_s, "too slow to tell the two deadlines apart"
    assert not Mqtt(broker.port, "leaves", clean=False).session_present
    returning = Mqtt(broker.port, "returns", clean=False)
    assert returning.session_present
    returning.disconnect()
    returned = time.monotonic()
    time.sleep(expiry_s + 1.5)
    assert not Mqtt(broker.port, "returns", clean=False).session_present
