"""Queue quotas, the store bound and state GC end to end (issue 13 parts 3 and 4), over TCP against real
`ecq broker` processes with paho clients: what a producer and a consumer see, the metrics, the queue events."""

from __future__ import annotations

import time

import pyarrow.dataset as ds
import pytest

from ecq.events.schema import COLUMNS
from tests.harness import topics_payloads, wait_until, write
from tests.test_operations import ecq, scrape
from tests.test_rewind import admin_post, consume_and_leave, queue


def events_of(lake, kind: str) -> list[tuple]:
    if not any(lake.rglob("*.parquet")):
        return []
    rows = ds.dataset(lake, format="parquet", partitioning="hive").to_table(columns=list(COLUMNS)).to_pylist()
    return sorted((r["clientid"], r["seqno"], r["key"], r["reason"]) for r in rows if r["type"] == kind)


def refused(broker, reason: str) -> float:
    return scrape(broker).get(f"ecq_writes_refused_total{{reason={reason}}}", 0)


def test_drop_oldest_keeps_the_newest_entries_and_records_each_eviction(make_broker, connect, tmp_path):
    lake = tmp_path / "lake"
    broker = make_broker(max_queue_messages=3, lake_dir=str(lake), export_interval="200ms",
                         lake_file_age="200ms")
    producer = connect(broker.port, "producer")
    for number in range(1, 6):
        write(producer, "qa", f"k{number}", f"v{number}")
    write(producer, "qa", "k5", "v5 again")  # a rewrite of a stored key is not a new entry: nothing evicted
    assert queue(broker, "qa")["stored"] == 3
    assert scrape(broker)["ecq_quota_evictions_total"] == 2
    assert wait_until(lambda: len(events_of(lake, "evicted")) == 2, 10), events_of(lake, "evicted")
    assert events_of(lake, "evicted") == [("qa", 1, "k1", "quota"), ("qa", 2, "k2", "quota")]
    assert consume_and_leave(broker, connect, "qa", 3) == [("$ECQ/qa/k3", b"v3"), ("$ECQ/qa/k4", b"v4"),
                                                           ("$ECQ/qa/k5", b"v5 again")]


def test_an_online_consumer_is_not_sent_what_was_evicted_before_its_turn(make_broker, connect):
    broker = make_broker(max_queue_messages=2, reader_batch_size=1)
    consumer = connect(broker.port, "qo", manual_ack=True)
    assert consumer.subscribe("$ECQ/qo/#") == 1
    producer = connect(broker.port, "producer")
    for number in range(1, 6):
        write(producer, "qo", f"k{number}", f"v{number}")
    received = []
    for _ in range(3):  # a window of one: each PUBACK lets the next one out
        received += consumer.expect(1)  # k1 went out before the later writes evicted it
        consumer.ack(received[-1])
    assert topics_payloads(received) == [("$ECQ/qo/k1", b"v1"), ("$ECQ/qo/k4", b"v4"), ("$ECQ/qo/k5", b"v5")]
    assert consumer.quiet(0.5) == []


def test_refuse_acks_and_keeps_the_publisher_but_stores_nothing_over_the_quota(make_broker, connect):
    broker = make_broker(max_queue_bytes=10, quota_policy="refuse")
    producer = connect(broker.port, "producer")
    write(producer, "qr", "a", "aaaa")
    write(producer, "qr", "b", "bbbb")
    write(producer, "qr", "c", "cccc")  # 12 bytes: refused, still acknowledged
    write(producer, "qr", "a", "x")     # the same connection goes on; a smaller rewrite fits
    assert refused(broker, "quota_exceeded") == 1
    assert "quota_exceeded" in broker.log() and "quota_policy refuse" in broker.log()
    assert consume_and_leave(broker, connect, "qr", 2) == [("$ECQ/qr/b", b"bbbb"), ("$ECQ/qr/a", b"x")]
    assert scrape(broker).get("ecq_quota_evictions_total", 0) == 0


@pytest.mark.parametrize("backend_broker", ["leveldb", "jetstream"], indirect=True)
def test_a_full_store_refuses_writes_serves_reads_and_takes_writes_again_once_under(backend_broker, connect):
    broker = backend_broker(max_store_bytes=1000)
    producer = connect(broker.port, "producer")
    write(producer, "sf", "k1", b"1" * 400)
    write(producer, "sf", "k2", b"2" * 400)
    write(producer, "sf", "k3", b"3" * 400)  # over 1000 bytes: refused
    assert refused(broker, "store_full") == 1
    assert consume_and_leave(broker, connect, "sf", 2) == [("$ECQ/sf/k1", b"1" * 400), ("$ECQ/sf/k2", b"2" * 400)]
    write(producer, "sf", "k1", b"")  # a tombstone always fits, and its compaction frees k1's 400 bytes
    write(producer, "sf", "k3", b"3" * 400)
    assert refused(broker, "store_full") == 1
    assert queue(broker, "sf")["stored"] == 3


def test_gc_brings_a_full_store_under_its_bound(make_broker, connect):
    broker = make_broker(max_store_bytes=500, data_retention="2s", gc_interval="1h")
    producer = connect(broker.port, "producer")
    write(producer, "sg", "k1", b"1" * 400)
    write(producer, "sg", "k2", b"2" * 400)
    assert refused(broker, "store_full") == 1
    deleted = []
    assert wait_until(lambda: deleted.append(admin_post(broker, "/api/v1/gc")[1]["deleted"]) or sum(deleted), 10, 0.3)
    write(producer, "sg", "k2", b"2" * 400)
    assert refused(broker, "store_full") == 1
    assert queue(broker, "sg")["stored"] == 1


def test_queue_quotas_need_leveldb_and_a_bad_quota_is_refused_at_start(tmp_path):
    config = tmp_path / "broker.yaml"
    config.write_text("listeners: {default: {type: tcp, bind: '127.0.0.1:1'}}\nplugins:\n  ecq.broker.plugin.EcqPlugin:"
                      "\n    backend: jetstream\n    max_queue_messages: 10\n")
    result = ecq("broker", "-c", str(config))
    assert result.returncode == 2 and "max_queue_messages and max_queue_bytes need backend leveldb" in result.stderr
    config.write_text("listeners: {default: {type: tcp, bind: '127.0.0.1:1'}}\nplugins:\n  ecq.broker.plugin.EcqPlugin:"
                      "\n    quota_policy: drop_newest\n")
    result = ecq("broker", "-c", str(config))
    assert result.returncode == 2 and "quota_policy" in result.stderr


@pytest.mark.parametrize("backend_broker", ["leveldb", "jetstream"], indirect=True)
def test_state_gc_forgets_an_empty_idle_queue_and_it_starts_again(backend_broker, connect):
    broker = backend_broker(data_retention="1s", state_retention="1s", gc_interval="1h")
    producer = connect(broker.port, "producer")
    write(producer, "gone", "k", "old")
    write(producer, "kept", "k", "old")
    assert consume_and_leave(broker, connect, "gone", 1) == [("$ECQ/gone/k", b"old")]
    online = connect(broker.port, "kept")
    assert online.subscribe("$ECQ/kept/#") == 1
    assert topics_payloads(online.expect(1)) == [("$ECQ/kept/k", b"old")]
    acked = queue(broker, "gone")["acked"]

    def forgotten() -> bool:
        admin_post(broker, "/api/v1/gc")
        return scrape(broker).get("ecq_queues_forgotten_total", 0) >= 1
    assert wait_until(forgotten, 15, 0.3)
    assert ecq("inspect", "gone", admin=broker.admin_port).returncode == 1  # no queue for that clientid
    write(producer, "gone", "k", "new")
    if broker.options.get("backend") != "jetstream":
        assert queue(broker, "gone")["last_seqno"] == 1 < acked + 1  # starts again at seqno 1
    assert consume_and_leave(broker, connect, "gone", 1) == [("$ECQ/gone/k", b"new")]
    kept_idle_since = time.monotonic()  # "kept" has had no write nor ack since before this point
    assert wait_until(lambda: time.monotonic() - kept_idle_since > 2, 5)  # idle longer than state_retention
    admin_post(broker, "/api/v1/gc")  # "kept" is idle and empty too, but its consumer is online: its state stays
    online.close()
    if broker.options.get("backend") != "jetstream":
        broker.stop()
    store = broker.open_store()
    try:
        assert store.ack_state("kept").acked > 0
    finally:
        store.close()
