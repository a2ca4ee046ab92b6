"""SCQ events in the lake (issue 33 point 6): every queue event says its queue's kind, an SCQ's event names the SCQ
by its queue id and its delivered, acked and rewound events the reader; over TCP with paho against a real broker
process exporting to a real Parquet lake, on both storage backends; ``ecq pipeline report`` counts SCQs apart from
ECQ queues, in lakes with files written before the ``kind`` and ``reader`` columns too."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ecq.events.schema import COLUMNS, SCHEMA
from ecq.pipeline.cli import pipeline
from ecq.pipeline.report import read_table
from tests.harness import topics_payloads, wait_until, write
from tests.test_pipeline_e2e import spark  # noqa: F401 - the session-wide local Spark
from tests.test_scq import FILTER, Q, delivered, read_all, scq_write

QUEUE_ID = f"$SCQ/{Q}"
GROUP = "$share/workers"


def lake_rows(lake) -> list[dict]:
    if not any(lake.rglob("*.parquet")):
        return []
    return ds.dataset(lake, format="parquet", partitioning="hive").to_table(columns=list(COLUMNS)).to_pylist()


def owners(lake, event_type: str) -> set[tuple]:
    """(clientid, kind, reader) of the lake's events of ``event_type``."""
    return {(r["clientid"], r["kind"], r["reader"]) for r in lake_rows(lake) if r["type"] == event_type}


def test_scq_events_carry_the_kind_the_queue_id_and_the_reader(backend_broker, connect, tmp_path):
    """Writes (one compacting another), a reader, a group member, a rewind and a refused write on an SCQ beside an ECQ
    queue: the SCQ's rows are ``kind`` scq under ``$SCQ/<queue>`` (never a reader's position id), its deliveries,
    acks and rewinds name the reader or the group; the ECQ queue's rows are ``kind`` ecq with no reader."""
    lake = tmp_path / "lake"
    broker = backend_broker(lake_dir=str(lake), export_interval="200ms", lake_file_age="200ms")
    producer = connect(broker.port, "producer")
    for key, payload in (("a", "1"), ("b", "2"), ("a", "3")):
        scq_write(producer, key, payload)
    write(producer, "own", "k", "x")
    assert read_all(connect, broker.port, "r1", 2) == [delivered("b", b"2"), delivered("a", b"3")]
    member = connect(broker.port, "worker-1")
    assert member.subscribe(f"{GROUP}/{FILTER}") == 1
    assert len(member.expect(2)) == 2
    reader = connect(broker.port, "r1")
    assert reader.subscribe(FILTER) == 1
    reader.publish(f"$SCQ/ctl/{Q}/rewind", b"earliest", 1)
    assert len(reader.expect(2)) == 2
    producer.publish(f"$SCQ/w/{Q}/", b"x", 1)  # empty_key
    own = connect(broker.port, "own")
    assert own.subscribe("$ECQ/own/#") == 1
    assert topics_payloads(own.expect(1)) == [("$ECQ/own/k", b"x")]

    scq, ecq = (QUEUE_ID, "scq", None), ("own", "ecq", None)
    readers = {(QUEUE_ID, "scq", "r1"), (QUEUE_ID, "scq", GROUP)}
    assert wait_until(lambda: owners(lake, "rewound") == {(QUEUE_ID, "scq", "r1")}
                      and owners(lake, "acked") == readers | {ecq} and owners(lake, "refused"), 10), lake_rows(lake)
    assert owners(lake, "appended") == {scq, ecq}
    assert owners(lake, "compacted") == {scq}
    assert owners(lake, "delivered") == readers | {ecq}
    assert owners(lake, "refused") == {(QUEUE_ID, "scq", None)}


def write_legacy_file(lake) -> None:
    """A lake file as a broker wrote it before the ``kind`` and ``reader`` columns: an ECQ queue ``legacy`` with one
    message acked, and an SCQ ``old`` whose reader's delivery and ack name the reader's position id."""
    old_schema = pa.schema([field for field in SCHEMA if field.name not in ("kind", "reader")])
    rows = [dict(ts_ms=1000, type="appended", clientid="legacy", key="k", seqno=1, publish_ts_ms=1000, payload_bytes=1),
            dict(ts_ms=1100, type="acked", clientid="legacy", key="k", seqno=1, publish_ts_ms=1000, payload_bytes=1),
            dict(ts_ms=1000, type="appended", clientid="$SCQ/old", key="k", seqno=1, publish_ts_ms=1000),
            dict(ts_ms=1050, type="delivered", clientid="$SCQ/old/r9", key="k", seqno=1, publish_ts_ms=1000, attempt=1),
            dict(ts_ms=1100, type="acked", clientid="$SCQ/old/r9", key="k", seqno=1, publish_ts_ms=1000)]
    path = lake / "date=1970-01-01" / "hour=00" / "part-legacy.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{**dict.fromkeys(old_schema.names), **row} for row in rows], old_schema), path)


@pytest.mark.timeout(600)
def test_the_report_counts_scqs_apart_from_ecq_queues(spark, make_broker, connect, tmp_path):  # noqa: F811
    """Three writes to an SCQ (one compacting another) read by two readers and a group, beside an ECQ queue, plus a
    file from before the kind column: one ``scq_queues`` row per SCQ (writes, readers, deliveries, acks, fan-out),
    shown on the page and in the summary; the ECQ tables count the ECQ queues only, the old file's too."""
    lake = tmp_path / "lake"
    broker = make_broker(lake_dir=str(lake), export_interval="200ms", lake_file_age="200ms")
    producer = connect(broker.port, "producer")
    for key, payload in (("a", "1"), ("b", "2"), ("a", "3")):
        scq_write(producer, key, payload)
    write(producer, "own", "k", "x")
    write(producer, "own", "k", "y")
    producer.publish(f"$SCQ/w/{Q}/", b"x", 1)  # refused: empty_key
    producer.publish("$ECQ/w/own/", b"x", 1)  # refused: empty_key
    for reader in ("r1", "r2"):
        assert len(read_all(connect, broker.port, reader, 2)) == 2
    member = connect(broker.port, "worker-1")
    assert member.subscribe(f"{GROUP}/{FILTER}") == 1
    assert len(member.expect(2)) == 2
    own = connect(broker.port, "own")
    assert own.subscribe("$ECQ/own/#") == 1
    assert topics_payloads(own.expect(1)) == [("$ECQ/own/k", b"y")]
    assert wait_until(lambda: len(owners(lake, "acked")) == 4 and len(owners(lake, "refused")) == 2, 10)
    assert wait_until(lambda: sum(r["type"] == "acked" for r in lake_rows(lake)) == 7, 10)
    write_legacy_file(lake)

    out = tmp_path / "report"
    result = CliRunner().invoke(pipeline, ["report", "--lake", str(lake), "--out", str(out), "--master", "local[2]"])
    assert result.exit_code == 0, result.output
    scqs = {row.pop("queue"): row for row in read_table(out, "scq_queues").to_pylist()}
    counted = ("appended", "compacted", "readers", "delivered", "acked", "fan_out", "refused")
    assert {name: tuple(row[c] for c in counted) for name, row in scqs.items()} == {
        Q: (3, 1, 3, 6, 6, 2.0, 1), "old": (1, 0, 0, 1, 1, 1.0, 0)}
    consumers = {row["clientid"]: row for row in read_table(out, "consumers").to_pylist()}
    assert sorted(consumers) == ["legacy", "own"]
    assert [consumers["own"][c] for c in ("appended", "compacted", "delivered", "acked", "refused", "backlog")] == [
        2, 1, 1, 1, 1, 0]
    (fleet,) = read_table(out, "fleet").to_pylist()
    assert (fleet["consumers"], fleet["appended"], fleet["delivered"], fleet["acked"], fleet["refused"]) == (
        2, 3, 1, 2, 1)
    assert sum(r["writes"] for r in read_table(out, "over_time").to_pylist()) == 3
    assert "SCQs 2: writes 4, readers 3, deliveries 7, acks 7" in result.output
    page = (out / "report.html").read_text()
    assert "<h2>Shared compacted queues (SCQ)</h2>" in page
    assert f"<tr><td>{Q}</td><td>3</td><td>1</td><td>3</td><td>6</td><td>0</td><td>6</td><td>2.00</td>" in page
