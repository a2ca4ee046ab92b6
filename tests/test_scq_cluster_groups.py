"""SCQ shared groups across the brokers of a cluster (issue 33 point 7): a group's members on two ECQ nodes of one
local NATS JetStream cluster share its position, served by the node holding the group's lease
(ecq.broker.group_leases); paho 3.1.1 clients over TCP."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from ecq.queue.groups import group_position_id
from ecq.store.jsapi import token
from tests.harness import wait_until
from tests.test_scq import Q, scq_write
from tests.test_scq_groups import GROUP, keys_of, write_keys

LEASE_S = 3.0  # scq_group_lease in the kill test: the other node takes the group within it (plus a margin)


def received_keys(members, count: int, timeout: float = 20.0) -> Counter:
    """How many times each key reached the members together, once ``count`` arrived and nothing more in 1 s."""
    got: Counter = Counter()

    def take() -> int:
        for member in members:
            while not member.messages.empty():
                got.update(keys_of([member.messages.get_nowait()]))
        return sum(got.values())
    assert wait_until(lambda: take() >= count, timeout), f"only {sum(got.values())} of {count} arrived"
    for member in members:
        got.update(keys_of(member.quiet(1.0 if member is members[0] else 0)))
    return got


def holder_with_unacked(connect, node, producer):
    """A member on ``node`` that got a..c of a..f with a window of 3, acked a and b and holds c, d and e unacked:
    d and e came only once the ack save of a and b was stored (ecq.queue.delivery sends nothing before)."""
    write_keys(producer, list("abcdef"))
    holding = connect(node.port, "holding", manual_ack=True)
    assert holding.subscribe(GROUP) == 1
    first = holding.expect(3, timeout=20)
    assert keys_of(first) == ["a", "b", "c"]
    holding.ack(first[0])
    holding.ack(first[1])
    assert keys_of(holding.expect(2, timeout=10)) == ["d", "e"]
    return holding


def test_each_entry_reaches_one_member_of_the_whole_group(cluster_nodes, connect):
    """Members on both nodes: every entry of a backlog and of later writes reaches exactly one member of the group
    (without the lease, each node's members formed a group of their own: every entry once per node)."""
    node1, node2 = (node.start() for node in cluster_nodes(reader_batch_size=3))
    producer = connect(node1.port, "producer")
    backlog = [f"b{i}" for i in range(30)]
    write_keys(producer, backlog)
    members = [connect(node1.port, "near-1"), connect(node2.port, "far"), connect(node1.port, "near-2")]
    for member in members:
        assert member.subscribe(GROUP) == 1
    later = [f"l{i}" for i in range(20)]
    write_keys(connect(node2.port, "producer-2"), later)
    got = received_keys(members, len(backlog) + len(later))
    assert got == Counter(backlog + later), {key: n for key, n in got.items() if n != 1}


def test_the_other_node_takes_over_when_the_holding_nodes_members_leave(cluster_nodes, connect):
    """The member on the node serving the group disconnects holding unacked entries: the member on the other node,
    sent nothing until then, gets them and the rest, never what was acked."""
    node1, node2 = (node.start() for node in cluster_nodes(reader_batch_size=3))
    producer = connect(node1.port, "producer")
    holding = holder_with_unacked(connect, node1, producer)
    standby = connect(node2.port, "standby")
    assert standby.subscribe(GROUP) == 1
    assert standby.quiet(1.0) == []  # a standby: its node does not hold the group's lease
    holding.close(clean=False)
    assert sorted(keys_of(standby.expect(3, timeout=10))) == ["c", "d", "e"]
    assert keys_of(standby.expect(1, timeout=10)) == ["f"]
    scq_write(producer, "g", b"g")
    assert keys_of(standby.expect(1, timeout=10)) == ["g"]
    assert standby.quiet(0.5) == []


def test_a_killed_holders_group_goes_to_the_other_node_within_the_lease(cluster_nodes, connect):
    """The node serving the group is killed (kill -9): within the lease time plus a margin the member on the other
    node gets what was not acked and the rest; nothing acked comes again."""
    node1, node2 = (node.start() for node in cluster_nodes(reader_batch_size=3, scq_group_lease=f"{LEASE_S}s"))
    holding = holder_with_unacked(connect, node1, connect(node2.port, "producer"))
    standby = connect(node2.port, "standby")
    assert standby.subscribe(GROUP) == 1
    assert standby.quiet(0.5) == []
    killed = time.monotonic()
    node1.kill()
    got = standby.expect(4, timeout=LEASE_S + 5)
    elapsed = time.monotonic() - killed
    assert sorted(keys_of(got)) == ["c", "d", "e", "f"]
    assert elapsed < LEASE_S + 5
    assert standby.quiet(0.5) == []
    holding.close(clean=False)


def test_a_stopping_holder_hands_the_group_over_at_once(cluster_nodes, connect):
    """The node serving the group stops (SIGTERM) with a lease of a minute: it hands the lease back once its acks
    are saved, so the member on the other node gets the rest well within the lease; nothing acked comes again."""
    node1, node2 = (node.start() for node in cluster_nodes(reader_batch_size=3, scq_group_lease="60s"))
    holding = holder_with_unacked(connect, node1, connect(node2.port, "producer"))
    standby = connect(node2.port, "standby")
    assert standby.subscribe(GROUP) == 1
    assert standby.quiet(0.5) == []
    assert node1.stop() == 0
    assert sorted(keys_of(standby.expect(4, timeout=15))) == ["c", "d", "e", "f"]
    assert standby.quiet(0.5) == []
    holding.close(clean=False)


def test_the_holders_last_member_unsubscribing_hands_the_group_over(cluster_nodes, connect):
    """The holding node's last member unsubscribes with a delivery in flight: its PUBACK still counts (MQTT 3.1.1
    section 3.10.4) and the group stays on that node until then; then the member on the other node gets the rest."""
    node1, node2 = (node.start() for node in cluster_nodes(scq_group_lease=f"{LEASE_S}s"))
    producer = connect(node1.port, "producer")
    leaving = connect(node1.port, "leaving", manual_ack=True)
    assert leaving.subscribe(GROUP) == 1
    scq_write(producer, "a", b"a")
    in_flight = leaving.expect(1, timeout=10)
    standby = connect(node2.port, "standby")
    assert standby.subscribe(GROUP) == 1
    unsubscribed = threading.Event()
    leaving._c.on_unsubscribe = lambda *_args: unsubscribed.set()
    leaving._c.unsubscribe(GROUP)
    assert unsubscribed.wait(10)
    scq_write(producer, "b", b"b")
    assert standby.quiet(0.5) == []  # node-1 holds the group while "a" is in flight
    leaving.ack(in_flight[0])
    assert keys_of(standby.expect(1, timeout=LEASE_S + 5)) == ["b"]
    assert standby.quiet(0.5) == []

def test_a_holder_whose_renewal_is_refused_stops_at_once(cluster_nodes, connect):
    """Another party takes the lease over (a KV put: the holder's next renewal, expecting its revision, is refused):
    the holder stops serving the group at once, and the group is served again once that lease lapses unrenewed."""
    (node1,) = (node.start() for node in cluster_nodes(1, scq_group_lease=f"{LEASE_S}s"))
    producer = connect(node1.port, "producer")
    member = connect(node1.port, "member")
    assert member.subscribe(GROUP) == 1
    scq_write(producer, "a", b"a")
    assert keys_of(member.expect(1, timeout=10)) == ["a"]  # node-1 serves the group
    asyncio.run(put_lease(node1.options, b"intruder"))
    assert wait_until(lambda: "lost the lease of SCQ group" in node1.log(), LEASE_S + 2)
    scq_write(producer, "b", b"b")
    assert member.quiet(1.0) == []  # not served: node-1's consumer is detached
    assert keys_of(member.expect(1, timeout=LEASE_S + 5)) == ["b"]  # the intruder's lease lapsed: node-1 took it


async def put_lease(options: dict, holder: bytes) -> None:
    """Overwrite the lease of the group ``workers`` of the SCQ ``Q`` in the brokers' bucket, as another broker."""
    import nats
    client = await nats.connect(options["nats_servers"], connect_timeout=2)
    try:
        kv = await client.jetstream(timeout=10).key_value(f"{options['jetstream_namespace']}_group_leases")
        await kv.put(token(group_position_id(f"$SCQ/{Q}", "workers")), holder)
    finally:
        await client.close()
