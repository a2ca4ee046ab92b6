"""Tombstones, `ecq delete` and `ecq purge` end to end (issue 13 part 1), over TCP against real `ecq broker`
processes on both backends (LevelDB, JetStream), with paho and Debian's `mosquitto_pub -n` as clients; the
store is checked through the broker's own store (``BrokerProcess.open_store``).
"""

from __future__ import annotations

import subprocess
import time

from tests.harness import topics_payloads, wait_until, write
from tests.test_operations import ecq, scrape
from tests.test_rewind import admin_post, queue


def stored(broker, clientid: str) -> list[tuple[int, str, bytes]]:
    """(seqno, key, payload) of every stored entry of ``clientid``. LevelDB takes a lock: the broker is stopped
    first there, so call this last in a test."""
    if broker.options.get("backend") != "jetstream":
        broker.stop()
    store = broker.open_store()
    try:
        return [(m.seqno, m.key, m.payload) for m in store.read_after(clientid, 0, 1000)]
    finally:
        store.close()


def null_message(port: int, topic: str) -> None:
    """A QoS 1 PUBLISH with an empty payload from Debian's mosquitto_pub (``-n``: null message)."""
    subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), "-q", "1", "-t", topic, "-n"],
                   check=True, timeout=10)


def test_a_tombstone_is_delivered_once_as_an_empty_publish_and_deleted_on_its_puback(backend_broker, connect):
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    write(producer, "t1", "keep", "v")
    write(producer, "t1", "gone", "old")
    null_message(broker.port, "$ECQ/w/t1/gone")
    consumer = connect(broker.port, "t1", manual_ack=True)
    assert consumer.subscribe("$ECQ/t1/#") == 1
    keep, tombstone = consumer.expect(2)
    assert topics_payloads([keep, tombstone]) == [("$ECQ/t1/keep", b"v"), ("$ECQ/t1/gone", b"")]
    consumer.ack(keep)
    consumer.ack(tombstone)
    assert wait_until(lambda: queue(broker, "t1")["stored"] == 1, 5), queue(broker, "t1")
    assert consumer.quiet(0.5) == []
    metrics = scrape(broker)
    assert metrics["ecq_tombstones_written_total"] == 1
    assert metrics["ecq_tombstones_removed_total{reason=tombstone_acked}"] == 1
    consumer.close()
    assert [(key, payload) for _, key, payload in stored(broker, "t1")] == [("keep", b"v")]


def test_an_offline_consumer_gets_only_the_tombstone_of_a_key_written_then_deleted(backend_broker, connect):
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    write(producer, "t2", "k", "v1")
    write(producer, "t2", "k", "v2")
    write(producer, "t2", "k", b"")
    consumer = connect(broker.port, "t2")
    assert consumer.subscribe("$ECQ/t2/#") == 1
    assert topics_payloads(consumer.expect(1)) == [("$ECQ/t2/k", b"")]
    assert consumer.quiet(0.5) == []
    assert wait_until(lambda: queue(broker, "t2")["stored"] == 0, 5), queue(broker, "t2")
    consumer.close()
    assert stored(broker, "t2") == []


def test_gc_removes_a_tombstone_older_than_tombstone_retention_before_data_retention(backend_broker, connect):
    broker = backend_broker(tombstone_retention="1s", data_retention="1h", gc_interval="1h")
    producer = connect(broker.port, "producer")
    write(producer, "t3", "value", "stays")
    write(producer, "t3", "k", "v")
    write(producer, "t3", "k", b"")  # nobody acks it: only GC can remove it
    deleted = []
    assert wait_until(lambda: deleted.append(admin_post(broker, "/api/v1/gc")[1]["deleted"]) or sum(deleted), 10, 0.2)
    assert sum(deleted) == 1
    assert scrape(broker)["ecq_tombstones_removed_total{reason=tombstone_retention}"] == 1
    assert [(key, payload) for _, key, payload in stored(broker, "t3")] == [("value", b"stays")]


def test_with_tombstones_off_an_empty_payload_is_an_ordinary_value(backend_broker, connect):
    broker = backend_broker(tombstones=False, tombstone_retention="1s", gc_interval="1h")
    producer = connect(broker.port, "producer")
    write(producer, "t4", "k", b"")
    consumer = connect(broker.port, "t4")
    assert consumer.subscribe("$ECQ/t4/#") == 1
    assert topics_payloads(consumer.expect(1)) == [("$ECQ/t4/k", b"")]
    assert wait_until(lambda: queue(broker, "t4")["pending"] == 0, 5)
    time.sleep(1.1)  # ages the entry past tombstone_retention (no race: GC runs only when asked below)
    assert admin_post(broker, "/api/v1/gc") == (200, {"deleted": 0})
    assert queue(broker, "t4")["stored"] == 1
    status, answer = admin_post(broker, "/api/v1/queues/t4/delete?key=k")
    assert status == 409 and "tombstones: false" in answer["error"]
    refused = ecq("delete", "t4", "k", admin=broker.admin_port)
    assert refused.returncode != 0 and "tombstones: false" in refused.stderr
    consumer.close()
    assert stored(broker, "t4")[0][1:] == ("k", b"")


def test_ecq_delete_writes_a_tombstone_the_consumer_gets(backend_broker, connect):
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    write(producer, "t5", "k", "v")
    deleted = ecq("delete", "t5", "k", "--json", admin=broker.admin_port)
    assert deleted.returncode == 0, deleted.stderr
    assert '"key": "k"' in deleted.stdout
    status, answer = admin_post(broker, "/api/v1/queues/t5/delete?key=other")
    assert status == 200 and answer["key"] == "other" and answer["seqno"] > 0
    consumer = connect(broker.port, "t5")
    assert consumer.subscribe("$ECQ/t5/#") == 1
    assert topics_payloads(consumer.expect(2)) == [("$ECQ/t5/k", b""), ("$ECQ/t5/other", b"")]
    assert consumer.quiet(0.5) == []
    assert wait_until(lambda: queue(broker, "t5")["stored"] == 0, 5), queue(broker, "t5")
    assert scrape(broker)["ecq_tombstones_written_total"] == 2


def test_ecq_purge_deletes_every_entry_and_keeps_the_acked_position(backend_broker, connect):
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    for i in range(3):
        write(producer, "t6", f"k{i}", f"v{i}")
    consumer = connect(broker.port, "t6")
    assert consumer.subscribe("$ECQ/t6/#") == 1
    assert len(consumer.expect(3)) == 3
    assert wait_until(lambda: queue(broker, "t6")["pending"] == 0, 5)
    consumer.close()
    acked = queue(broker, "t6")["acked"]
    for i in range(3, 5):
        write(producer, "t6", f"k{i}", f"v{i}")  # not yet delivered: purged with the rest
    purged = ecq("purge", "t6", "--json", admin=broker.admin_port)
    assert purged.returncode == 0, purged.stderr
    assert '"purged": 5' in purged.stdout
    assert queue(broker, "t6")["stored"] == 0 and queue(broker, "t6")["acked"] == acked
    write(producer, "t6", "k0", "after")
    assert admin_post(broker, "/api/v1/queues/nobody/purge") == (200, {"clientid": "nobody", "purged": 0})
    consumer = connect(broker.port, "t6")
    assert consumer.subscribe("$ECQ/t6/#") == 1
    assert topics_payloads(consumer.expect(1)) == [("$ECQ/t6/k0", b"after")]
    assert consumer.quiet(0.5) == []
    assert scrape(broker)["ecq_purged_rows_total"] == 5


def test_ecq_delete_of_a_key_the_queue_does_not_store_exits_1_unless_forced(backend_broker, connect):
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    write(producer, "t7", "k", "v")
    typo = ecq("delete", "t7", "kk", admin=broker.admin_port)
    assert typo.returncode == 1 and typo.stdout == ""
    assert typo.stderr == ("the queue of 't7' stores no value of key 'kk' (never written, or deleted or expired "
                           "since): nothing deleted; --force writes the tombstone anyway\n")
    assert ecq("delete", "nobody", "k", admin=broker.admin_port).returncode == 1
    assert queue(broker, "t7")["last_seqno"] == 1  # nothing was written
    forced = ecq("delete", "t7", "kk", "--force", admin=broker.admin_port)
    assert forced.returncode == 0, forced.stderr
    assert ecq("delete", "t7", "k", admin=broker.admin_port).returncode == 0
    again = ecq("delete", "t7", "k", admin=broker.admin_port)  # only its tombstone is stored: deleted already
    assert again.returncode == 1 and "stores no value of key 'k'" in again.stderr
    consumer = connect(broker.port, "t7")
    assert consumer.subscribe("$ECQ/t7/#") == 1
    assert topics_payloads(consumer.expect(2)) == [("$ECQ/t7/kk", b""), ("$ECQ/t7/k", b"")]
    assert consumer.quiet(0.5) == []
