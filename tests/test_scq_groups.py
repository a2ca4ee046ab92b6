"""SCQ shared reads (issue 33 point 3): ``$share/<group>/$SCQ/<queue>/#``, a group with one position whose entries
each go to one connected member; over TCP with paho (3.1.1 and MQTT 5) and mosquitto clients against a real broker
process on the LevelDB backend (a group's members on one broker of a JetStream cluster too); MQTT 5 members' Maximum
Packet Size and Subscription Identifiers."""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import threading
from collections import Counter

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.census_plugin import ANSWER as CENSUS_ANSWER, ASK as CENSUS_ASK, PLUGIN_PATH as CENSUS
from tests.harness import wait_until
from tests.test_mqtt5 import V5Client
from tests.test_operations import scrape
from tests.test_scq import FILTER, Q, delivered, read_all, scq_write
from tests.test_top import api

GROUP = f"$share/workers/{FILTER}"
SMALL_PACKET = 200  # an MQTT 5 member's Maximum Packet Size: the small entries fit, 600-byte ones do not
SKIPPED = "ecq_deliveries_skipped_total{reason=packet_too_large}"


def write_keys(producer, keys: list[str]) -> None:
    for key in keys:
        scq_write(producer, key, key.encode())


def keys_of(messages) -> list[str]:
    return [message.topic.rsplit("/", 1)[1] for message in messages]


def split_among(members, count: int, timeout: float = 10.0) -> list[list[str]]:
    """The keys each member received until ``count`` arrived among them all, and nothing more within 0.5 s."""
    got: list[list[str]] = [[] for _ in members]
    wait_until(lambda: sum(map(len, _take(members, got))) >= count, timeout)
    for member, keys in zip(members, got):
        keys.extend(keys_of(member.quiet(0.5)))
    return got


def _take(members, got: list[list[str]]) -> list[list[str]]:
    for member, keys in zip(members, got):
        while not member.messages.empty():
            keys.append(keys_of([member.messages.get_nowait()])[0])
    return got


def test_a_group_splits_the_compacted_queue_among_its_members(backend_broker, connect):
    """Written before anyone reads, compacted: the group's members together get the newest value of every key, each
    entry exactly once among them, each member its window (3) of the 9 while none acks; a write then goes to one
    member."""
    broker = backend_broker(reader_batch_size=3)
    producer = connect(broker.port, "producer")
    write_keys(producer, [f"k{i}" for i in range(9)])
    write_keys(producer, ["k0", "k1"])  # compaction: k0 and k1 now come after k8
    members = [connect(broker.port, f"worker-{i}", manual_ack=True) for i in range(3)]
    for member in members:
        assert member.subscribe(GROUP) == 1
    got = [member.expect(3) for member in members]
    assert sorted(keys_of(sum(got, []))) == sorted(f"k{i}" for i in range(9))
    for member, messages in zip(members, got):
        assert member.quiet(0.3) == []
        for message in messages:
            member.ack(message)
    scq_write(producer, "late", b"x")
    assert sum(split_among(members, 1), []) == ["late"]


def test_a_vanished_members_unacked_entries_go_to_another(backend_broker, connect):
    """A member that received entries and closed without acking them: another member gets them."""
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    holding = connect(broker.port, "holding", manual_ack=True)
    assert holding.subscribe(GROUP) == 1
    write_keys(producer, ["a", "b", "c"])
    assert keys_of(holding.expect(3)) == ["a", "b", "c"]
    other = connect(broker.port, "other")
    assert other.subscribe(GROUP) == 1
    assert other.quiet(0.5) == []  # the holding member keeps them while it is connected
    holding.close(clean=False)
    assert sorted(keys_of(other.expect(3))) == ["a", "b", "c"]
    assert other.quiet(0.5) == []


def test_the_group_keeps_its_position_while_no_member_is_connected(backend_broker, connect):
    """The last member leaves: later writes wait for the group; a member joining later gets only what the group has
    not acked (an unacked entry of the one that left, and the later writes)."""
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    first = connect(broker.port, "first", manual_ack=True)
    assert first.subscribe(GROUP) == 1
    write_keys(producer, ["a", "b"])
    got = first.expect(2)
    first.ack(got[0])
    first.close()  # a clean close sends the PUBACK of "a" before its DISCONNECT
    write_keys(producer, ["c"])
    later = connect(broker.port, "later")
    assert later.subscribe(GROUP) == 1
    assert keys_of(later.expect(2)) == ["b", "c"]
    assert later.quiet(0.5) == []


def test_unsubscribe_leaves_the_group(broker, connect):
    """The last member unsubscribes holding an unacked entry: a member joining then gets the next writes, and the
    unacked entry once the one that left is gone."""
    producer = connect(broker.port, "producer")
    leaving = connect(broker.port, "leaving", manual_ack=True)
    assert leaving.subscribe(GROUP) == 1
    write_keys(producer, ["a"])
    assert keys_of(leaving.expect(1)) == ["a"]
    unsubscribed = threading.Event()
    leaving._c.on_unsubscribe = lambda *_args: unsubscribed.set()
    leaving._c.unsubscribe(GROUP)
    assert unsubscribed.wait(10)
    joining = connect(broker.port, "joining")
    assert joining.subscribe(GROUP) == 1
    write_keys(producer, ["b"])
    assert keys_of(joining.expect(1)) == ["b"]
    assert leaving.quiet(0.3) == []
    leaving.close(clean=False)
    assert keys_of(joining.expect(1)) == ["a"]


def group_of(name: str) -> str:
    return f"$share/{name}/{FILTER}"


def unsubscribe(client, topic_filter: str) -> None:
    """UNSUBSCRIBE and wait for the UNSUBACK."""
    unsubscribed = threading.Event()
    client._c.on_unsubscribe = lambda *_args: unsubscribed.set()
    client._c.unsubscribe(topic_filter)
    assert unsubscribed.wait(10)


def kept(asker) -> dict[str, int]:
    """The census plugin's count of the ``Consumer`` and ``GroupDispatch`` objects the broker still references."""
    asker.publish(CENSUS_ASK, b"")
    referenced = json.loads(asker.expect(1)[0].payload)["referenced"]
    return {name: referenced[name] for name in ("consumers", "group_dispatches")}


def test_a_group_whose_members_all_left_is_forgotten(broker_with_plugin, connect):
    """Groups that come and go (one per job): the broker keeps nothing of a group whose members all left, once what
    was in flight to them ended and their acks are saved. The one member of ``job-done`` acked both entries and
    unsubscribed (it stays connected): nothing of the group stays. The one of ``job-quit`` acked one and closed: its
    consumer stays, with the count of its send of ``b`` (for its DUP) and the dispatch it was last attached to. A
    member joining either group later gets what the group did not ack (``b`` of job-quit, DUP=1) and the later
    write, nothing acked."""
    broker = broker_with_plugin(CENSUS)
    asker = connect(broker.port, "asker")
    assert asker.subscribe(CENSUS_ANSWER) == 1
    producer = connect(broker.port, "producer")
    write_keys(producer, ["a", "b"])
    done = connect(broker.port, "done")
    assert done.subscribe(group_of("job-done")) == 1
    assert keys_of(done.expect(2)) == ["a", "b"]
    unsubscribe(done, group_of("job-done"))
    assert wait_until(lambda: kept(asker) == {"consumers": 0, "group_dispatches": 0}, 10), kept(asker)
    quitting = connect(broker.port, "quitting", manual_ack=True)
    assert quitting.subscribe(group_of("job-quit")) == 1
    got = quitting.expect(2)
    quitting.ack(got[0])
    quitting.close()  # a clean close sends the PUBACK of "a" before its DISCONNECT
    assert wait_until(lambda: kept(asker) == {"consumers": 1, "group_dispatches": 1}, 10), kept(asker)

    write_keys(producer, ["c"])
    later_done = connect(broker.port, "later-done")
    assert later_done.subscribe(group_of("job-done")) == 1
    assert keys_of(later_done.expect(1)) == ["c"]
    later_quit = connect(broker.port, "later-quit")
    assert later_quit.subscribe(group_of("job-quit")) == 1
    resent, written = later_quit.expect(2)
    assert (keys_of([resent, written]), resent.dup, written.dup) == (["b", "c"], True, False)
    assert later_done.quiet(0.5) == [] and later_quit.quiet(0.1) == [] and done.quiet(0.1) == []


@pytest.mark.parametrize("joins", ["before_the_puback", "after_the_puback"])
def test_a_member_joins_while_the_one_that_left_holds_a_delivery(broker_with_plugin, connect, joins):
    """The last member unsubscribes holding an unacked entry and acks it after its UNSUBACK (MQTT 3.1.1 section
    3.10.4: it counts); a member joins before that PUBACK (the group is kept: its deliveries are in flight) or after
    it, once the group was forgotten: either way it gets the next write only, never the acked entry."""
    broker = broker_with_plugin(CENSUS)
    asker = connect(broker.port, "asker")
    assert asker.subscribe(CENSUS_ANSWER) == 1
    producer = connect(broker.port, "producer")
    leaving = connect(broker.port, "leaving", manual_ack=True)
    assert leaving.subscribe(GROUP) == 1
    write_keys(producer, ["a"])
    held = leaving.expect(1)
    unsubscribe(leaving, GROUP)
    joining = None
    if joins == "before_the_puback":
        joining = connect(broker.port, "joining")
        assert joining.subscribe(GROUP) == 1
        assert joining.quiet(0.3) == []  # "a" stays with the member that holds it
    leaving.ack(held[0])
    if joins == "after_the_puback":
        assert wait_until(lambda: kept(asker) == {"consumers": 0, "group_dispatches": 0}, 10), kept(asker)
        joining = connect(broker.port, "joining")
        assert joining.subscribe(GROUP) == 1
    write_keys(producer, ["b"])
    assert keys_of(joining.expect(1)) == ["b"]
    assert joining.quiet(0.5) == [] and leaving.quiet(0.1) == []
    leaving.close()
    assert joining.quiet(0.5) == []


def test_every_entry_in_flight_to_a_group_at_a_restart_comes_again_with_dup(make_broker, connect):
    """Three persistent members of a window of 2 each hold 6 entries unacked at SIGTERM: after the restart each of
    the 6 comes again with DUP=1 (MQTT 3.1.1 section 3.3.1.1: it might have been sent before), not only the first
    ``reader_batch_size`` of them; the entries stored before the restart that the group never had, and a write after
    it, come with DUP=0."""
    broker = make_broker(reader_batch_size=2)
    producer = connect(broker.port, "producer")
    write_keys(producer, [f"k{i}" for i in range(8)])
    members = [connect(broker.port, f"worker-{i}", clean_session=False, manual_ack=True) for i in range(3)]
    for member in members:
        assert member.subscribe(GROUP) == 1
    first = sum((member.expect(2) for member in members), [])
    assert sorted(keys_of(first)) == [f"k{i}" for i in range(6)] and not any(m.dup for m in first)
    for member in members:
        member.close(clean=False)
    producer.close()
    assert broker.stop() == 0
    broker.start()

    members = [connect(broker.port, f"worker-{i}", clean_session=False, manual_ack=True) for i in range(3)]
    again = [member.expect(2) for member in members]  # each member rejoins at its CONNECT
    resent = sum(again, [])
    assert sorted(keys_of(resent)) == [f"k{i}" for i in range(6)]
    assert all(message.dup for message in resent), [(m.topic, m.dup) for m in resent]
    for member, messages in zip(members, again):
        for message in messages:
            member.ack(message)
    never_sent = [(member, message) for member in members for message in member.quiet(0.5)]
    assert sorted(keys_of(m for _member, m in never_sent)) == ["k6", "k7"]
    assert not any(message.dup for _member, message in never_sent)
    for member, message in never_sent:
        member.ack(message)
    scq_write(connect(broker.port, "producer"), "k8", b"k8")
    after = sum((member.quiet(0.5) for member in members), [])
    assert [(m.topic, m.dup) for m in after] == [(f"$SCQ/{Q}/k8", False)]


def test_round_robin_alternates_between_equal_members(make_broker, connect):
    broker = make_broker(scq_dispatch="round_robin")
    producer = connect(broker.port, "producer")
    members = [connect(broker.port, f"worker-{i}") for i in range(2)]
    for member in members:
        assert member.subscribe(GROUP) == 1
    write_keys(producer, [f"k{i}" for i in range(4)])  # written one by one: each goes out alone
    assert split_among(members, 4) == [["k0", "k2"], ["k1", "k3"]]


def test_least_inflight_prefers_the_member_holding_fewer_unacked(make_broker, connect):
    """The holding member keeps 4 entries unacked (of its window of 5); the acking one holds at most the 3 written
    before the last, however late its PUBACKs reach the broker, so it has fewer in flight at every choice."""
    broker = make_broker(scq_dispatch="least_inflight")
    producer = connect(broker.port, "producer")
    holding = connect(broker.port, "holding", manual_ack=True)
    assert holding.subscribe(GROUP) == 1
    write_keys(producer, ["h0", "h1", "h2", "h3"])
    assert keys_of(holding.expect(4)) == ["h0", "h1", "h2", "h3"]
    acking = connect(broker.port, "acking")
    assert acking.subscribe(GROUP) == 1
    write_keys(producer, [f"k{i}" for i in range(4)])
    assert split_among([holding, acking], 4) == [[], ["k0", "k1", "k2", "k3"]]


def test_each_member_holds_a_window_of_its_own(make_broker, connect):
    """Members that ack nothing: each holds ``reader_batch_size`` (3) entries unacked, an MQTT 5 member its Receive
    Maximum (2) if lower; the group's window is the sum of theirs (8 of the 10 stored), not one window shared."""
    broker = make_broker(reader_batch_size=3)
    producer = connect(broker.port, "producer")
    write_keys(producer, [f"k{i}" for i in range(10)])
    members = [connect(broker.port, f"holding-{i}", manual_ack=True) for i in range(2)]
    received: queue.Queue = queue.Queue()
    v5 = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="holding-v5", protocol=mqtt.MQTTv5, manual_ack=True)
    v5.on_message = lambda _c, _u, m: received.put(m.topic.rsplit("/", 1)[1])
    connect_properties = Properties(PacketTypes.CONNECT)
    connect_properties.ReceiveMaximum = 2
    v5.connect("127.0.0.1", broker.port, properties=connect_properties)
    v5.loop_start()
    try:
        v5.subscribe(GROUP, qos=1)
        for member in members:
            assert member.subscribe(GROUP) == 1
        wait_until(lambda: received.qsize() == 2, 10)
        assert [len(keys) for keys in split_among(members, 6)] == [3, 3]
        assert received.qsize() == 2
    finally:
        v5.disconnect()
        v5.loop_stop()


def test_round_robin_gives_the_holding_member_its_turn(make_broker, connect):
    """The counterpart of the least_inflight test: round robin gives a member holding an unacked entry its turn."""
    broker = make_broker(scq_dispatch="round_robin")
    producer = connect(broker.port, "producer")
    holding = connect(broker.port, "holding", manual_ack=True)
    assert holding.subscribe(GROUP) == 1
    scq_write(producer, "held", b"x")
    assert keys_of(holding.expect(1)) == ["held"]
    acking = connect(broker.port, "acking")
    assert acking.subscribe(GROUP) == 1
    write_keys(producer, [f"k{i}" for i in range(4)])
    got = split_among([holding, acking], 4)
    assert got[0] and got[1], got


def test_random_spreads_over_the_members(make_broker, connect):
    broker = make_broker(scq_dispatch="random")
    producer = connect(broker.port, "producer")
    members = [connect(broker.port, f"worker-{i}") for i in range(2)]
    for member in members:
        assert member.subscribe(GROUP) == 1
    keys = [f"k{i}" for i in range(40)]
    producer.publish_many([(f"$SCQ/w/{Q}/{key}", key.encode()) for key in keys])
    got = split_among(members, 40)
    assert sorted(sum(got, [])) == sorted(keys)
    assert all(got) and got != [keys[0::2], keys[1::2]], got  # both served, not in strict turns (p = 2^-38)


@pytest.mark.parametrize("stop", ["sigterm", "kill"])
def test_restart_keeps_the_groups_position(make_broker, connect, stop):
    """SIGTERM and kill -9: the group resumes after what its members acked (their acks are saved through the queue's
    writer agent, ahead of the later write)."""
    broker = make_broker()
    producer = connect(broker.port, "producer")
    member = connect(broker.port, "worker")
    assert member.subscribe(GROUP) == 1
    write_keys(producer, ["a", "b"])
    assert keys_of(member.expect(2)) == ["a", "b"]
    member.close()
    write_keys(producer, ["c"])
    producer.close()
    if stop == "sigterm":
        assert broker.stop() == 0
    else:
        broker.kill()
    broker.start()
    again = connect(broker.port, "another-worker")
    assert again.subscribe(GROUP) == 1
    assert keys_of(again.expect(1)) == ["c"]
    assert again.quiet(0.5) == []


def test_a_group_and_a_reader_have_independent_positions(broker, connect):
    producer = connect(broker.port, "producer")
    write_keys(producer, ["a", "b"])
    member = connect(broker.port, "worker")
    assert member.subscribe(GROUP) == 1
    assert keys_of(member.expect(2)) == ["a", "b"]
    assert read_all(connect, broker.port, "worker", 2) == [delivered("a", b"a"), delivered("b", b"b")]
    other_group = connect(broker.port, "auditor")
    assert other_group.subscribe(f"$share/audit/{FILTER}") == 1
    assert keys_of(other_group.expect(2)) == ["a", "b"]


def test_persistent_member_rejoins_without_subscribing_again(broker, connect):
    producer = connect(broker.port, "producer")
    member = connect(broker.port, "worker", clean_session=False)
    assert member.subscribe(GROUP) == 1
    member.close()
    write_keys(producer, ["a"])
    resumed = connect(broker.port, "worker", clean_session=False)
    assert resumed.session_present
    assert keys_of(resumed.expect(1)) == ["a"]


def test_acl_decides_who_reads_a_group(make_broker, connect, tmp_path):
    """The ACL judges ``$share/<group>/$SCQ/<queue>/#`` by the filter it reads, ``$SCQ/<queue>/#`` (as EMQX)."""
    acl = tmp_path / "acl.conf"
    acl.write_text('{allow, {username, "worker"}, subscribe, ["$SCQ/fleet/#"]}.\n'
                   '{deny, all, subscribe, ["$SCQ/#"]}.\n{allow, all}.\n')
    broker = make_broker(acl_file=str(acl))
    assert connect(broker.port, "w1", username="worker").subscribe(GROUP) == 1
    assert connect(broker.port, "x1", username="stranger").subscribe(GROUP) == 0x80


def test_refusals(broker, connect):
    """QoS 0, a malformed SCQ filter, ``$share`` on ``$ECQ/``, and an SCQ read by a client id that would be a group's
    position, are refused."""
    client = connect(broker.port, "worker")
    assert client.subscribe(GROUP, qos=0) == 0x80
    assert client.subscribe(GROUP, qos=2) == 1
    assert client.subscribe(f"$share/workers/$SCQ/+/#") == 0x80
    assert client.subscribe("$share/workers/$ECQ/worker/#") == 0x80
    assert connect(broker.port, "$share/workers").subscribe(FILTER) == 0x80


def v5_member(port: int, clientid: str) -> tuple[mqtt.Client, queue.Queue, queue.Queue]:
    received: queue.Queue = queue.Queue()
    subacks: queue.Queue = queue.Queue()
    connected = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=clientid, protocol=mqtt.MQTTv5)
    client.on_connect = lambda *_args: connected.set()
    client.on_message = lambda _c, _u, m: received.put(m)
    client.on_subscribe = lambda _c, _u, _mid, codes, _p: subacks.put([c.value for c in codes])
    client.connect("127.0.0.1", port)
    client.loop_start()
    assert connected.wait(10)
    return client, received, subacks


def test_mqtt5_members_and_codes(make_broker, connect, tmp_path):
    """MQTT 5 members share a group as 3.1.1 ones do, get ``ecq-seqno``; the ACL's refusal is 0x87, ``$share`` on
    ``$ECQ/`` 0x9E."""
    acl = tmp_path / "acl.conf"
    acl.write_text('{deny, all, subscribe, ["$SCQ/secret/#"]}.\n{allow, all}.\n')
    broker = make_broker(acl_file=str(acl))
    producer = connect(broker.port, "producer")
    members = [v5_member(broker.port, f"v5-{i}") for i in range(2)]
    try:
        for client, _received, subacks in members:
            client.subscribe(GROUP, qos=1)
            assert subacks.get(timeout=10) == [1]
        write_keys(producer, ["a", "b"])
        got = [received.get(timeout=10) for _client, received, _subacks in members]
        assert sorted(m.topic for m in got) == [f"$SCQ/{Q}/a", f"$SCQ/{Q}/b"]
        assert all(dict(m.properties.UserProperty).get("ecq-seqno") for m in got)
        client, _received, subacks = members[0]
        client.subscribe("$share/g/$SCQ/secret/#", qos=1)
        assert subacks.get(timeout=10) == [0x87]
        client.subscribe("$share/g/$ECQ/v5-0/#", qos=1)
        assert subacks.get(timeout=10) == [0x9E]
    finally:
        for client, _received, _subacks in members:
            client.disconnect()
            client.loop_stop()


def test_a_member_never_gets_an_entry_above_its_maximum_packet_size(make_broker, connect):
    """MQTT-3.1.2-24 for a group: an entry above a member's Maximum Packet Size goes to a member that takes it; with
    none connected it is skipped for the group's position (counted, kept stored, later entries go on) and goes to the
    first member to join that takes it."""
    broker = make_broker(scq_dispatch="round_robin")
    producer = connect(broker.port, "producer")
    small = V5Client(broker.port, "small", MaximumPacketSize=SMALL_PACKET)
    large = None
    try:
        assert small.subscribe(GROUP) == [1]
        scq_write(producer, "k1", b"a")
        scq_write(producer, "big1", b"x" * 600)
        scq_write(producer, "k3", b"c")
        assert keys_of(small.expect(2)) == ["k1", "k3"]
        assert wait_until(lambda: scrape(broker).get(SKIPPED) == 1, 10)
        large = V5Client(broker.port, "large")
        assert large.subscribe(GROUP) == [1]
        assert [(m.topic, m.payload) for m in large.expect(1)] == [delivered("big1", b"x" * 600)]
        for i in range(4):  # round robin: the small member's turn comes for some of the big ones
            scq_write(producer, f"big{i + 2}", b"y" * 600)
        assert sorted(keys_of(large.expect(4))) == ["big2", "big3", "big4", "big5"]
        assert small.messages.empty() and large.messages.empty()
        assert wait_until(lambda: group_row(broker)["pending"] == 0, 10)  # the skipped entry acked by the large member
    finally:
        for client in filter(None, (small, large)):
            client.close()


def test_an_entry_whose_only_taker_left_before_its_send_is_skipped_until_one_joins(make_broker, connect):
    """The one member that takes a large entry holds its window full and leaves while the entry waits for it: the
    entry is skipped for the group (counted), not left waiting nor sent to the small member, which gets the holding
    member's unacked entry; the next member that takes it gets it."""
    broker = make_broker(reader_batch_size=1)
    producer = connect(broker.port, "producer")
    holding = connect(broker.port, "holding", manual_ack=True)
    assert holding.subscribe(GROUP) == 1
    scq_write(producer, "k1", b"a")
    assert keys_of(holding.expect(1)) == ["k1"]
    small = V5Client(broker.port, "small", MaximumPacketSize=SMALL_PACKET)
    large = None
    try:
        assert small.subscribe(GROUP) == [1]
        scq_write(producer, "big", b"x" * 600)
        assert wait_until(lambda: group_row(broker)["inflight"] == 2, 10)  # k1 held, big waiting for the holder
        holding.close(clean=False)
        assert keys_of(small.expect(1)) == ["k1"]
        assert wait_until(lambda: scrape(broker).get(SKIPPED) == 1, 10)
        large = V5Client(broker.port, "large")
        assert large.subscribe(GROUP) == [1]
        assert keys_of(large.expect(1)) == ["big"]
        assert small.messages.empty()
    finally:
        for client in filter(None, (small, large)):
            client.close()


def test_each_member_gets_the_subscription_identifier_of_its_subscription(broker, connect):
    """MQTT-3.3.4-3: a member's deliveries carry the Subscription Identifier its ``$share/...`` SUBSCRIBE gave,
    with ``ecq-seqno`` and ``ecq-ts`` as a plain reader's."""
    producer = connect(broker.port, "producer")
    members = [V5Client(broker.port, f"sid-{i}") for i in range(2)]
    try:
        for number, member in enumerate(members, 5):
            assert member.subscribe(GROUP, subscription_id=number) == [1]
        write_keys(producer, ["a", "b", "c", "d"])
        got = split_v5(members, 4)
        assert sorted(keys_of(m for messages in got for m in messages)) == ["a", "b", "c", "d"]
        for number, messages in enumerate(got, 5):
            assert messages and all(m.properties.SubscriptionIdentifier == [number] for m in messages), number
            assert all({"ecq-seqno", "ecq-ts"} <= dict(m.properties.UserProperty).keys() for m in messages)
    finally:
        for member in members:
            member.close()


def split_v5(members, count: int, timeout: float = 10.0) -> list[list]:
    """The messages each MQTT 5 member received until ``count`` arrived among them all."""
    got: list[list] = [[] for _ in members]

    def take() -> int:
        for member, messages in zip(members, got):
            while not member.messages.empty():
                messages.append(member.messages.get_nowait())
        return sum(map(len, got))

    assert wait_until(lambda: take() >= count, timeout), got
    return got


def group_row(broker) -> dict:
    """The group ``workers`` of the SCQ ``Q`` as the admin API shows it among the queue's readers."""
    return next(row for row in api(broker, f"/api/v1/scq/{Q}")["readers"] if row["reader"] == "$share/workers")


@pytest.mark.skipif(shutil.which("mosquitto_sub") is None or shutil.which("stdbuf") is None,
                    reason="mosquitto clients or stdbuf not installed")
def test_mosquitto_members(broker, connect):
    """Two mosquitto_sub members of one group (``$share`` is a plain filter to it): together they get each entry
    once, three each in turns (round robin; ``-C 3`` ends each, which flushes what it printed)."""
    producer = connect(broker.port, "producer")
    subs = [subprocess.Popen(["stdbuf", "-oL", "mosquitto_sub", "-d", "-p", str(broker.port), "-i", f"sub-{i}",
                              "-q", "1", "-t", GROUP, "-v", "-C", "3", "-W", "10"], stdout=subprocess.PIPE, text=True)
            for i in range(2)]
    for sub in subs:  # -d prints the SUBACK, a line at a time (stdbuf); -W ends mosquitto_sub: the read is bounded
        while "SUBACK" not in sub.stdout.readline():
            pass
    write_keys(producer, [f"k{i}" for i in range(6)])
    lines = [line for sub in subs for line in sub.communicate(timeout=15)[0].splitlines()
             if line.startswith("$SCQ/")]
    assert Counter(lines) == Counter(f"$SCQ/{Q}/k{i} k{i}" for i in range(6))
