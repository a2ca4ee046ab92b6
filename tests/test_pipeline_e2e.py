"""End to end: a real `ecq broker` records queue events while paho clients write and read, its
exporter fills the Parquet lake, and `ecq pipeline report` on local Spark finds what the workload did;
the lake disappearing mid-run loses and duplicates no event."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from ecq.events.schema import COLUMNS
from ecq.pipeline.report import read_table
from ecq.pipeline.spark import spark_session
from ecq.pipeline.cli import pipeline
from tests.harness import metrics_text, wait_until

ACK_DELAY_S = 0.3
# lake_file_age: files at once, the test reads the lake while the broker runs; 31: the acker's messages never wait
EVENTS = dict(export_interval="200ms", lake_file_age="200ms", reader_batch_size=31)


@pytest.fixture(scope="session")
def spark():
    """The local[2] session shared with tests/test_pipeline.py when both run (spark_session reuses it)."""
    with spark_session("local[2]", "ecq-tests") as session:
        yield session


def lake_events(lake: Path) -> list[dict]:
    if not any(lake.rglob("*.parquet")):
        return []
    return ds.dataset(lake, format="parquet", partitioning="hive").to_table(columns=list(COLUMNS)).to_pylist()


def count(events: list[dict], event_type: str, clientid: str | None = None) -> int:
    return sum(1 for e in events if e["type"] == event_type and (clientid is None or e["clientid"] == clientid))


def ack_after_delay(client, stop: threading.Event) -> threading.Thread:
    """Ack every message ``client`` (manual_ack) receives ACK_DELAY_S seconds after it arrived."""
    def run() -> None:
        while not stop.is_set():
            try:
                message = client.messages.get(timeout=0.1)
            except Exception:  # queue.Empty
                continue
            threading.Timer(ACK_DELAY_S, client.ack, [message]).start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(600)
def test_report_matches_the_workload(spark, make_broker, connect, tmp_path):
    lake = tmp_path / "lake"
    broker = make_broker(lake_dir=str(lake), **EVENTS)
    producer = connect(broker.port, "producer")

    # acker: online, acks each message 300 ms after it arrived
    acker = connect(broker.port, "acker", manual_ack=True)
    assert acker.subscribe("$ECQ/acker/#") == 1
    stop = threading.Event()
    ack_after_delay(acker, stop)
    producer.publish_many([(f"$ECQ/w/acker/k{i:02d}", b"x" * 10) for i in range(20)])

    # absent: never connects; 10 keys written 3 times each, so 20 writes replace an older value
    producer.publish_many([(f"$ECQ/w/absent/cfg/{i}", f"v{rev}".encode()) for rev in range(3) for i in range(10)])

    # flaky: takes 5 messages without acking, drops the connection, comes back and acks them
    flaky = connect(broker.port, "flaky", manual_ack=True)
    assert flaky.subscribe("$ECQ/flaky/#") == 1
    producer.publish_many([(f"$ECQ/w/flaky/f{i}", b"y") for i in range(5)])
    assert len(flaky.expect(5)) == 5
    flaky.close(clean=False)
    flaky_again = connect(broker.port, "flaky")
    assert flaky_again.subscribe("$ECQ/flaky/#") == 1
    assert {m.topic for m in flaky_again.expect(5)} == {f"$ECQ/flaky/f{i}" for i in range(5)}

    # refused: a PUBLISH without the w level, and an empty key aimed at absent
    producer.publish("$ECQ/absent/cfg/0", b"no")
    producer.publish("$ECQ/w/absent/", b"no")

    assert wait_until(lambda: count(lake_events(lake), "acked") >= 25 and count(lake_events(lake), "refused") == 2,
                      timeout=30), "the exporter did not bring the events to the lake"
    stop.set()

    out = tmp_path / "report"
    result = CliRunner().invoke(pipeline, ["report", "--lake", str(lake), "--out", str(out), "--master", "local[2]"])
    assert result.exit_code == 0, result.output
    consumers = {row["clientid"]: row for row in read_table(out, "consumers").to_pylist()}

    acker_row = consumers["acker"]
    assert (acker_row["appended"], acker_row["delivered"], acker_row["redeliveries"], acker_row["acked"],
            acker_row["backlog"], acker_row["compacted"]) == (20, 20, 0, 20, 0, 0)
    delay_ms = ACK_DELAY_S * 1000
    assert delay_ms <= acker_row["delivery_p50_ms"] <= acker_row["delivery_p99_ms"] <= acker_row["delivery_max_ms"]
    assert acker_row["delivery_max_ms"] <= acker_row["end_to_end_max_ms"] < delay_ms + 2000  # generous: a loaded 2-core machine

    absent = consumers["absent"]
    assert (absent["appended"], absent["compacted"], absent["delivered"], absent["acked"], absent["backlog"],
            absent["refused"]) == (30, 20, 0, 0, 10, 1)
    assert absent["compaction_ratio"] == pytest.approx(20 / 30)
    assert absent["end_to_end_p50_ms"] is None

    flaky_row = consumers["flaky"]
    assert (flaky_row["appended"], flaky_row["delivered"], flaky_row["redeliveries"], flaky_row["acked"],
            flaky_row["backlog"]) == (5, 10, 5, 5, 0)

    (fleet,) = read_table(out, "fleet").to_pylist()
    assert (fleet["appended"], fleet["acked"], fleet["backlog"], fleet["refused"], fleet["consumers_with_backlog"]) == (
        55, 25, 10, 2, 1)
    over_time = read_table(out, "over_time").to_pylist()
    assert sum(r["writes"] for r in over_time) == 55 and sum(r["acks"] for r in over_time) == 25
    assert over_time[-1]["backlog"] == 10
    assert {r["reason"]: r["refused"] for r in read_table(out, "refused_reasons").to_pylist()} == {
        "not_a_write": 1, "empty_key": 1}
    assert "backlog 10 messages" in result.output and (out / "report.html").is_file()


@pytest.mark.timeout(600)
def test_a_queue_forgotten_by_state_gc_has_its_new_acks_counted_apart_from_the_old_ones(spark, make_broker, connect,
                                                                                         tmp_path):
    """State GC forgets a queue emptied by retention, so its next write is seqno 1 again: every ack counts."""
    lake = tmp_path / "lake"
    broker = make_broker(lake_dir=str(lake), data_retention="1s", state_retention="1s", gc_interval="200ms",
                         **EVENTS)
    producer = connect(broker.port, "producer")

    def consume(count: int) -> None:  # then disconnect: state GC forgets no queue whose consumer is online
        consumer = connect(broker.port, "client3")
        assert consumer.subscribe("$ECQ/client3/#") == 1
        assert len(consumer.expect(count)) == count
        consumer.close()

    producer.publish("$ECQ/w/client3/k1", b"old")
    consume(1)
    assert wait_until(lambda: "ecq_queues_forgotten_total 1.0" in metrics_text(broker), timeout=30)
    producer.publish_many([("$ECQ/w/client3/k1", b"new"), ("$ECQ/w/client3/k2", b"new")])
    consume(2)
    assert wait_until(lambda: count(lake_events(lake), "acked", "client3") == 3, timeout=30)
    assert broker.stop() == 0  # the lake stops growing (retention keeps expiring entries)
    events = lake_events(lake)
    assert sorted(e["seqno"] for e in events if e["type"] == "acked") == [1, 1, 2]

    out = tmp_path / "report"
    result = CliRunner().invoke(pipeline, ["report", "--lake", str(lake), "--out", str(out), "--master", "local[2]"])
    assert result.exit_code == 0, result.output
    (row,) = read_table(out, "consumers").to_pylist()
    assert (row["appended"], row["delivered"], row["redeliveries"], row["acked"], row["backlog"]) == (3, 3, 0, 3, 0)
    assert row["expired"] == count(events, "expired") >= 1
    assert row["end_to_end_max_ms"] < 2000  # the new seqno 1 acked after its own write, not the old one's
    over_time = read_table(out, "over_time").to_pylist()
    assert sum(r["acks"] for r in over_time) == 3 and min(r["backlog"] for r in over_time) >= 0


def test_the_lake_disappearing_mid_run_loses_and_duplicates_no_event(make_broker, connect, tmp_path):
    lake, away = tmp_path / "lake", tmp_path / "lake-away"
    broker = make_broker(lake_dir=str(lake), **EVENTS)
    producer = connect(broker.port, "producer")

    def write(first: int, count: int) -> None:
        infos = producer.publish_many([(f"$ECQ/w/dev/k{i:04d}", b"v") for i in range(first, first + count)])
        assert all(info.is_published() for info in infos), "the broker must keep storing writes"

    write(0, 100)
    assert wait_until(lambda: count(lake_events(lake), "appended") == 100, timeout=30)
    lake.rename(away)  # an unmounted volume: the exporter must not recreate it elsewhere
    write(100, 100)
    assert wait_until(lambda: "failed (attempt 2)" in broker.log(), timeout=10), "the export should be failing"
    assert not lake.exists()
    away.rename(lake)
    write(200, 100)
    assert wait_until(lambda: count(lake_events(lake), "appended") >= 300, timeout=60)
    time.sleep(0.5)  # one more export interval: anything duplicated would show now
    appended = [e for e in lake_events(lake) if e["type"] == "appended"]
    assert sorted(e["seqno"] for e in appended) == list(range(1, 301))
    assert sorted(e["key"] for e in appended) == [f"k{i:04d}" for i in range(300)]
