"""The PySpark jobs on local Spark (local[2], one session for the whole run): `report` on a known
event set written by the real recorder and exporter, `load` into a real broker, their errors, and the same
report on a standalone cluster started by scripts/spark-cluster."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ecq.events import EventRecorder, LakeExporter
from ecq.pipeline import PipelineError
from ecq.pipeline.load import Target, load, read_rows
from ecq.pipeline.report import read_table, run_report
from ecq.pipeline.spark import check_java, spark_session
from ecq.pipeline.cli import pipeline

REPO = Path(__file__).resolve().parent.parent
T = 1_767_225_600_000  # 2026-01-01T00:00:00Z
MINUTE = 60_000


@pytest.fixture(scope="session")
def spark():
    """One local[2] Spark for every test (CLI runs inside the test process reuse it)."""
    with spark_session("local[2]", "ecq-tests") as session:
        yield session


def known_events() -> list[tuple[str, dict]]:
    """A workload whose report is known by hand:

    - fast: 10 writes (k0..k9, one per second from T), each delivered 10 ms later and acked after
      100, 200, ..., 1000 ms; k9 is delivered twice (attempt 2); k2 is acked a second time at minute 3.
    - slow: 5 writes to key "a" at minute 1, each replacing the previous one (4 compactions); never read.
    - gc: 3 writes at minute 2, 2 of them expired by GC at T + 150 s.
    - refused: one bad_key write aimed at fast, one not_a_write without a clientid.
    """
    events = []
    for i in range(10):
        ts = T + i * 1000
        msg = dict(clientid="fast", key=f"k{i}", seqno=i + 1, publish_ts_ms=ts, payload_bytes=10)
        events.append(("appended", dict(ts_ms=ts, **msg)))
        events.append(("delivered", dict(ts_ms=ts + 10, attempt=1, **msg)))
        if i == 9:
            events.append(("delivered", dict(ts_ms=ts + 50, attempt=2, **msg)))
        events.append(("acked", dict(ts_ms=ts + 100 * (i + 1), **msg)))
    for i in range(5):
        ts = T + MINUTE + i * 1000
        events.append(("appended", dict(ts_ms=ts, clientid="slow", key="a", seqno=i + 1, publish_ts_ms=ts,
                                        payload_bytes=20)))
        if i:
            events.append(("compacted", dict(ts_ms=ts, clientid="slow", key="a", seqno=i + 1, publish_ts_ms=ts,
                                             replaced_seqno=i)))
    for i in range(3):
        ts = T + 2 * MINUTE + i * 1000
        events.append(("appended", dict(ts_ms=ts, clientid="gc", key=f"g{i}", seqno=i + 1, publish_ts_ms=ts,
                                        payload_bytes=30)))
        if i < 2:
            events.append(("expired", dict(ts_ms=T + 150_000, clientid="gc", key=f"g{i}", seqno=i + 1,
                                           publish_ts_ms=ts, payload_bytes=30)))
    events.append(("evicted", dict(ts_ms=T + 3 * MINUTE + 1000, clientid="gc", key="g2", seqno=3,
                                   publish_ts_ms=T + 2 * MINUTE + 2000, payload_bytes=30, reason="quota")))
    events.append(("refused", dict(ts_ms=T + 30_000, clientid="fast", reason="bad_key", topic="$ECQ/w/fast/+")))
    events.append(("refused", dict(ts_ms=T + 90_000, clientid=None, reason="not_a_write", topic="$ECQ/x")))
    events.append(("acked", dict(ts_ms=T + 3 * MINUTE + 5000, clientid="fast", key="k2", seqno=3,
                                 publish_ts_ms=T + 2000, payload_bytes=10)))
    return events


def write_lake(base: Path, events: list[tuple[str, dict]]) -> Path:
    """Record ``events`` with the real recorder and export them to ``base/lake``; returns the lake."""
    async def record() -> None:
        recorder = EventRecorder(base / "buffer")
        await recorder.start()
        exporter = LakeExporter(recorder, base / "lake")
        await exporter.start()
        for event_type, fields in events:
            recorder.record(event_type, **fields)
        await exporter.close()
        await recorder.close()
        assert recorder.stats()["exported_items"] == len(events)

    asyncio.run(record())
    return base / "lake"


@pytest.fixture(scope="module")
def known_lake(tmp_path_factory) -> Path:
    return write_lake(tmp_path_factory.mktemp("known"), known_events())


@pytest.fixture(scope="module")
def known_report(spark, known_lake, tmp_path_factory) -> tuple[Path, str]:
    """(out dir, printed summary) of `ecq pipeline report` on the known lake."""
    out = tmp_path_factory.mktemp("report") / "out"
    return out, run_report(known_lake, out, "local[2]")


def by_clientid(out: Path) -> dict[str, dict]:
    return {row["clientid"]: row for row in read_table(out, "consumers").to_pylist()}


@pytest.mark.timeout(600)
def test_report_per_consumer(known_report):
    out, _ = known_report
    consumers = by_clientid(out)
    assert sorted(consumers) == ["fast", "gc", "slow"]
    fast, slow, gc = consumers["fast"], consumers["slow"], consumers["gc"]
    assert {k: fast[k] for k in ("appended", "compacted", "compaction_ratio", "delivered", "redeliveries", "acked",
                                 "expired", "refused", "backlog")} == dict(
        appended=10, compacted=0, compaction_ratio=0.0, delivered=11, redeliveries=1, acked=10, expired=0,
        refused=1, backlog=0)
    # end to end 100, 200, ..., 1000 ms (the repeated ack of k2 does not count); delivery 10 ms less, but k9's
    # acked send was its second one, 50 ms after the write: 90, 190, ..., 890, 950
    assert (fast["end_to_end_p50_ms"], fast["end_to_end_p95_ms"], fast["end_to_end_p99_ms"],
            fast["end_to_end_max_ms"]) == (500, 1000, 1000, 1000)
    assert (fast["delivery_p50_ms"], fast["delivery_p95_ms"], fast["delivery_p99_ms"], fast["delivery_max_ms"]) == (
        490, 950, 950, 950)
    assert (slow["appended"], slow["compacted"], slow["compaction_ratio"], slow["backlog"], slow["acked"]) == (
        5, 4, 0.8, 1, 0)
    assert slow["end_to_end_p50_ms"] is None and slow["delivery_p50_ms"] is None and slow["delivered"] == 0
    assert (gc["appended"], gc["expired"], gc["backlog"]) == (3, 2, 0)  # the third was evicted by a quota
    assert (fast["first_event_ms"], fast["last_event_ms"]) == (T, T + 3 * MINUTE + 5000)


def test_report_over_time_and_fleet(known_report):
    out, _ = known_report
    over_time = read_table(out, "over_time").to_pylist()
    assert {r["bucket_s"] for r in over_time} == {1}  # 3 minutes of events: one bucket per second
    assert [r["start_ms"] for r in over_time] == list(range(T, T + 3 * MINUTE + 5001, 1000))  # quiet ones too
    minutes = [[r for r in over_time if (r["start_ms"] - T) // MINUTE == m] for m in range(4)]
    assert [(sum(r["writes"] for r in rows), sum(r["deliveries"] for r in rows), sum(r["acks"] for r in rows),
             rows[-1]["backlog"]) for rows in minutes] == [(10, 11, 10, 0), (5, 0, 0, 1), (3, 0, 0, 2), (0, 0, 0, 1)]
    (fleet,) = read_table(out, "fleet").to_pylist()
    assert fleet == dict(
        consumers=3, consumers_with_backlog=1, events=len(known_events()), appended=18, compacted=4,
        compaction_ratio=4 / 18, delivered=11, redeliveries=1, acked=10, expired=2, refused=2, backlog=1,
        delivery_p50_ms=490, delivery_p95_ms=950, delivery_p99_ms=950, delivery_max_ms=950, end_to_end_p50_ms=500,
        end_to_end_p95_ms=1000, end_to_end_p99_ms=1000, end_to_end_max_ms=1000, first_event_ms=T,
        last_event_ms=T + 3 * MINUTE + 5000)
    assert read_table(out, "refused_reasons").to_pylist() == [
        {"reason": "bad_key", "refused": 1}, {"reason": "not_a_write", "refused": 1}]
    histogram = read_table(out, "latency_histogram").to_pylist()
    assert sum(h["end_to_end_acks"] for h in histogram) == sum(h["delivery_acks"] for h in histogram) == 10
    for latency in range(100, 1001, 100):  # each latency falls in exactly one bucket, and buckets tile the axis
        assert sum(1 for h in histogram if h["lower_ms"] <= latency < h["upper_ms"]) == 1
    assert all(a["upper_ms"] == b["lower_ms"] for a, b in zip(histogram, histogram[1:], strict=False))


def test_report_summary_and_self_contained_page(known_report):
    out, text = known_report
    assert "backlog 1 messages" in text and "p50 500 ms" in text and "largest backlog: slow 1" in text
    page = (out / "report.html").read_text()
    assert page.count("<svg") == 4  # delivery and end-to-end latency, backlog over time, traffic
    for external in ("<script", "<link", "<img", "src=", "@import"):
        assert external not in page
    references = re.findall(r'href="([^"]*)"', page) + re.findall(r"url\(([^)]*)\)", page)
    assert references and all(r.startswith("#") for r in references)  # only inside the page: glyphs, clip paths
    assert "<td>slow</td>" in page and "bad_key" in page


def test_report_cli_prints_the_summary(spark, known_lake, tmp_path):
    result = CliRunner().invoke(pipeline, ["report", "--lake", str(known_lake), "--out", str(tmp_path / "r"),
                                           "--master", "local[2]"])
    assert result.exit_code == 0, result.output
    assert "consumers 3 (1 with backlog), backlog 1 messages" in result.output
    assert (tmp_path / "r" / "report.html").is_file()


def test_report_refuses_bad_lakes_and_outputs(spark, known_lake, tmp_path):
    runner = CliRunner()

    def report(lake: Path, out: Path) -> tuple[int, str]:
        result = runner.invoke(pipeline, ["report", "--lake", str(lake), "--out", str(out), "--master", "local[2]"])
        return result.exit_code, " ".join(result.output.split())

    code, output = report(tmp_path / "nowhere", tmp_path / "out")
    assert code == 2 and "does not exist" in output
    (tmp_path / "empty").mkdir()
    code, output = report(tmp_path / "empty", tmp_path / "out")
    assert code == 1 and "holds no event files" in output
    code, output = report(known_lake, known_lake / "report")
    assert code == 1 and "inside the lake" in output
    corrupt = tmp_path / "corrupt"
    (corrupt / "date=2026-01-01" / "hour=00").mkdir(parents=True)
    (corrupt / "date=2026-01-01" / "hour=00" / "part-x.parquet").write_bytes(b"PAR1 not really")
    code, output = report(corrupt, tmp_path / "out")
    assert code == 1 and "failed in Spark" in output and "part-x.parquet" in output


def test_missing_or_old_java_is_named(monkeypatch, tmp_path, known_lake):
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PipelineError, match="found none .*openjdk-17-jre-headless"):
        check_java()
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text('#!/bin/sh\necho \'openjdk version "11.0.2" 2019-01-15\' >&2\n')
    java.chmod(0o755)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk"))
    result = CliRunner().invoke(pipeline, ["report", "--lake", str(known_lake), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and "is Java 11" in result.output


def test_ecq_command_has_the_pipeline_group():
    """`ecq pipeline` is this click group, added in ecq/cli.py."""
    result = subprocess.run([str(Path(sys.executable).with_name("ecq")), "pipeline", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "report" in result.stdout and "load" in result.stdout


# --- load ---------------------------------------------------------------------------------------------


def read_queue(connect, port: int, clientid: str, count: int, timeout: float = 60) -> dict[str, bytes]:
    """Consume ``count`` messages of ``clientid``'s queue (each acked) as {key: payload}; none may be left."""
    client = connect(port, clientid)
    assert client.subscribe(f"$ECQ/{clientid}/#") == 1
    messages = client.expect(count, timeout)
    assert client.quiet(0.3) == [], "more messages than keys: an older value was not compacted away"
    prefix = f"$ECQ/{clientid}/"
    return {m.topic[len(prefix):]: m.payload for m in messages}


@pytest.mark.timeout(600)
def test_load_100k_rows_then_each_consumer_reads_the_newest_value_per_key(spark, make_broker, connect, tmp_path):
    clients, keys, versions = 20, 500, 10  # 100,000 rows; every (clientid, key) written 10 times, in order
    rows = [(f"dev{c:02d}", f"cfg/k{k:03d}", f"v{v}:dev{c:02d}:k{k:03d}")
            for v in range(versions) for c in range(clients) for k in range(keys)]
    dataset = tmp_path / "dataset.parquet"
    pq.write_table(pa.table({name: [r[i] for r in rows] for i, name in enumerate(("clientid", "key", "payload"))}),
                   dataset, row_group_size=10_000)
    broker = make_broker()
    spark.conf.set("spark.sql.files.maxPartitionBytes", "128k")  # several input splits: order must survive them
    try:
        assert read_rows(spark, dataset, "parquet").rdd.getNumPartitions() > 1
        result = load(spark, dataset, "parquet", Target("127.0.0.1", broker.port), partitions=2)
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")
    assert (result.rows, result.published, result.failed, result.errors) == (100_000, 100_000, 0, [])
    print(f"load: {result.published / result.seconds:.0f} rows/s over {result.seconds:.1f} s")
    for c in range(clients):
        queue = read_queue(connect, broker.port, f"dev{c:02d}", keys)
        assert queue == {f"cfg/k{k:03d}": f"v9:dev{c:02d}:k{k:03d}".encode() for k in range(keys)}


def test_load_csv_and_json_lines_from_the_cli_and_again(spark, make_broker, connect, tmp_path):
    csv = tmp_path / "rows.csv"
    csv.write_text("clientid,key,payload,comment\nc1,a,1,x\nc1,b,1,x\nc2,a,1,x\nc1,a,2,x\nc1,a,3,x\n")
    jsonl = tmp_path / "rows.json"
    jsonl.write_text('{"clientid": "c2", "key": "b/c", "payload": "j1"}\n'
                     '{"clientid": "c2", "key": "a", "payload": "j2"}\n'
                     '{"clientid": "c3", "key": "n", "payload": null}\n')
    broker = make_broker()
    runner = CliRunner()
    target = ["--broker", f"127.0.0.1:{broker.port}", "--master", "local[2]"]
    for _ in range(2):  # the same load twice: the queues still hold one value per key
        result = runner.invoke(pipeline, ["load", "--input", str(csv), "--format", "csv", *target])
        assert result.exit_code == 0 and "published 5 of 5 rows" in result.output, result.output
    result = runner.invoke(pipeline, ["load", "--input", str(jsonl), "--format", "json", *target])
    assert result.exit_code == 0 and "published 3 of 3 rows" in result.output, result.output

    assert read_queue(connect, broker.port, "c1", 2) == {"a": b"3", "b": b"1"}
    assert read_queue(connect, broker.port, "c2", 2) == {"a": b"j2", "b/c": b"j1"}
    assert read_queue(connect, broker.port, "c3", 1) == {"n": b""}


def test_load_refuses_bad_input_before_publishing(spark, make_broker, connect, tmp_path):
    broker = make_broker()
    runner = CliRunner()

    def load_cli(path: Path, fmt: str) -> tuple[int, str]:
        result = runner.invoke(pipeline, ["load", "--input", str(path), "--format", fmt, "--broker",
                                          f"127.0.0.1:{broker.port}", "--master", "local[2]"])
        return result.exit_code, " ".join(result.output.split())

    code, output = load_cli(tmp_path / "missing.csv", "csv")
    assert code == 2 and "does not exist" in output
    csv = tmp_path / "rows.csv"
    csv.write_text("clientid,key,payload\nbad1,k,v\n")
    code, output = load_cli(csv, "xml")
    assert code == 2 and "'xml' is not one of" in output
    code, output = load_cli(csv, "parquet")
    assert code == 1 and f"cannot read {csv} as parquet" in output
    (tmp_path / "nokey.csv").write_text("clientid,value\nbad1,v\n")
    code, output = load_cli(tmp_path / "nokey.csv", "csv")
    assert code == 1 and "has no column(s) key, payload (it has: clientid, value)" in output
    (tmp_path / "malformed.csv").write_text("clientid,key,payload\nbad1,ok,v\nbad1,,v\nbad/2,k,v\nbad1,a+b,v\n")
    code, output = load_cli(tmp_path / "malformed.csv", "csv")
    assert code == 1 and "3 row(s)" in output and "Nothing was published" in output
    (tmp_path / "broken.json").write_text('{"clientid": "bad1", "key": "k", "payload": "v"}\n{"clientid": \n')
    code, output = load_cli(tmp_path / "broken.json", "json")
    assert code == 1 and "as json" in output and "Unexpected end-of-input" in output
    (tmp_path / "ragged.csv").write_text("clientid,key,payload\nbad1,k,v\nbad1,k,v,extra\n")
    code, output = load_cli(tmp_path / "ragged.csv", "csv")
    assert code == 1 and "cannot read the rows of" in output and "Malformed" in output

    consumer = connect(broker.port, "bad1")
    assert consumer.subscribe("$ECQ/bad1/#") == 1
    assert consumer.quiet(1.0) == []  # not even the valid rows of the refused files were published


def test_load_counts_rows_it_could_not_publish(spark, tmp_path):
    from ecq.testing import free_port

    csv = tmp_path / "rows.csv"
    csv.write_text("clientid,key,payload\n" + "".join(f"c{i % 3},k{i},v\n" for i in range(30)))
    result = CliRunner().invoke(pipeline, ["load", "--input", str(csv), "--format", "csv",
                                           "--broker", f"127.0.0.1:{free_port()}", "--master", "local[2]"])
    assert result.exit_code == 1
    assert "published 0 of 30 rows" in result.output and "failed 30" in result.output
    assert "Connection refused" in result.output


# --- standalone cluster -------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_the_same_report_runs_on_a_standalone_cluster(known_lake, known_report, tmp_path):
    """scripts/spark-cluster starts a master and two workers on loopback; `report` runs there unchanged."""
    script = [sys.executable, str(REPO / "scripts" / "spark-cluster"), "--state", str(tmp_path / "cluster")]
    started = subprocess.run([*script, "start", "--workers", "2"], capture_output=True, text=True, timeout=200)
    try:
        assert started.returncode == 0, started.stderr
        assert started.stdout.startswith("spark://127.0.0.1:")
        run = subprocess.run([*script, "run", "report", "--lake", str(known_lake), "--out", str(tmp_path / "out")],
                             capture_output=True, text=True, timeout=400)
        assert run.returncode == 0, run.stderr[-3000:]
        assert f"--master {started.stdout.split()[0]}" in run.stderr
        executors = list((tmp_path / "cluster" / "work").glob("worker-*/app-*"))
        assert len(executors) == 2, "both workers should have run an executor"
    finally:
        stopped = subprocess.run([*script, "stop"], capture_output=True, text=True, timeout=60)
    assert stopped.stdout.startswith("stopped master, worker-1, worker-2")
    local_out, _ = known_report
    for table in ("fleet", "over_time", "refused_reasons", "latency_histogram"):
        assert read_table(tmp_path / "out", table).to_pylist() == read_table(local_out, table).to_pylist()
    assert by_clientid(tmp_path / "out") == by_clientid(local_out)
