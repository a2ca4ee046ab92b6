"""An SCQ's tombstones (issue 33, point 5): an empty write to ``$SCQ/w/<queue>/<key>`` is deleted once every
reader holding a position on the SCQ (a reader's or a group's) acked it, online or offline, and not before; a
position forgotten by state GC holds nothing back. Over TCP with paho against a real broker process, on both
storage backends; what is stored is read through the admin API (GET /api/v1/scq/<queue>, as `ecq inspect --scq`)."""

from __future__ import annotations

import time

import pytest

from tests.harness import topics_payloads, wait_until
from tests.test_operations import scrape
from tests.test_rewind import admin_post
from tests.test_scq import FILTER, Q, delivered, read_all, scq_write
from tests.test_top import api

ACKED_DELETIONS = "ecq_tombstones_removed_total{reason=tombstone_acked}"


def stored(broker) -> int:
    """Entries the running broker stores for the SCQ ``Q``."""
    return api(broker, f"/api/v1/scq/{Q}")["stored"]


def acked_deletions(broker) -> float:
    return scrape(broker).get(ACKED_DELETIONS, 0)


def settle(producer, reader, *keys: str) -> None:
    """Write ``keys`` one by one, each read (and acked) by ``reader`` before the next: a delivery follows the commit
    of the reader's earlier acks, so once the last comes, the first one's ack is stored, and so is any deletion it
    led to (submitted through the SCQ's writer agent before the ack saves that follow)."""
    for key in keys:
        scq_write(producer, key, key)
        assert topics_payloads(reader.expect(1)) == [delivered(key, key.encode())]


@pytest.mark.parametrize("second_reads", [FILTER, f"$share/workers/{FILTER}"], ids=["reader", "group"])
def test_a_tombstone_stays_until_the_last_reader_acks_it(backend_broker, connect, second_reads):
    """Two readers (the second a reader, or a group's one member: the group's position counts as a reader's): the
    first acks the tombstone, which stays stored; the second acks it, and it is deleted (counted as
    ``tombstone_acked``). Entries written after it stay."""
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    first = connect(broker.port, "first")
    second = connect(broker.port, "second", manual_ack=True)
    assert first.subscribe(FILTER) == 1
    assert second.subscribe(second_reads) == 1
    scq_write(producer, "a", b"1")
    assert topics_payloads(first.expect(1)) == [delivered("a", b"1")]
    second.ack(second.expect(1)[0])
    scq_write(producer, "a", b"")
    assert topics_payloads(first.expect(1)) == [delivered("a", b"")]
    tombstone = second.expect(1)[0]
    settle(producer, first, "b", "c")
    assert (stored(broker), acked_deletions(broker)) == (3, 0)
    second.ack(tombstone)
    assert wait_until(lambda: stored(broker) == 2, 10)
    assert acked_deletions(broker) == 1
    assert api(broker, f"/api/v1/scq/{Q}")["range"] == "[3,...,4]"  # b and c, written after it


def tombstone_read_online_after(broker, connect, producer, away: str):
    """Key ``a`` written, read and acked by the reader ``away``, which then goes away; then its tombstone, read and
    acked by a reader ``online``, which is returned."""
    scq_write(producer, "a", b"1")
    assert read_all(connect, broker.port, away, 1) == [delivered("a", b"1")]
    online = connect(broker.port, "online")
    assert online.subscribe(FILTER) == 1
    assert topics_payloads(online.expect(1)) == [delivered("a", b"1")]
    scq_write(producer, "a", b"")
    assert topics_payloads(online.expect(1)) == [delivered("a", b"")]
    return online


def test_an_offline_reader_holds_a_tombstone_until_it_comes_back_and_acks(backend_broker, connect):
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    online = tombstone_read_online_after(broker, connect, producer, "away")
    settle(producer, online, "b", "c")
    assert (stored(broker), acked_deletions(broker)) == (3, 0)
    assert read_all(connect, broker.port, "away", 3) == [delivered("a", b""), delivered("b", b"b"),
                                                          delivered("c", b"c")]
    assert wait_until(lambda: stored(broker) == 2, 10)
    assert acked_deletions(broker) == 1


def test_a_forgotten_position_holds_no_tombstone_back(backend_broker, connect):
    """A reader offline past ``state_retention`` loses its position (state GC); the tombstone it was holding back is
    then deleted as acked, without waiting for ``tombstone_retention``."""
    broker = backend_broker(state_retention="1s", gc_interval="1h")
    producer = connect(broker.port, "producer")
    online = tombstone_read_online_after(broker, connect, producer, "gone")
    idle_since = time.monotonic()
    settle(producer, online, "b")
    assert (stored(broker), acked_deletions(broker)) == (2, 0)
    assert wait_until(lambda: time.monotonic() - idle_since > 1.5, 5)

    def forgotten() -> bool:
        admin_post(broker, "/api/v1/gc")
        return scrape(broker).get("ecq_scq_positions_forgotten_total", 0) >= 1
    assert wait_until(forgotten, 15, 0.3)
    assert wait_until(lambda: stored(broker) == 1, 10)
    assert acked_deletions(broker) == 1
    assert read_all(connect, broker.port, "gone", 1) == [delivered("b", b"b")]


def test_on_a_cluster_the_last_reader_to_ack_deletes_the_tombstone_on_either_node(cluster_nodes, connect):
    """JetStream, two brokers: a reader on node 1 acks the tombstone, one on node 2 holds it (its position is stored
    and node 1 heard of it by notice); once that one acks, node 2 (which heard of node 1's reader's position the
    same way) or node 1 (hearing of that ack save) deletes it, whichever checks first."""
    node1, node2 = (node.start() for node in cluster_nodes())
    producer = connect(node1.port, "producer")
    near = connect(node1.port, "near")
    far = connect(node2.port, "far", manual_ack=True)
    for reader in (near, far):
        assert reader.subscribe(FILTER) == 1
    scq_write(producer, "a", b"1")
    assert topics_payloads(near.expect(1)) == [delivered("a", b"1")]
    far.ack(far.expect(1)[0])
    settle(producer, near, "x")
    held = far.expect(1)[0]
    assert wait_until(lambda: "far" in [row["reader"] for row in api(node1, f"/api/v1/top?scq={Q}")["queues"]], 15)
    scq_write(producer, "a", b"")
    assert topics_payloads(near.expect(1)) == [delivered("a", b"")]
    tombstone = far.expect(1)[0]
    settle(producer, near, "b", "c")
    assert (stored(node1), acked_deletions(node1), acked_deletions(node2)) == (4, 0, 0)
    far.ack(held)
    far.ack(tombstone)
    assert wait_until(lambda: stored(node1) == 3, 15)
    assert acked_deletions(node1) + acked_deletions(node2) == 1  # counted by the node whose delete succeeded
