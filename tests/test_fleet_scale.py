"""A fleet's sessions at a cost per client (issue 32, ``amqtt_hooks.fleet_scale``): a session's deletion takes its
own subscriptions only, offline sessions expire at their deadlines, and connects and a stop do not slow down with the
number of sessions already held. Against a real `ecq broker` process over TCP, MQTT 3.1.1."""

from __future__ import annotations

import asyncio
import os
import resource
import time

import pytest

from tests.mqtt_wire import connect_packet, subscribe_packet
from tests.test_mqtt_conformance import Mqtt

FLEET = 4000          # persistent consumers held by the scale test
SAMPLE = 1000         # consumers of its first and last CPU readings
SLOWDOWN_BOUND = 1.5  # last sample's broker CPU per connect over the first's; amqtt alone: about 2.5 at 4,000
STOP_BOUND_S = 8.0    # SIGTERM to exit with FLEET offline sessions; amqtt alone: about 15 s


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
    """``session_expiry`` counts from a session's last disconnect, in whole seconds as amqtt does: a session is
    forgotten within 1 s after it runs out (amqtt's monitor, once a second, took up to 2 s), and one that came back
    and left again runs from then."""
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

    time.sleep(max(0.0, left + expiry_s + 1.5 - time.monotonic()))
    assert time.monotonic() < returned + expiry_s, "too slow to tell the two deadlines apart"
    assert not Mqtt(broker.port, "leaves", clean=False).session_present
    returning = Mqtt(broker.port, "returns", clean=False)
    assert returning.session_present
    returning.disconnect()
    returned = time.monotonic()
    time.sleep(expiry_s + 1.5)
    assert not Mqtt(broker.port, "returns", clean=False).session_present


def test_connects_and_a_stop_cost_per_client_with_thousands_of_sessions(make_broker):
    """CPU per CONNECT + SUBSCRIBE of a persistent consumer stays flat from the first to the FLEET-th, and SIGTERM
    with FLEET offline sessions exits in seconds: amqtt 0.12.1 alone walked every topic filter of the broker on each
    CONNECT and on each session's deletion (issue 32: 1.2 ms to 6.4 ms per connect, stops of 24-64 s)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < FLEET + 200:
        pytest.skip(f"needs {FLEET + 200} file descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (FLEET + 200, hard))
    try:
        broker = make_broker(max_open_files=FLEET + 200)
        first, last = asyncio.run(asyncio.wait_for(_hold_a_fleet(broker), 240))
        assert last < first * SLOWDOWN_BOUND, f"CPU per connect {first:.2f} ms at first, {last:.2f} ms at {FLEET}"
        started = time.monotonic()
        assert broker.stop(timeout=120) == 0
        assert time.monotonic() - started < STOP_BOUND_S
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _hold_a_fleet(broker) -> tuple[float, float]:
    """Connect FLEET persistent consumers, each subscribing its own queue, 64 at a time; then disconnect them all.
    Returns the broker's CPU ms per consumer over the first SAMPLE and over the last SAMPLE."""
    connections, in_flight = [], asyncio.Semaphore(64)

    async def consumer(index: int) -> None:
        async with in_flight:
            reader, writer = await asyncio.open_connection("127.0.0.1", broker.port)
            writer.write(connect_packet(f"dev{index}", clean_session=False))
            assert (await reader.readexactly(4))[3] == 0
            writer.write(subscribe_packet(1, (f"$ECQ/dev{index}/#", 1)))
            assert (await reader.readexactly(5))[4] == 1
            connections.append(writer)

    async def cpu_ms_per_consumer(indexes: range) -> float:
        before = _cpu_ms(broker.proc.pid)
        await asyncio.gather(*(consumer(index) for index in indexes))
        return (_cpu_ms(broker.proc.pid) - before) / len(indexes)

    first = await cpu_ms_per_consumer(range(SAMPLE))
    await asyncio.gather(*(consumer(index) for index in range(SAMPLE, FLEET - SAMPLE)))
    last = await cpu_ms_per_consumer(range(FLEET - SAMPLE, FLEET))
    for writer in connections:
        writer.write(b"\xe0\x00")  # DISCONNECT
        writer.close()
    await asyncio.gather(*(writer.wait_closed() for writer in connections), return_exceptions=True)
    return first, last


def _cpu_ms(pid: int) -> float:
    """User + system CPU of process ``pid`` so far, ms (``/proc/<pid>/stat`` fields 14 and 15, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")
