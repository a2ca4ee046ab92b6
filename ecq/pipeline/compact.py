"""``ecq pipeline compact``: merge the files of each finished hour partition of the event lake into one
Parquet file with Spark, exactly once.

Which hours: an hour is finished once it ended at least ``FINISHED_AFTER`` (1 h) ago; by then its
events have long been exported (the exporter writes within about ``lake_file_age`` + 2 x
``export_interval``, and retries a missing lake every 30 s at most). A late file landing in an hour
already compacted (a broker that was down exports its buffer when it comes back) is merged on the next
run: the hour's inputs are its visible files, ``compacted-*.parquet`` included. Left out of every
compaction: the files of the newest position of each exporter stream in the whole lake
(``part-<stream>-<position>``). Only that batch can be unacked (see ecq/events/lake.py), and a broker
that crashed deletes it when it starts again; every older file was acked. So compaction needs no
coordination with running brokers, and an hour keeps one file more while it holds a stream's newest.

Steps for one hour, each durable (fsync) before the next; the manifest makes a re-run finish or undo:

1. plan: the inputs (at least two files); a token names this compaction.
2. manifest: ``.compact-<token>.json`` in the hour directory lists the inputs and their row count.
3. write: Spark reads exactly the inputs and writes them, sorted by ``ts_ms``, as one file under
   ``<lake>/.compact-tmp/<token>/``; its row count is checked against the manifest; the file is renamed
   to ``.compacted-<token>.parquet`` in the hour directory. That rename is the commit point.
4. finish: the inputs are deleted, ``.compacted-<token>.parquet`` is renamed to
   ``compacted-<token>.parquet``, the manifest deleted.

A re-run first resolves every manifest it finds: with the hidden or the visible output present it
finishes step 4 (deleting the inputs still there); without, it undoes the compaction (deletes the Spark
temporary directory and the manifest; the inputs were never touched). Only one compaction runs on a lake
at a time (``flock`` on ``<lake>/.compact.lock``).

What a reader (Spark, pyarrow.dataset, DuckDB: they skip names starting with ``.``) may see: never a row
twice. While step 4 runs (milliseconds), or after a crash inside it until the next run, some rows of that
hour are missing, and a reader that listed the hour before step 4 may fail on a file deleted under it
(Spark: ``spark.sql.files.ignoreMissingFiles``); reading again gives every row once.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import SparkSession

from ecq.events.atomic import fsync_dir, write_atomically
from ecq.events.lake import part_position
from ecq.events.replayq import AckRef
from ecq.events.schema import COLUMNS
from ecq.pipeline import PipelineError
from ecq.pipeline.spark import EVENTS_DDL, SPARK_ERRORS, spark_error_message, spark_session

FINISHED_AFTER = timedelta(hours=1)
LOCK_FILE = ".compact.lock"
SPARK_TMP = ".compact-tmp"
HOUR_FORMAT = "%Y-%m-%d/%H"


@dataclass(frozen=True)
class Plan:
    """One hour's compaction: the hour directory, the token naming it, the input file names, their rows."""

    hour_dir: Path
    token: str
    inputs: tuple[str, ...]
    rows: int

    @property
    def manifest(self) -> Path:
        return self.hour_dir / f".compact-{self.token}.json"

    @property
    def hidden_output(self) -> Path:
        return self.hour_dir / f".compacted-{self.token}.parquet"

    @property
    def output(self) -> Path:
        return self.hour_dir / f"compacted-{self.token}.parquet"

    def spark_dir(self, lake: Path) -> Path:
        return lake / SPARK_TMP / self.token

    def describe(self) -> str:
        return f"{self.hour_dir.parent.name}/{self.hour_dir.name}"


@contextmanager
def locked(lake: Path) -> Iterator[None]:
    """Hold the lake's compaction lock; raises PipelineError when another compaction holds it."""
    with open(lake / LOCK_FILE, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise PipelineError(f"another 'ecq pipeline compact' is running on {lake}") from exc
        yield


def recover(lake: Path) -> list[str]:
    """Finish or undo every compaction a crash interrupted (see the module docstring); returns one line per
    hour saying which. Raises OSError when a file cannot be deleted or renamed."""
    done = []
    for manifest in sorted(lake.glob("date=*/hour=*/.compact-*.json")):
        plan = read_manifest(manifest)
        if plan.hidden_output.exists() or plan.output.exists():
            finish(plan)
            done.append(f"{plan.describe()}: finished an interrupted compaction into {plan.output.name}")
        else:
            undo(lake, plan)
            done.append(f"{plan.describe()}: undid an interrupted compaction (its inputs are untouched)")
    shutil.rmtree(lake / SPARK_TMP, ignore_errors=True)  # whatever is left there has no manifest
    return done


def read_manifest(path: Path) -> Plan:
    """The plan a manifest records; raises PipelineError when it cannot be read."""
    try:
        content = json.loads(path.read_text())
        return Plan(path.parent, path.name[len(".compact-"):-len(".json")], tuple(content["inputs"]), content["rows"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PipelineError(f"cannot read the compaction manifest {path} ({exc}); move it away and check "
                            "the hour's files by hand") from exc


def hours_to_compact(lake: Path, before: datetime) -> list[Path]:
    """The hour directories of ``lake`` whose hour ended at or before ``before``, oldest first."""
    found = []
    for hour_dir in sorted(lake.glob("date=*/hour=*")):
        try:
            start = datetime.strptime(f"{hour_dir.parent.name}/{hour_dir.name}", "date=%Y-%m-%d/hour=%H")
        except ValueError:
            continue
        if hour_dir.is_dir() and start.replace(tzinfo=UTC) + timedelta(hours=1) <= before:
            found.append(hour_dir)
    return found


def newest_files(lake: Path) -> set[Path]:
    """The files of the newest position of each exporter stream in the lake (one per hour the batch spans)."""
    newest: dict[str, tuple[AckRef, list[Path]]] = {}
    for path in lake.glob("date=*/hour=*/part-*.parquet"):
        if (found := part_position(path.name)) is None:
            continue
        stream, position = found
        best = newest.get(stream)
        if best is None or position > best[0]:
            newest[stream] = (position, [path])
        elif position == best[0]:
            best[1].append(path)
    return {path for _, paths in newest.values() for path in paths}


def plan_hour(hour_dir: Path, keep: set[Path]) -> Plan | None:
    """The compaction of ``hour_dir``'s visible Parquet files except ``keep``; None with fewer than two.
    Raises PipelineError naming a file that is not readable Parquet."""
    inputs = sorted(p for p in hour_dir.glob("*.parquet") if p not in keep and p.is_file())
    if len(inputs) < 2:
        return None
    rows = 0
    for path in inputs:
        try:
            rows += pq.ParquetFile(path).metadata.num_rows
        except (OSError, pa.ArrowException) as exc:
            raise PipelineError(f"cannot compact {path}: {exc}; move it out of the lake") from exc
    return Plan(hour_dir, uuid.uuid4().hex[:16], tuple(p.name for p in inputs), rows)


def begin(plan: Plan) -> None:
    """Step 2: write the manifest (durably)."""
    write_atomically(plan.manifest, json.dumps({"inputs": list(plan.inputs), "rows": plan.rows}).encode(),
                     hidden_temp=True)


def write_output(spark: SparkSession, lake: Path, plan: Plan) -> None:
    """Step 3: Spark writes the inputs as one sorted Parquet file, renamed to the hidden output. Raises
    PipelineError when Spark fails or the file does not hold exactly the inputs' rows (nothing is
    committed then: the next run undoes it)."""
    spark_dir = plan.spark_dir(lake)
    uris = [f"file://{(plan.hour_dir / name).resolve()}" for name in plan.inputs]  # as_uri() would quote '=' 
    try:
        (spark.read.schema(EVENTS_DDL).parquet(*uris).select(*COLUMNS).coalesce(1).sortWithinPartitions("ts_ms")
         .write.option("compression", "zstd").mode("overwrite").parquet(f"file://{spark_dir.resolve()}"))
    except SPARK_ERRORS as exc:
        raise PipelineError(f"compaction of {plan.describe()} failed in Spark: {spark_error_message(exc)}") from exc
    written = sorted(spark_dir.glob("part-*.parquet"))
    rows = sum(pq.ParquetFile(path).metadata.num_rows for path in written)
    if len(written) != 1 or rows != plan.rows:
        raise PipelineError(f"compaction of {plan.describe()}: Spark wrote {len(written)} file(s) with {rows} rows "
                            f"for {plan.rows} input rows; nothing was changed")
    with open(written[0], "rb") as f:
        os.fsync(f.fileno())
    os.replace(written[0], plan.hidden_output)
    fsync_dir(plan.hour_dir)
    shutil.rmtree(spark_dir)


def finish(plan: Plan) -> None:
    """Step 4 (also after a crash inside it): delete the inputs, show the output, delete the manifest."""
    for name in plan.inputs:
        (plan.hour_dir / name).unlink(missing_ok=True)
    fsync_dir(plan.hour_dir)
    if plan.hidden_output.exists():
        os.replace(plan.hidden_output, plan.output)
        fsync_dir(plan.hour_dir)
    plan.manifest.unlink()
    fsync_dir(plan.hour_dir)


def undo(lake: Path, plan: Plan) -> None:
    """Forget a compaction that did not reach its commit point: its Spark output, then its manifest."""
    shutil.rmtree(plan.spark_dir(lake), ignore_errors=True)
    plan.manifest.unlink()
    fsync_dir(plan.hour_dir)


def compact_hour(spark: SparkSession, lake: Path, plan: Plan) -> str:
    """Run steps 2 to 4 for ``plan``; returns a line saying what was merged. Raises PipelineError (Spark
    failed: undone at once) or OSError (a re-run finishes or undoes it)."""
    begin(plan)
    try:
        write_output(spark, lake, plan)
    except PipelineError:
        undo(lake, plan)
        raise
    finish(plan)
    return f"{plan.describe()}: {len(plan.inputs)} files, {plan.rows} rows -> {plan.output.name}"


def compact_lake(lake: Path, master: str, *, hour: datetime | None = None, before: datetime | None = None,
                 now: datetime | None = None, verbose: bool = False, echo: Callable[[str], None] = print) -> int:
    """Compact ``lake``: resolve interrupted compactions, then merge each finished hour (``hour`` alone, or
    every hour that ended by ``before``, default ``now`` - 1 h) holding two files or more, printing one
    line per hour through ``echo``. Spark (on ``master``) starts only when there is something to merge.
    Returns the number of hours compacted. Raises PipelineError for an hour or ``before`` later than
    ``now`` - 1 h, a second compaction on the lake, or a failed Spark job; OSError for file failures.
    """
    latest = (now or datetime.now(UTC)) - FINISHED_AFTER
    if hour is not None and hour + timedelta(hours=1) > latest:
        raise PipelineError(f"hour {hour:{HOUR_FORMAT}} is not finished: an hour is compacted once it ended at "
                            f"least {FINISHED_AFTER} ago")
    if before is not None and before > latest:
        raise PipelineError(f"--before {before:{HOUR_FORMAT}} is too late: an hour is compacted once it ended at "
                            f"least {FINISHED_AFTER} ago (now that is {latest:%Y-%m-%d %H:%M} UTC)")
    with locked(lake):
        for line in recover(lake):
            echo(line)
        if hour is not None:
            hour_dirs = [lake / f"date={hour:%Y-%m-%d}" / f"hour={hour:%H}"]
        else:
            hour_dirs = hours_to_compact(lake, before or latest)
        keep = newest_files(lake)
        plans = [plan for hour_dir in hour_dirs if hour_dir.is_dir() and (plan := plan_hour(hour_dir, keep))]
        if not plans:
            echo(f"nothing to compact: no finished hour of {lake} holds more than one file to merge")
            return 0
        with spark_session(master, "ecq-pipeline-compact", verbose) as spark:
            for plan in plans:
                echo(compact_hour(spark, lake, plan))
        (lake / SPARK_TMP).rmdir()
    return len(plans)
