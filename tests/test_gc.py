"""Garbage collection (by age; it must not starve delivery; one ``expired`` event per deleted row): the store's steps, the pacing, and a whole pass through a live broker."""

from __future__ import annotations

import json
import time
import urllib.request

import pyarrow.dataset as ds
import pytest

from ecq.events.schema import COLUMNS
from ecq.queue.gc import GcPacer
from ecq.store.leveldb import LevelDbStore as Store
from ecq.store.protocol import Append, Expire
from tests.harness import BrokerProcess, wait_until

HOUR_MS = 3_600_000


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "db")
    yield s
    s.close()


def expired_and_fresh(queues: int, now_ms: int) -> tuple[list[Append], list[Append]]:
    """Queue ``q<n>`` gets 1 + n % 7 entries published two hours ago, and every third queue one fresh
    entry after them (fresh entries are always the newest of their queue: seqno order is time order)."""
    old = [Append(f"q{n}", f"k{i}", b"x" * (1 + i), now_ms - 2 * HOUR_MS + i) for n in range(queues)
           for i in range(1 + n % 7)]
    fresh = [Append(f"q{n}", "new", b"fresh", now_ms) for n in range(0, queues, 3)]
    return old, fresh


def test_small_steps_delete_every_expired_entry_of_many_queues_once_and_keep_fresh_tails(store):
    now = int(time.time() * 1000)
    old, fresh = expired_and_fresh(300, now)
    store.commit(old)
    store.commit(fresh)
    seen, cursor, steps = [], None, 0
    while True:
        found, cursor = store.expired_step(now - HOUR_MS, 64, cursor)
        assert sum(len(rows) for rows in found.values()) <= 64
        seen += [(cid, row.key) for cid, rows in found.items() for row in rows]
        deleted = store.commit([Expire(cid, tuple(rows)) for cid, rows in found.items()])
        assert deleted == [tuple(rows) for rows in found.values()]
        steps += 1
        if cursor is None:
            break
    assert sorted(seen) == sorted((a.clientid, a.key) for a in old)  # each once
    assert steps >= len(old) // 64
    assert store.stored_totals() == (len(fresh), len(fresh) * len(b"fresh"))
    assert [m.key for m in store.read_after("q3", 0, 10)] == ["new"]
    assert store.queue_range("q1") is None


def test_an_entry_rewritten_after_gc_read_it_is_counted_once_as_compacted_not_expired(store):
    store.commit([Append("c", "k", b"old", 100), Append("c", "other", b"o", 100)])
    found, _ = store.expired_step(cutoff_ms=200, limit=10)
    rows = tuple(found["c"])
    appended, = store.commit([Append("c", "k", b"new", 300)])  # replaces seqno 1 before GC deletes it
    assert appended.replaced == (1,)
    assert store.commit([Expire("c", rows)]) == [rows[1:]]  # only "other" was still stored
    assert store.stored_totals() == (1, 3)


def test_expire_and_append_of_one_key_in_one_batch_delete_the_old_entry_once(store):
    store.commit([Append("c", "k", b"old", 100)])
    found, _ = store.expired_step(cutoff_ms=200, limit=10)
    expire = Expire("c", tuple(found["c"]))
    gone, appended = store.commit([expire, Append("c", "k", b"new", 300)])
    assert (gone, appended.replaced, appended.replaced_bytes) == (expire.rows, (), 0)
    appended, gone = store.commit([Append("c", "k", b"newer", 400), Expire("c", (found["c"][0]._replace(seqno=2),))])
    assert (appended.replaced, gone) == ((2,), ())
    assert store.stored_totals() == (1, 5)


def test_pacer_keeps_steps_short_and_pauses_in_proportion():
    pacer = GcPacer(target_s=0.005, min_duty=0.25, max_duty=0.25, min_rows=16, max_rows=512, max_pause_s=0.5)
    assert pacer.rows == 16
    for _ in range(10):  # fast steps grow up to max_rows
        pacer.pause_after(0.001)
    assert pacer.rows == 512
    assert pacer.pause_after(0.004) == pytest.approx(0.012)  # busy 25 % of the time
    assert pacer.rows == 512
    for _ in range(10):  # slow steps (a busy broker) shrink down to min_rows
        pacer.pause_after(0.02)
    assert pacer.rows == 16
    assert pacer.pause_after(10.0) == 0.5  # bounded, so a shutdown never waits long


def test_pacer_runs_at_max_duty_on_an_idle_broker_and_min_duty_while_it_serves_traffic():
    pacer = GcPacer(min_duty=0.1, max_duty=0.5, quiet_s=1.0)
    pacer.note_traffic(7, now=100.0)
    assert pacer.duty == 0.5  # nothing seen yet: idle
    pacer.note_traffic(7, now=100.5)
    assert pacer.duty == 0.5
    pacer.note_traffic(9, now=101.0)  # appends or PUBACKs since the last step
    assert pacer.duty == 0.1
    assert pacer.pause_after(0.004) == pytest.approx(0.036)
    pacer.note_traffic(9, now=101.9)
    assert pacer.duty == 0.1
    pacer.note_traffic(9, now=102.0)  # quiet for quiet_s
    assert pacer.duty == 0.5


@pytest.mark.timeout(120)
def test_a_pass_deletes_every_expired_entry_and_records_one_expired_event_per_row(tmp_path):
    lake = tmp_path / "lake"
    broker = BrokerProcess(tmp_path, data_retention="1h", gc_interval="1h", lake_dir=str(lake),
                           export_interval="200ms", lake_file_age="200ms")
    now = int(time.time() * 1000)
    old, fresh = expired_and_fresh(2000, now)  # 8,000 expired entries: many GC steps
    store = Store(broker.queues_dir)
    store.commit(old)
    store.commit(fresh)
    store.close()
    broker.start()
    try:
        assert wait_until(lambda: _admin(broker, "GET", "/api/v1/health").get("status") == "ok", 10)
        assert _admin(broker, "POST", "/api/v1/gc") == {"deleted": len(old)}
        assert _admin(broker, "GET", "/api/v1/status")["messages"] == len(fresh)
        metrics = _metrics(broker)
        assert metrics["ecq_gc_deleted_rows_total"] == len(old) and metrics["ecq_gc_runs_total"] == 1
        assert wait_until(lambda: len(_expired_events(lake)) == len(old), 30)
    finally:
        assert broker.stop(timeout=20) == 0
    events = _expired_events(lake)
    assert sorted((e["clientid"], e["key"], e["seqno"]) for e in events) == sorted(
        (a.clientid, a.key, 1 + int(a.key[1:])) for a in old)  # each expired row exactly once
    assert {e["publish_ts_ms"] for e in events} == {a.ts_ms for a in old}


def _admin(broker: BrokerProcess, method: str, path: str) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{broker.admin_port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)
    except OSError:
        return {}


def _metrics(broker: BrokerProcess) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.admin_port}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if line and not line.startswith("#")}


def _expired_events(lake) -> list[dict]:
    if not any(lake.rglob("*.parquet")):
        return []
    table = ds.dataset(lake, format="parquet", partitioning="hive").to_table(columns=list(COLUMNS))
    return [e for e in table.to_pylist() if e["type"] == "expired"]
