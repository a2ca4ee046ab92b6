"""MQTT 5.0 Message Expiry Interval on ``$ECQ/`` writes (issue 25, MQTT 5.0 section 3.3.2.3.3), over TCP against real
``ecq broker`` processes on both backends (LevelDB, and JetStream on a real 3-server NATS cluster): an entry whose
expiry passed is never delivered and GC deletes it, a delivery carries the interval left, a newer write of the key
replaces the entry and its expiry, the expiry outlives a restart."""

from __future__ import annotations

import json
import time
import urllib.request

import plyvel
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from ecq.store.leveldb import LevelDbStore
from ecq.store.leveldb_tables import EXPIRY, expiry_key
from ecq.store.protocol import Append, Expire, ExpiredRow
from tests.harness import wait_until
from tests.test_mqtt5 import WAIT_S, V5Client, stored


class ExpiringV5Client(V5Client):
    """V5Client whose QoS 1 PUBLISHes may carry a Message Expiry Interval."""

    def publish_expiring(self, topic: str, payload: str, expiry_s: int | None) -> float:
        """PUBLISH at QoS 1 with Message Expiry Interval ``expiry_s`` (None: none), wait for its PUBACK 0x00;
        returns the wall-clock time (s) it came: the broker stamped the write before."""
        properties = None
        if expiry_s is not None:
            properties = Properties(PacketTypes.PUBLISH)
            properties.MessageExpiryInterval = expiry_s
        info = self._c.publish(topic, payload, 1, properties=properties)
        assert wait_until(lambda: info.mid in self.acks, WAIT_S), f"no PUBACK for {topic!r}"
        assert self.acks[info.mid] == (0, None), self.acks[info.mid]
        return time.time()


@pytest.fixture
def v5x():
    """Factory: v5x(port, client_id, **kw) -> ExpiringV5Client; all are closed at teardown."""
    clients: list[ExpiringV5Client] = []

    def factory(*args, **kwargs) -> ExpiringV5Client:
        clients.append(ExpiringV5Client(*args, **kwargs))
        return clients[-1]

    yield factory
    for client in clients:
        client.close()


def wait_past(wall_time_s: float) -> None:
    """Return once the wall clock is past ``wall_time_s`` (an expiry is a wall-clock time: nothing to poll)."""
    time.sleep(max(0.0, wall_time_s + 0.2 - time.time()))


def run_gc(broker) -> int:
    """One GC pass through the admin API (as tests/test_gc.py does); how many entries it deleted."""
    request = urllib.request.Request(f"http://127.0.0.1:{broker.admin_port}/api/v1/gc", method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["deleted"]


def expiry_interval(message) -> int | None:
    return getattr(message.properties, "MessageExpiryInterval", None)


def received(consumer: V5Client, count: int) -> list[tuple[str, bytes, int | None]]:
    return [(m.topic, m.payload, expiry_interval(m)) for m in consumer.expect(count)]


def test_a_write_whose_expiry_passed_while_its_consumer_was_offline_is_not_delivered_and_gc_deletes_it(
        backend_broker, v5x):
    broker = backend_broker()
    producer = v5x(broker.port, "x-producer")
    acked = producer.publish_expiring("$ECQ/w/xq/short", "gone", 1)
    producer.publish_expiring("$ECQ/w/xq/kept", "here", None)
    wait_past(acked + 1)
    consumer = v5x(broker.port, "xq")
    assert consumer.subscribe("$ECQ/xq/#") == [1]
    # the expired entry has the lower seqno: had it been delivered, it would have come first
    assert received(consumer, 1) == [("$ECQ/xq/kept", b"here", None)]
    assert stored(broker, "xq") == 2  # delivery skipped it; GC has not run yet
    assert run_gc(broker) == 1
    assert stored(broker, "xq") == 1


def test_a_delivery_carries_the_expiry_interval_left(backend_broker, v5x, connect):
    broker = backend_broker()
    producer = v5x(broker.port, "x-producer")
    producer.publish_expiring("$ECQ/w/xd/a", "v5", 60)
    connect(broker.port, "x-producer-311").publish("$ECQ/w/xd/b", b"311")
    consumer = v5x(broker.port, "xd")
    assert consumer.subscribe("$ECQ/xd/#") == [1]
    (topic, payload, left), plain = received(consumer, 2)
    assert (topic, payload) == ("$ECQ/xd/a", b"v5") and 55 <= left <= 60, left
    assert plain == ("$ECQ/xd/b", b"311", None)  # a 3.1.1 write has no expiry
    producer.publish_expiring("$ECQ/w/xd/c", "online", 30)  # to a consumer online: from the commit or its notice
    assert received(consumer, 1) == [("$ECQ/xd/c", b"online", 30)]


def test_a_newer_write_of_the_key_replaces_the_entry_and_its_expiry(backend_broker, v5x):
    broker = backend_broker()
    producer = v5x(broker.port, "x-producer")
    producer.publish_expiring("$ECQ/w/xr/replaced", "old", 1)
    producer.publish_expiring("$ECQ/w/xr/kept", "expires", 1)
    producer.publish_expiring("$ECQ/w/xr/replaced", "new", None)
    producer.publish_expiring("$ECQ/w/xr/later", "old", None)
    acked = producer.publish_expiring("$ECQ/w/xr/later", "new", 1)
    producer.publish_expiring("$ECQ/w/xr/last", "marker", None)
    wait_past(acked + 1)
    consumer = v5x(broker.port, "xr")
    assert consumer.subscribe("$ECQ/xr/#") == [1]
    # in seqno order, the first delivery would be "kept" had its expiry been lost, the second "later" had the new
    # value not brought its own expiry
    assert received(consumer, 2) == [("$ECQ/xr/replaced", b"new", None), ("$ECQ/xr/last", b"marker", None)]
    assert run_gc(broker) == 2  # "kept" and "later"; "replaced"'s first value is gone with its expiry
    assert stored(broker, "xr") == 2


@pytest.mark.timeout(180)
def test_the_cluster_keeps_and_honours_the_expiry_across_nodes(cluster_nodes, v5x):
    first, second = [node.start() for node in cluster_nodes(2)]
    producer = v5x(first.port, "x-producer")
    acked = producer.publish_expiring("$ECQ/w/xc/short", "gone", 1)
    producer.publish_expiring("$ECQ/w/xc/long", "kept", 60)
    wait_past(acked + 1)
    consumer = v5x(second.port, "xc")
    assert consumer.subscribe("$ECQ/xc/#") == [1]
    ((topic, payload, left),) = received(consumer, 1)
    assert (topic, payload) == ("$ECQ/xc/long", b"kept") and 55 <= left <= 60, left
    producer.publish_expiring("$ECQ/w/xc/live", "realtime", 30)  # told to the second node by its notice
    assert received(consumer, 1) == [("$ECQ/xc/live", b"realtime", 30)]
    assert run_gc(second) == 1
    assert wait_until(lambda: stored(first, "xc") == 2 and stored(second, "xc") == 2, WAIT_S)


@pytest.mark.timeout(120)
def test_a_restart_keeps_the_expiry(make_broker, v5x):
    broker = make_broker()
    producer = v5x(broker.port, "x-producer")
    acked = producer.publish_expiring("$ECQ/w/xs/short", "gone", 2)
    producer.publish_expiring("$ECQ/w/xs/long", "kept", 60)
    producer.close()
    assert broker.stop() == 0
    broker.start()
    wait_past(acked + 2)
    consumer = v5x(broker.port, "xs")
    assert consumer.subscribe("$ECQ/xs/#") == [1]
    ((topic, payload, left),) = received(consumer, 1)
    assert (topic, payload) == ("$ECQ/xs/long", b"kept") and 30 <= left <= 58, left  # waited over 2 s
    assert run_gc(broker) == 1
    assert stored(broker, "xs") == 1


def test_an_entry_s_expiry_row_goes_with_the_entry_in_leveldb(tmp_path):
    """The LevelDB expiry table (ecq.store.leveldb_tables) holds a row only for each stored entry with an expiry:
    compaction (in another batch and in the same one) and a deletion take the entry's row with it, or GC's scan of
    the table would grow with every rewrite."""
    store = LevelDbStore(tmp_path / "queues")
    store.commit([Append("q", "rewritten", b"old", 1_000, 5_000)])
    store.commit([Append("q", "rewritten", b"new", 1_001), Append("q", "twice", b"a", 1_002, 6_000),
                  Append("q", "twice", b"b", 1_003, 7_000), Append("q", "deleted", b"x", 1_004, 8_000)])
    store.commit([Expire("q", (ExpiredRow(5, "deleted", 1_004, 1),), "purge")])
    assert store.lapsed_step(10_000, 100) == ({"q": [ExpiredRow(4, "twice", 1_003, 1)]}, None)
    store.close()
    db = plyvel.DB(str(tmp_path / "queues"))
    try:
        assert list(db.iterator(prefix=EXPIRY, include_value=False)) == [expiry_key(7_000, "q", 4)]
    finally:
        db.close()
