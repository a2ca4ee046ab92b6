"""`ecq pipeline load` reports its publishing rate without Spark's start-up and reading in it, and prints
progress while a large input is published: local Spark (the session shared by the pipeline tests) and a
real broker over TCP."""

from __future__ import annotations

import re
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ecq.pipeline.cli import pipeline
from ecq.pipeline.load import Target, load
from ecq.pipeline.spark import spark_session

SUMMARY = re.compile(r"published (\d+) of (\d+) rows to \S+ in ([\d.]+) s \((\d+) rows/s\); "
                     r"Spark start-up and read ([\d.]+) s; failed (\d+)")
PROGRESS = re.compile(r"progress: (\d+) of (\d+) rows published \((\d+) rows/s\), (\d+) failed")


@pytest.fixture(scope="session")
def spark():
    """The local[2] session shared with the other pipeline test modules (spark_session reuses it)."""
    with spark_session("local[2]", "ecq-tests") as session:
        yield session


def test_the_printed_rate_is_over_the_publishing_phase_only(spark, make_broker, tmp_path):
    csv = tmp_path / "rows.csv"
    csv.write_text("clientid,key,payload\nc1,a,1\nc1,b,2\nc2,a,3\nc3,a,4\n")
    broker = make_broker()
    started = time.monotonic()
    result = CliRunner().invoke(pipeline, ["load", "--input", str(csv), "--format", "csv", "--master", "local[2]",
                                           "--broker", f"127.0.0.1:{broker.port}"])
    wall = time.monotonic() - started
    assert result.exit_code == 0, result.output
    published, rows, publish_s, rate, startup_s, failed = SUMMARY.search(result.output).groups()
    assert (published, rows, failed) == ("4", "4", "0")
    publish_s, startup_s = float(publish_s), float(startup_s)
    assert 0 < publish_s < 1.0 < 4 / publish_s
    assert abs(int(rate) - 4 / publish_s) <= 0.1 * 4 / publish_s  # 4 rows over the publishing phase, not the run
    assert publish_s < startup_s <= wall  # reading and checking the input alone take longer than 4 PUBLISHes


@pytest.mark.timeout(300)
def test_progress_lines_appear_while_a_large_input_is_published(spark, make_broker, tmp_path):
    total = 20_000
    dataset = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"clientid": [f"dev{i % 8}" for i in range(total)],
                             "key": [f"k{i}" for i in range(total)], "payload": ["v"] * total}), dataset)
    broker = make_broker()
    lines: list[str] = []
    result = load(spark, dataset, "parquet", Target("127.0.0.1", broker.port), partitions=2,
                  progress_every_s=0.1, echo=lines.append)
    assert (result.published, result.failed) == (total, 0)
    assert result.publish_seconds > 0.5, "too fast to need progress: raise total"
    progress = [tuple(map(int, PROGRESS.fullmatch(line).groups())) for line in lines]
    assert len(progress) >= 2, lines
    counts = [published for published, _, _, _ in progress]
    assert counts == sorted(set(counts)) and counts[-1] <= total
    assert all(of == total and rate > 0 and failed == 0 for _, of, rate, failed in progress)
    assert 0 < result.publish_seconds < result.seconds and result.startup_seconds > 0
    assert result.rate == pytest.approx(total / result.publish_seconds)
