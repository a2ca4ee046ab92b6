"""`ecq pipeline compact` on local Spark (one session for the module): lakes written by the real recorder and
exporter, compacted hour by hour; rows and distinct events counted before and after, a compaction stopped
between its steps and finished by the next run, and an exporter crash whose unacked file must not be merged."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from ecq.events.recorder import read_stream_id
from ecq.pipeline.cli import pipeline
from ecq.pipeline.compact import (SPARK_TMP, begin, compact_lake, newest_files, plan_hour, read_manifest, recover,
                                  write_output)
from ecq.pipeline.spark import read_events, spark_session
from tests.test_events import export_all, fill_buffer, lake_rows

HOUR_23 = ("date=2025-12-31", "hour=23")  # fill_buffer's events run from 23:59:00 across midnight
HOUR_00 = ("date=2026-01-01", "hour=00")


@pytest.fixture(scope="session")
def spark():
    """The local[2] session shared with the other pipeline test modules (compact_lake reuses it too)."""
    with spark_session("local[2]", "ecq-tests") as session:
        yield session


def hour_files(lake: Path, hour: tuple[str, str]) -> list[str]:
    """Names in an hour directory, hidden ones included."""
    return sorted(path.name for path in lake.joinpath(*hour).iterdir())


def event_ids(lake: Path) -> list[tuple[str, str]]:
    """(clientid, key) of every event pyarrow.dataset reads from the lake: unique per event in these tests."""
    return sorted((row["clientid"], row["key"]) for row in lake_rows(lake))


def spark_counts(spark, lake: Path) -> tuple[int, int]:
    """Rows and distinct (clientid, key) as Spark reads the lake."""
    events = read_events(spark, lake)
    return events.count(), events.select("clientid", "key").distinct().count()


async def test_each_finished_hour_becomes_one_file_and_every_event_stays_once(spark, tmp_path):
    lake = tmp_path / "lake"
    await fill_buffer(tmp_path / "b1", 1000)
    await export_all(tmp_path / "b1", lake, batch_items=50)
    await fill_buffer(tmp_path / "b2", 300)  # a second broker's stream, its own newest file in hour 23
    await export_all(tmp_path / "b2", lake, batch_items=50)
    before = lake_rows(lake)
    assert len(before) == 1300 and len(hour_files(lake, HOUR_23)) == 18  # 12 + 6 files of 50 events

    lines: list[str] = []
    assert compact_lake(lake, "local[2]", echo=lines.append) == 2
    newest_b2 = f"part-{read_stream_id(tmp_path / 'b2')}-"
    files_23 = hour_files(lake, HOUR_23)
    assert len(files_23) == 2 and files_23[0].startswith("compacted-") and files_23[1].startswith(newest_b2)
    files_00 = hour_files(lake, HOUR_00)  # b1's newest batch is in hour 00: it stays beside the merged file
    assert len(files_00) == 2 and files_00[0].startswith("compacted-") and files_00[1].startswith("part-")
    assert sorted(map(sorted_row, lake_rows(lake))) == sorted(map(sorted_row, before))
    assert spark_counts(spark, lake) == (1300, 1000)  # both streams used keys k000000..: 300 shared
    assert lines[0].startswith("date=2025-12-31/hour=23: 17 files, 850 rows -> compacted-")
    assert not (lake / SPARK_TMP).exists()

    assert compact_lake(lake, "local[2]", echo=lines.append) == 0  # nothing left: Spark is not even started
    assert lines[-1].startswith("nothing to compact")


def sorted_row(row: dict) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in row.items()))


async def test_a_compaction_stopped_at_any_step_is_finished_or_undone_by_the_next_run(spark, tmp_path):
    lake = tmp_path / "lake"
    keys = await fill_buffer(tmp_path / "b1", 1000)
    await export_all(tmp_path / "b1", lake, batch_items=50)
    hour_23, hour_00 = lake.joinpath(*HOUR_23), lake.joinpath(*HOUR_00)
    keep = newest_files(lake)

    # Hour 00: stopped after the manifest, before Spark's output was committed: undone, inputs untouched.
    plan_00 = plan_hour(hour_00, keep)
    begin(plan_00)
    plan_00.spark_dir(lake).mkdir(parents=True)
    (plan_00.spark_dir(lake) / "part-00000.parquet").write_bytes(b"half of what Spark writes")
    files_00 = hour_files(lake, HOUR_00)

    # Hour 23: stopped after the commit point, with 3 of its inputs already deleted.
    plan_23 = plan_hour(hour_23, keep)
    begin(plan_23)
    write_output(spark, lake, plan_23)
    for name in plan_23.inputs[:3]:
        (hour_23 / name).unlink()
    assert len(set(event_ids(lake))) == len(event_ids(lake)) == 1000 - 150  # readers: missing rows, never doubles

    assert read_manifest(plan_23.manifest) == plan_23
    assert recover(lake) == [
        f"date=2025-12-31/hour=23: finished an interrupted compaction into {plan_23.output.name}",
        "date=2026-01-01/hour=00: undid an interrupted compaction (its inputs are untouched)"]
    assert hour_files(lake, HOUR_23) == [plan_23.output.name]
    assert hour_files(lake, HOUR_00) == [name for name in files_00 if not name.startswith(".")]
    assert not (lake / SPARK_TMP).exists()
    assert event_ids(lake) == [("c1", key) for key in keys]
    assert spark_counts(spark, lake) == (1000, 1000)


PARTIAL_EXPORT_THEN_CRASH = """
import os, sys
from pathlib import Path
from ecq.events.lake import write_batch
from ecq.events.recorder import read_stream_id
from ecq.events.replayq import ReplayQ, ReplayQConfig

buffer_dir, lake, acked = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
queue = ReplayQ.open(ReplayQConfig(dir=buffer_dir, fsync="never"))
for batch in range(acked + 1):  # what LakeExporter does: pop, write_batch, ack; the last batch is never acked
    ref, items = queue.pop(100)
    write_batch(lake, read_stream_id(buffer_dir), ref, items)
    if batch < acked:
        queue.ack(ref)
os._exit(9)
"""


async def test_the_unacked_file_of_a_crashed_exporter_is_not_merged_so_its_restart_lands_each_event_once(
        spark, tmp_path):
    buffer_dir, lake = tmp_path / "buffer", tmp_path / "lake"
    keys = await fill_buffer(buffer_dir, 1000)
    lake.mkdir()
    crash = subprocess.run([sys.executable, "-c", PARTIAL_EXPORT_THEN_CRASH, str(buffer_dir), str(lake), "4"],
                           capture_output=True, timeout=60)
    assert crash.returncode == 9, crash.stderr.decode()
    assert len(hour_files(lake, HOUR_23)) == 5  # 4 acked batches and the unacked fifth, all in hour 23

    assert compact_lake(lake, "local[2]", echo=lambda _line: None) == 1
    assert len(hour_files(lake, HOUR_23)) == 2  # the merged four and the unacked one

    await export_all(buffer_dir, lake)  # the restarted exporter deletes its unacked file and exports again
    assert event_ids(lake) == [("c1", key) for key in keys]


def test_compact_refuses_unfinished_hours_and_bad_options(tmp_path):
    lake = tmp_path / "lake"
    lake.mkdir()
    now = datetime.now(UTC)
    run = CliRunner().invoke
    result = run(pipeline, ["compact", "--lake", str(lake), "--hour", f"{now:%Y-%m-%d/%H}"])
    assert result.exit_code == 1 and "is not finished" in result.output
    result = run(pipeline, ["compact", "--lake", str(lake), "--before", f"{now:%Y-%m-%d/%H}"])
    assert result.exit_code == 1 and "too late" in result.output
    result = run(pipeline, ["compact", "--lake", str(lake), "--hour", "2026-01-01T00"])
    assert result.exit_code == 2 and "is not YYYY-MM-DD/HH" in result.output
    result = run(pipeline, ["compact", "--lake", str(lake), "--hour", "2026-01-01/00", "--before", "2026-01-01/05"])
    assert result.exit_code == 2 and "not both" in result.output
    result = run(pipeline, ["compact", "--lake", str(lake), "--before", "2026-01-01/05"])
    assert result.exit_code == 0 and "nothing to compact" in result.output
