"""Persistent sessions survive a restart on the embedded LevelDB store (issue 32, point 4;
``ecq.broker.stored_sessions``), over TCP (the hand-over of an offline session to the store also over TLS and
WebSocket) against real ``ecq broker`` processes restarted on the same data dir, after
SIGTERM and after kill -9: a client reconnecting with CleanSession 0 (MQTT 5: Clean Start 0, Session Expiry > 0) gets
CONNACK session present 1, the QoS 1 messages of ordinary topics queued while it was offline (before the restart,
and after it before it came back) and its ECQ queue, all without SUBSCRIBE; an expired session, one a clean session
discarded and one of another username are not resumed. Where a test shows that something is NOT delivered, a
marker published after it must come first."""

from __future__ import annotations

import asyncio
import json
import re
import struct
import time

import pytest

from ecq.store.jsapi import token
from ecq.store.leveldb_sessions import LevelDbSessions
from tests.census_plugin import ANSWER as CENSUS_ANSWER, PLUGIN_PATH as CENSUS
from tests.harness import BrokerProcess, Client, RawClient, metrics_text, topics_payloads, wait_until, write
from tests.mqtt_wire import DISCONNECT_PACKET, connect_packet, puback_packet, subscribe_packet, unsubscribe_packet
from tests.test_cluster_state import kv_value, queued_while_offline, started, stored_count
from tests.test_max_connections import metric
from tests.test_mosquitto_clients import MosquittoSub, mosquitto_pub
from tests.test_mqtt5 import V5Client
from tests.test_mqtt_conformance import census
from tests.test_session_owners import (alice_as_bob_gets_nothing_of_his, authenticated, backend_of,  # noqa: F401
                                       bob_gets_his_queue_back, leave_bob_offline, passwd, persistent)
from tests.test_transports import certificate, every_transport, paho  # noqa: F401

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


@pytest.mark.timeout(60)
def test_mosquitto_sub_gets_what_was_queued_across_a_sigterm_restart_exactly_once(make_broker):
    """A real ``mosquitto_sub -c -i <id> -q 1`` (its defaults otherwise) away while one message is published before
    the broker's SIGTERM restart and one after it (``mosquitto_pub -q 1``): started again, it gets each exactly once,
    before what is published after its return. It subscribes again on every start (it cannot do otherwise), which
    brings nothing queued: what was published while it was away reaches it only through its resumed session, sent
    before the SUBACK of that new SUBSCRIBE."""
    broker = make_broker()
    device = MosquittoSub(broker.port, "meter7", "cmd/meter7/#", persistent=True)
    try:
        mosquitto_pub(broker.port, "cmd/meter7/a", "online")
        assert device.wait_messages(1) == ["cmd/meter7/a online q1"]
    finally:
        device.close()  # SIGTERM: mosquitto_sub sends DISCONNECT
    mosquitto_pub(broker.port, "cmd/meter7/b", "queued before the restart")
    broker = restart(broker, "sigterm")
    mosquitto_pub(broker.port, "cmd/meter7/c", "queued after the restart")
    device = MosquittoSub(broker.port, "meter7", "cmd/meter7/#", persistent=True)
    try:
        mosquitto_pub(broker.port, "cmd/meter7/d", "after its return")
        device.wait_messages(3)
        assert wait_until(lambda: "cmd/meter7/d after its return q1" in device.messages(), 10), device.lines
        assert device.messages() == ["cmd/meter7/b queued before the restart q1",
                                     "cmd/meter7/c queued after the restart q1", "cmd/meter7/d after its return q1"]
        # session present 1 (its -d line shows CONNACK's return code only): the queue came before the SUBACK
        assert device.lines.index("MSG cmd/meter7/c queued after the restart q1") < device.lines.index(
            "Client meter7 received SUBACK"), device.lines
    finally:
        device.close()
    assert "Traceback" not in broker.log()


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


def test_a_subscription_acknowledged_is_kept_across_kill9(make_broker):
    """Every SUBACK a persistent session got is kept by a broker killed right after it (``sync_writes``: each record
    fsynced, which holds a write behind the SUBACK long enough for the kill to land before it)."""
    broker = make_broker(sync_writes=True)
    count = 50
    devices = [RawClient(broker.port, f"s{i}", clean_session=False) for i in range(count)]
    for i, device in enumerate(devices):
        device.send_raw(subscribe_packet(1, (f"cmd/s{i}", 1)))
    assert all(device.receive()[0] == 0x90 for device in devices)
    broker.kill()
    for device in devices:
        device.close()
    store = broker.open_store()
    try:
        stored = {clientid: json.loads(record)["subscriptions"]
                  for clientid, record in LevelDbSessions(store).records()}
    finally:
        store.close()
    assert stored == {f"s{i}": [[f"cmd/s{i}", 1]] for i in range(count)}  # the record of each CONNACK, and its SUBACK


def test_a_message_queued_while_offline_is_kept_across_kill9_after_its_puback(make_broker, connect):
    """A PUBACK goes out once the message is queued for every offline session it matches: a broker killed right
    after it has the message in each one's stored queue (``sync_writes``: each fsynced, so that the fan-out to
    200 sessions takes long enough for the kill to land inside it were the PUBACK sent first)."""
    broker = make_broker(sync_writes=True)
    count = 200
    for i in range(count):
        device = RawClient(broker.port, f"f{i}", clean_session=False)
        assert device.subscribe(b"fleet/all")[0] == 0x90
        device.close()
    producer = connect(broker.port, "backend")
    producer.publish("fleet/all", b"to every device")
    broker.kill()
    store = broker.open_store()
    try:
        sessions = LevelDbSessions(store)
        assert [len(sessions.messages(f"f{i}")) for i in range(count)] == [1] * count
    finally:
        store.close()
    broker.start()
    device = Client(broker.port, f"f{count - 1}", clean_session=False)
    assert device.session_present
    assert received(device, 1) == [("fleet/all", b"to every device")]
    device.close()


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
    for clientid in ("van2", "van3"):
        device = session_client("3.1.1", broker.port, clientid)
        device.subscribe(f"cmd/{clientid}")
        device.close()
    broker = restart(broker, "kill9")
    clean = connect(broker.port, "van2")
    assert not clean.session_present
    clean.close()
    producer = connect(broker.port, "backend")
    producer.publish("cmd/van2", b"for nobody")
    producer.publish("cmd/van3", b"for van3")
    broker = restart(broker, "sigterm")
    kept = session_client("3.1.1", broker.port, "van3")
    assert kept.session_present  # the one no clean CONNECT discarded
    assert received(kept, 1) == [("cmd/van3", b"for van3")]
    kept.close()
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


def test_start_up_with_100000_stored_sessions(broker_process, connect):
    """Start-up reads the records, not amqtt Sessions: 100,000 sessions stored (as a broker writes them, through
    ecq.store.leveldb_sessions) are indexed in seconds, and any one of them is restored at its CONNECT."""
    broker = broker_process()
    count, offline_ms = 100_000, int(time.time() * 1000)
    store = broker.open_store()
    try:
        table = LevelDbSessions(store)
        for i in range(count):
            record = {"username": None, "subscriptions": [[f"cmd/m{i}/#", 1], [f"$ECQ/m{i}/#", 1]],
                      "expiry_s": None, "offline_ms": offline_ms}
            table.put(f"m{i}", json.dumps(record).encode())
    finally:
        store.close()
    began = time.monotonic()
    broker.start()
    line = re.findall(r"ECQ stored sessions: .*", broker.log())[-1]
    print(f"\nstart-up with {count} stored sessions: {time.monotonic() - began:.2f} s to accept; {line}")
    assert line.startswith(f"ECQ stored sessions: {count} to restore")
    producer = connect(broker.port, "backend")
    producer.publish("cmd/m77777/x", b"for m77777")
    device = Client(broker.port, "m77777", clean_session=False)
    try:
        assert device.session_present
        assert received(device, 1) == [("cmd/m77777/x", b"for m77777")]
    finally:
        device.close()


def test_on_a_cluster_a_session_survives_a_restart_of_every_node(cluster_nodes, connect, jetstream_options,
                                                                  nats_cluster):
    """The same adopt-on-CONNECT path, with the cluster's store: JetStream keeps the session while every ECQ node is
    killed and started again."""
    node1, node2 = started(cluster_nodes())
    device = connect(node1.port, "fleetcar", clean_session=False)
    device.subscribe("$ECQ/fleetcar/#")
    device.close()
    queued_while_offline(connect, node1, node2, "fleetcar", 2)  # and fleetcar/# subscribed in the same session
    namespace = jetstream_options["jetstream_namespace"]
    assert wait_until(lambda: b"fleetcar/#" in (asyncio.run(kv_value(nats_cluster.urls, f"{namespace}_sessions",
                                                                     token("fleetcar"))) or b""), 5, 0.1)
    assert wait_until(lambda: asyncio.run(stored_count(nats_cluster.urls, f"{namespace}_SESSIONS")) == 2, 5, 0.1)
    for node in (node1, node2):
        node.kill()
    started([node1, node2])
    write(connect(node1.port, "backend"), "fleetcar", "k", "queue entry")
    device = connect(node2.port, "fleetcar", clean_session=False)
    assert device.session_present
    assert sorted(received(device, 3)) == [("$ECQ/fleetcar/k", b"queue entry"), ("fleetcar/m", b"m0"),
                                           ("fleetcar/m", b"m1")]


# --- the reconnect storm (issue 32, point 6, at a modest size) ----------------------------------------------------

STORM = 2000
PORT_PROBE = "No data to decode MQTT packet fixed header"  # amqtt's line for the harness's check that the port accepts
STORM_BOUND_S = 60.0  # every device back with its pending entry (issue 32 asks 30 s at 19,800 on a quiet machine)


async def _packet(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The next packet of an asyncio stream: (first byte, body)."""
    first = (await reader.readexactly(1))[0]
    size, shift = 0, 0
    while True:
        byte = (await reader.readexactly(1))[0]
        size |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return first, await reader.readexactly(size)


async def _subscribe_and_leave(port: int, clientid: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(connect_packet(clientid, clean_session=False) + subscribe_packet(1, (f"$ECQ/{clientid}/#", 1)))
    assert (await _packet(reader))[0] == 0x20 and (await _packet(reader))[0] == 0x90
    writer.write(DISCONNECT_PACKET)
    await reader.read()  # the broker closes after DISCONNECT
    writer.close()


async def _come_back(port: int, clientid: str) -> tuple[bool, bytes]:
    """Reconnect ``clientid`` with CleanSession 0, acknowledge its first delivery: (session present, its topic)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(connect_packet(clientid, clean_session=False))
        first, connack = await _packet(reader)
        assert first == 0x20 and connack[1] == 0, connack
        first, publish = await _packet(reader)
        assert first & 0xF0 == 0x30, first
        size = struct.unpack_from(">H", publish)[0]
        writer.write(puback_packet(struct.unpack_from(">H", publish, 2 + size)[0]))
        await writer.drain()
        return bool(connack[0] & 1), publish[2:2 + size]
    finally:
        writer.close()


async def _all(work, port: int, clientids: list[str], at_once: int) -> list:
    gate = asyncio.Semaphore(at_once)

    async def one(clientid: str):
        async with gate:
            return await work(port, clientid)
    return await asyncio.wait_for(asyncio.gather(*(one(c) for c in clientids)), STORM_BOUND_S)


def test_a_reconnect_storm_after_a_restart_brings_every_consumer_back(broker_process, connect):
    broker = broker_process(max_open_files=STORM + 1000).start()
    clientids = [f"storm{i}" for i in range(STORM)]
    asyncio.run(_all(_subscribe_and_leave, broker.port, clientids, 100))
    producer = connect(broker.port, "backend")
    producer.publish_many([(f"$ECQ/w/{c}/pending", b"x") for c in clientids])
    producer.close()
    broker.kill()  # SIGTERM of 2,000 offline sessions is amqtt's quadratic stop (issue 32), not this test's subject
    broker.start()
    logged_before = len(broker.log())
    began = time.monotonic()
    back = asyncio.run(_all(_come_back, broker.port, clientids, STORM))
    took = time.monotonic() - began
    print(f"\nreconnect storm: {STORM} persistent consumers back with their pending entry in {took:.2f} s")
    assert back == [(True, f"$ECQ/{c}/pending".encode()) for c in clientids]
    assert took < STORM_BOUND_S
    problems = [line for line in broker.log()[logged_before:].splitlines() if (" ERROR " in line or "Traceback" in line)
                and PORT_PROBE not in line]
    assert problems == []


# --- offline sessions in the store while the broker runs (issue 32, point 1) --------------------------------------

def stored_only(broker: BrokerProcess) -> float:
    """``ecq_sessions_stored``: the offline persistent sessions the broker holds in its store only, not in memory."""
    return metric(broker, "ecq_sessions_stored")


def wait_stored_only(broker: BrokerProcess, count: int) -> None:
    assert wait_until(lambda: stored_only(broker) == count, 10, 0.05), metrics_text(broker)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_offline_session_lives_in_the_store_and_is_resumed_without_a_restart(make_broker, connect, protocol):
    broker = make_broker()
    device = session_client(protocol, broker.port, "car7")
    device.subscribe("cmd/car7/#", **({} if protocol == "3.1.1" else {"subscription_id": 7}))
    device.subscribe("$ECQ/car7/#")
    device.close()
    wait_stored_only(broker, 1)
    producer = connect(broker.port, "backend")
    producer.publish("cmd/car7/a", b"queued while offline")
    write(producer, "car7", "k1", "queue entry")
    device = session_client(protocol, broker.port, "car7")
    try:
        assert device.session_present
        messages = device.expect(2)
        assert sorted((m.topic, bytes(m.payload)) for m in messages) == [
            ("$ECQ/car7/k1", b"queue entry"), ("cmd/car7/a", b"queued while offline")]
        if protocol == "5":  # the subscription's options came back with it
            assert [m.properties.SubscriptionIdentifier for m in messages if m.topic.startswith("cmd/")] == [[7]]
        assert stored_only(broker) == 0  # amqtt holds it again
        producer.publish("cmd/car7/b", b"live")
        assert received(device, 1) == [("cmd/car7/b", b"live")]
    finally:
        device.close()
    assert "Traceback" not in broker.log()


def records_written(broker: BrokerProcess) -> float:
    """``ecq_session_records_written_total``: the persistent session records the broker wrote to its store."""
    return metric(broker, "ecq_session_records_written_total")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_resumed_consumer_subscribing_again_writes_its_record_once(make_broker, protocol):
    """A device resuming its stored session and subscribing to its queue again, as most clients do at each CONNECT,
    has its record written once: at the CONNACK (online again), not again at the SUBACK that changes nothing; a
    SUBSCRIBE of a filter held at the same QoS writes nothing, one of a new filter writes it before its SUBACK."""
    broker = make_broker()
    device = session_client(protocol, broker.port, "meter9")
    device.subscribe("$ECQ/meter9/#")
    device.close()
    wait_stored_only(broker, 1)
    before = records_written(broker)
    device = session_client(protocol, broker.port, "meter9")
    try:
        assert device.session_present
        device.subscribe("$ECQ/meter9/#")
        assert records_written(broker) == before + 1
        device.subscribe("$ECQ/meter9/#")
        assert records_written(broker) == before + 1
        device.subscribe("cmd/meter9/#")
        assert records_written(broker) == before + 2
    finally:
        device.close()


@pytest.mark.timeout(60)
def test_an_unsubscribe_of_no_filter_held_writes_no_record(make_broker):
    broker = make_broker()
    device = RawClient(broker.port, "meter10", clean_session=False)
    try:
        assert device.subscribe(b"$ECQ/meter10/#")[0] == 0x90
        before = records_written(broker)
        device.send_raw(unsubscribe_packet(2, "cmd/meter10/none"))
        assert device.receive()[0] == 0xB0
        assert records_written(broker) == before
        device.send_raw(unsubscribe_packet(3, "$ECQ/meter10/#"))
        assert device.receive()[0] == 0xB0
        assert records_written(broker) == before + 1
    finally:
        device.close()


def _publishes(device: RawClient, count: int) -> dict[bytes, tuple[int, bool]]:
    """The next ``count`` packets, QoS 1 PUBLISHes: topic -> (packet id, DUP)."""
    got = {}
    for _ in range(count):
        header, body = device.receive()
        assert header & 0xF6 == 0x32, header
        size = struct.unpack_from(">H", body)[0]
        got[body[2:2 + size]] = (struct.unpack_from(">H", body, 2 + size)[0], bool(header & 0x08))
    return got


def test_a_session_with_sends_in_flight_keeps_their_packet_ids_then_goes_to_the_store(make_broker, connect):
    """What was sent and not acknowledged comes again on the reconnect with DUP=1 and its packet id (MQTT 3.1.1
    section 4.4; the store, as a restart, keeps no packet ids): such a session stays in memory until they are
    acknowledged, then its next disconnect hands it to the store."""
    broker = make_broker()
    device = RawClient(broker.port, "inf1", clean_session=False)
    assert device.subscribe(b"cmd/inf1")[0] == 0x90 and device.subscribe(b"$ECQ/inf1/#", packet_id=2)[0] == 0x90
    producer = connect(broker.port, "backend")
    producer.publish("cmd/inf1", b"never acknowledged")
    write(producer, "inf1", "k", "queue entry")
    first = _publishes(device, 2)  # and no PUBACK
    device.close()
    device = RawClient(broker.port, "inf1", clean_session=False)
    again = _publishes(device, 2)
    assert again == {topic: (packet_id, True) for topic, (packet_id, _dup) in first.items()}
    assert stored_only(broker) == 0
    device.puback(*(packet_id for packet_id, _dup in again.values()))
    assert device.ping()  # the PUBACKs were read
    device.close()
    wait_stored_only(broker, 1)
    device = Client(broker.port, "inf1", clean_session=False)
    try:
        assert device.session_present
        producer.publish("cmd/inf1", b"marker")
        assert received(device, 1) == [("cmd/inf1", b"marker")]  # nothing acknowledged came again
    finally:
        device.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_session_in_the_store_is_resumed_only_by_its_owner(broker_process, passwd, protocol):
    broker = authenticated(broker_process(), passwd).start()
    backend = backend_of(broker.port)
    try:
        leave_bob_offline(protocol, broker.port, broker.port)
        wait_stored_only(broker, 1)
        write(backend, "bob", "secret", b"for bob only")
        alice_as_bob_gets_nothing_of_his(protocol, broker.port, backend)
        bob_gets_his_queue_back(protocol, broker.port)
    finally:
        backend.close()


def test_a_session_in_the_store_ends_at_its_expiry(broker_process, connect):
    broker = broker_process().start()
    device = session_client("5", broker.port, "exp1", expiry_s=2)
    device.subscribe("cmd/exp1")
    device.close()
    wait_stored_only(broker, 1)
    connect(broker.port, "backend").publish("cmd/exp1", b"queued, then expired")
    wait_stored_only(broker, 0)  # its deadline came on the broker's heap of offline sessions' deadlines
    assert broker.stop() == 0
    store = broker.open_store()
    try:
        sessions = LevelDbSessions(store)
        assert (sessions.get("exp1"), sessions.messages("exp1")) == (None, [])
    finally:
        store.close()
    broker.start()
    device = session_client("5", broker.port, "exp1")
    assert not device.session_present
    device.close()


def test_an_evicted_then_expired_session_leaves_no_deadline_behind(broker_with_plugin, connect):
    """Each offline session has one deadline, on one heap, wherever it lives: amqtt's copy of a session puts one there
    at its disconnect and the session store's, when the session is handed to it, replaces it. So an MQTT 5 session
    whose Session Expiry Interval (2 s) is shorter than ``session_expiry`` (2 h) is ended by the store at its own
    deadline and leaves no entry behind; with amqtt's heap beside the store's, amqtt's deadline of the evicted session
    stayed for 2 h. Sessions leaving, coming back and leaving again keep one live deadline each, stale entries
    bounded (``DeadlineHeap``: at most twice the live ones and 64)."""
    broker = broker_with_plugin(CENSUS)
    asker = connect(broker.port, "asker")
    assert asker.subscribe(CENSUS_ANSWER) == 1
    device = session_client("5", broker.port, "brief", expiry_s=2)
    device.subscribe("cmd/brief")
    device.close()
    wait_stored_only(broker, 1)
    assert census(asker, connected=1)["session_deadlines"]["live"] == 1
    wait_stored_only(broker, 0)
    assert census(asker, connected=1)["session_deadlines"] == {"live": 0, "entries": 0}

    devices = 50
    for _ in range(3):
        for i in range(devices):
            device = session_client("3.1.1", broker.port, f"d{i}")
            device.subscribe(f"cmd/d{i}")
            device.close()
    wait_stored_only(broker, devices)
    deadlines = census(asker, connected=1)["session_deadlines"]
    assert deadlines["live"] == devices and deadlines["entries"] <= 2 * devices + 64, deadlines


def test_offline_consumers_hold_no_amqtt_session(broker_with_plugin, connect):
    broker = broker_with_plugin(CENSUS)
    asker = connect(broker.port, "asker")
    assert asker.subscribe(CENSUS_ANSWER) == 1
    count = 20
    for i in range(count):
        device = Client(broker.port, f"c{i}", clean_session=False)
        assert device.subscribe(f"$ECQ/c{i}/#") == 1 and device.subscribe(f"cmd/c{i}") == 1
        device.close()
    wait_stored_only(broker, count)
    assert census(asker, connected=1)["referenced"]["sessions"] == 1  # the asker's


@pytest.mark.parametrize("qos", [1, 2])
def test_a_message_in_flight_at_sigterm_comes_again_after_the_restart(make_broker, connect, qos):
    """A message of an ordinary topic sent to a persistent session and not acknowledged when the broker stops (SIGTERM)
    is stored with the session and sent again after the restart (MQTT 3.1.1 section 4.4; the store keeps no packet
    ids, so as a new PUBLISH), as Mosquitto with persistence does; a QoS 2 one whose PUBREC came is released
    (PUBREL, the same packet id), never sent again (section 4.3.3)."""
    broker = make_broker()
    device = RawClient(broker.port, "inf2", clean_session=False)
    assert device.subscribe(b"cmd/#", qos=qos)[0] == 0x90
    producer = connect(broker.port, "backend")
    producer.publish("cmd/a", b"in flight", qos=qos)
    header, body = device.receive()  # and no PUBACK or PUBREC
    assert header & 0xF6 == 0x30 | qos << 1
    if qos == 2:
        producer.publish("cmd/b", b"received", qos=2)
        header, second = device.receive()
        released = second[2 + struct.unpack_from(">H", second)[0]:][:2]
        device.send(0x50, released)  # PUBREC: the client holds it now
        assert device.receive() == (0x62, released)  # the broker's PUBREL, left without PUBCOMP
    producer.close()
    assert broker.stop() == 0
    device.close()
    broker.start()
    device = RawClient(broker.port, "inf2", clean_session=False)
    packets = []
    for _ in range(qos):
        packets.append(device.receive())
        if qos == 2 and packets[-1] == (0x62, released):
            device.send(0x70, released)  # PUBCOMP, as a client must: amqtt holds the session's queue until it comes
    publishes = [body[2:2 + struct.unpack_from(">H", body)[0]] + body[4 + struct.unpack_from(">H", body)[0]:]
                 for header, body in packets if header & 0xF0 == 0x30]
    assert publishes == [b"cmd/a" + b"in flight"]
    if qos == 2:
        assert (0x62, released) in packets
    assert device.ping()  # nothing else came before the PINGRESP: "received" was not sent again
    device.close()


@pytest.mark.parametrize("transport", ["tls", "ws", "wss", "abrupt ws"])
def test_an_offline_session_goes_to_the_store_and_comes_back_over_every_transport(every_transport, paho, connect,
                                                                                  transport):
    """A persistent session whose connection ends, by DISCONNECT or by a dropped socket, over TLS or WebSocket is
    handed to the store as over TCP (issue 32: no live amqtt Session while offline; ``cluster`` module's
    ``hand_offline_sessions_to_the_store``), and its client resumes it over the same transport: session present,
    the ordinary QoS 1 message and the ECQ entry written meanwhile, then amqtt holds it again."""
    broker, ports = every_transport
    abrupt, transport = transport.startswith("abrupt"), transport.split()[-1]
    device = paho(transport, ports[transport], "car9", clean_session=False)
    assert device.subscribe("cmd/car9/#") == 1 and device.subscribe("$ECQ/car9/#") == 1
    device.close(clean=not abrupt)
    wait_stored_only(broker, 1)
    producer = connect(broker.port, "backend")
    producer.publish("cmd/car9/a", b"queued while offline")
    write(producer, "car9", "k1", "queue entry")
    device = paho(transport, ports[transport], "car9", clean_session=False)
    assert device.session_present
    assert sorted(topics_payloads(device.expect(2))) == [("$ECQ/car9/k1", b"queue entry"),
                                                         ("cmd/car9/a", b"queued while offline")]
    assert stored_only(broker) == 0


def _resumed(port: int, clientid: str) -> RawClient:
    device = RawClient(port, clientid, clean_session=False)
    assert device.session_present
    return device


def _resumed_after_kill9(broker, device: RawClient, connect, clientid: str, qos: int = 1) -> RawClient:
    """kill -9 of ``broker`` while ``device`` is connected, the restart, ``clientid``'s CleanSession 0 reconnect
    (session present 1), then a message ``newer`` published to ``cmd/<clientid>`` at ``qos``: the reconnected device."""
    broker.kill()
    device.close()
    broker.start()
    device = _resumed(broker.port, clientid)
    connect(broker.port, "backend2").publish(f"cmd/{clientid}", b"newer", qos=qos)
    return device


@pytest.mark.timeout(60)
def test_messages_sent_and_not_acknowledged_come_again_after_kill9(make_broker, connect):
    """A QoS 1 message of an ordinary topic sent to a connected persistent session is stored before its publisher's
    PUBACK and deleted at its subscriber's PUBACK (``amqtt_hooks.stored_sends``): after a kill -9 and the restart,
    the CleanSession 0 CONNECT gets session present 1 and those it did not acknowledge, in order, before a newer one
    (MQTT 3.1.1 sections 4.4, 4.6), and none it acknowledged."""
    broker = make_broker()
    device = RawClient(broker.port, "k1", clean_session=False)
    assert device.subscribe(b"cmd/#")[0] == 0x90
    producer = connect(broker.port, "backend")
    for i in range(6):
        producer.publish("cmd/k1", b"m%d" % i)
    sent = [device.receive_publish() for _ in range(6)]
    assert [payload for _topic, _packet_id, payload in sent] == [b"m%d" % i for i in range(6)]
    device.puback(*(packet_id for _topic, packet_id, _payload in sent[::2]))  # m0, m2, m4
    assert device.ping()  # the PUBACKs were decoded, their stored copies deleted
    device = _resumed_after_kill9(broker, device, connect, "k1")
    again = [device.receive_publish() for _ in range(4)]
    assert [payload for _topic, _packet_id, payload in again] == [b"m1", b"m3", b"m5", b"newer"]
    device.puback(*(packet_id for _topic, packet_id, _payload in again))
    assert device.ping()
    device.close()


@pytest.mark.timeout(60)
def test_a_resumed_queue_sent_and_not_acknowledged_comes_again_after_kill9(make_broker, connect):
    """The messages queued for an offline session stay stored while they are sent at its reconnect, each until its
    PUBACK: after a kill -9 the next reconnect gets the one not acknowledged, not the one acknowledged."""
    broker = make_broker()
    device = RawClient(broker.port, "k2", clean_session=False)
    assert device.subscribe(b"cmd/#")[0] == 0x90
    device.close()
    wait_stored_only(broker, 1)
    producer = connect(broker.port, "backend")
    producer.publish("cmd/k2", b"q0")
    producer.publish("cmd/k2", b"q1")
    device = _resumed(broker.port, "k2")
    sent = [device.receive_publish() for _ in range(2)]
    assert [payload for _topic, _packet_id, payload in sent] == [b"q0", b"q1"]
    device.puback(sent[0][1])
    assert device.ping()
    device = _resumed_after_kill9(broker, device, connect, "k2")
    again = [device.receive_publish() for _ in range(2)]
    assert [payload for _topic, _packet_id, payload in again] == [b"q1", b"newer"]
    device.close()


@pytest.mark.timeout(60)
def test_a_qos2_message_not_received_comes_again_after_kill9_a_completed_one_never(make_broker, connect):
    """At QoS 2 the stored copy is deleted at the PUBCOMP: after a kill -9 the message whose PUBREC never came is
    sent again (a new PUBLISH), the completed one is not."""
    broker = make_broker()
    device = RawClient(broker.port, "k3", clean_session=False)
    assert device.subscribe(b"cmd/#", qos=2)[0] == 0x90
    producer = connect(broker.port, "backend")
    producer.publish("cmd/k3", b"completed", qos=2)
    producer.publish("cmd/k3", b"not received", qos=2)
    header, body = device.receive()
    assert header & 0xF6 == 0x34 and body.endswith(b"completed")
    packet_id = body[8:10]  # after the 2-byte length and "cmd/k3"
    device.send(0x50, packet_id)  # PUBREC
    packets = [device.receive(), device.receive()]  # the PUBREL, and the second PUBLISH (no PUBREC for it)
    assert (0x62, packet_id) in packets
    assert [body.endswith(b"not received") for header, body in packets if header & 0xF6 == 0x34] == [True]
    device.send(0x70, packet_id)  # PUBCOMP
    assert device.ping()
    device = _resumed_after_kill9(broker, device, connect, "k3", qos=2)
    header, body = device.receive()
    assert header & 0xF6 == 0x34 and body.endswith(b"not received")
    device.close()
