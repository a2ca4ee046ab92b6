"""``ecq pipeline``: the PySpark jobs (added to the ``ecq`` command by ecq/cli.py).

- ``ecq pipeline report --lake DIR [--master URL] [--out DIR]``: tables and an HTML page about the queues.
- ``ecq pipeline compact --lake DIR [--hour YYYY-MM-DD/HH | --before YYYY-MM-DD/HH]``: merge the
  files of each finished hour partition into one.
- ``ecq pipeline load --input PATH --format parquet|csv|json --broker HOST:PORT [--master URL]``: publish
  rows as ECQ writes.

All run on ``local[*]`` by default; pass ``--master spark://HOST:PORT`` for a standalone cluster.
Exit codes: 0 ok; 1 the job failed or found bad data (no Java, no events, unreadable or malformed input,
rows that could not be published), with one line saying why; 2 usage error (missing option, a path that
does not exist, bad HOST:PORT) or the ``pipeline`` extra (PySpark, matplotlib) is not installed.

The jobs are imported inside the commands, so that ``ecq`` works without the extra.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import click

from ecq.config import split_host_port
from ecq.pipeline import PipelineError


@click.group()
def pipeline() -> None:
    """PySpark jobs over ECQ queues: report on the event lake, load datasets into queues."""


@contextmanager
def pipeline_extra() -> Iterator[None]:
    """Wrap the imports of the jobs: when one fails (PySpark, py4j or matplotlib missing or broken), print
    which extra to install and the import error, and exit 2 (click.exceptions.Exit) instead of a traceback."""
    try:
        yield
    except ImportError as exc:
        click.echo("Error: ecq pipeline needs the optional 'pipeline' dependencies (PySpark, matplotlib): "
                   f"pip install 'ecq[pipeline]', or scripts/setup pipeline in a checkout (import failed: {exc})",
                   err=True)
        raise click.exceptions.Exit(2) from exc


MASTER = click.option("--master", default="local[*]", show_default=True,
                      help="Spark master: local[N], local[*] or spark://HOST:PORT")
VERBOSE = click.option("-v", "--verbose", is_flag=True, help="show Spark's own log (WARN and above)")


@pipeline.command()
@click.option("--lake", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="event lake written by the broker (its lake_dir, default <data_dir>/lake)")
@MASTER
@click.option("--out", default=Path("storage/report"), show_default=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="where the Parquet tables and report.html go (replaced)")
@VERBOSE
def report(lake: Path, master: str, out: Path, verbose: bool) -> None:
    """Per-consumer backlog, delivery and end-to-end latency, redeliveries, compaction; traffic; fleet summary.

    Writes the tables as Parquet under OUT, renders OUT/report.html and prints a summary.
    """
    with pipeline_extra():
        from ecq.pipeline.report import run_report

    try:
        text = run_report(lake, out, master, verbose)
    except PipelineError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(text)


def _hour(_ctx: click.Context, _param: click.Parameter, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        return datetime.strptime(value, "%Y-%m-%d/%H").replace(tzinfo=UTC)
    except ValueError as exc:
        raise click.BadParameter(f"{value!r} is not YYYY-MM-DD/HH (UTC), e.g. 2026-01-31/07") from exc


@pipeline.command()
@click.option("--lake", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="event lake written by the broker (its lake_dir, default <data_dir>/lake)")
@click.option("--hour", callback=_hour, help="compact this hour only, YYYY-MM-DD/HH (UTC); it must have ended "
              "at least an hour ago")
@click.option("--before", callback=_hour, help="compact every hour that ended by YYYY-MM-DD/HH (UTC) "
              "[default: an hour ago, also the latest allowed]")
@MASTER
@VERBOSE
def compact(lake: Path, hour: datetime | None, before: datetime | None, master: str, verbose: bool) -> None:
    """Merge the files of each finished hour partition into one Parquet file, exactly once.

    A re-run after a crash first finishes or undoes the interrupted compaction. Readers never see a row
    twice; during a compaction they may briefly miss some rows of that hour.
    """
    if hour is not None and before is not None:
        raise click.UsageError("give --hour or --before, not both")
    with pipeline_extra():
        from ecq.pipeline.compact import compact_lake

    try:
        compact_lake(lake, master, hour=hour, before=before, verbose=verbose, echo=click.echo)
    except (PipelineError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc


def _host_port(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[str, int]:
    try:
        return split_host_port(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@pipeline.command()
@click.option("--input", "input_path", required=True, type=click.Path(exists=True, path_type=Path),
              help="a file or a directory of files with columns clientid, key, payload")
@click.option("--format", "fmt", required=True, type=click.Choice(["parquet", "csv", "json"]),
              help="input format (csv: with a header line; json: one object per line)")
@click.option("--broker", required=True, callback=_host_port, help="HOST:PORT of the MQTT broker")
@MASTER
@click.option("--partitions", type=click.IntRange(min=1), default=None,
              help="MQTT connections publishing in parallel (default: Spark's default parallelism)")
@click.option("--progress", "progress_s", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="seconds between progress lines on stderr while publishing; 0 = none")
@VERBOSE
def load(input_path: Path, fmt: str, broker: tuple[str, int], master: str, partitions: int | None,
         progress_s: float, verbose: bool) -> None:
    """Publish each row (clientid, key, payload) as a QoS 1 write to $ECQ/w/<clientid>/<key>.

    One client's rows keep their input order. Re-running is safe: queues keep the newest value per key.
    The rate printed is over the publishing phase only (first PUBLISH to last PUBACK).
    """
    started_at = time.time()
    with pipeline_extra():
        from ecq.pipeline.load import Target
        from ecq.pipeline.load import load as load_rows
        from ecq.pipeline.spark import spark_session

    host, port = broker
    try:
        with spark_session(master, "ecq-pipeline-load", verbose) as spark:
            result = load_rows(spark, input_path, fmt, Target(host, port), partitions, started_at=started_at,
                               progress_every_s=progress_s, echo=lambda line: click.echo(line, err=True))
    except PipelineError as exc:
        raise click.ClickException(str(exc)) from exc
    # three significant figures below 1 s: "0.002" for 1.56 ms would disagree with the rate printed beside it
    seconds = f"{result.publish_seconds:.2f}" if result.publish_seconds >= 1 else f"{result.publish_seconds:.3g}"
    click.echo(f"published {result.published} of {result.rows} rows to {host}:{port} in {seconds} s "
               f"({result.rate:.0f} rows/s); Spark start-up and read "
               f"{result.startup_seconds:.1f} s; failed {result.failed}")
    for error in result.errors:
        click.echo(f"  error: {error}", err=True)
    if result.failed:
        raise click.ClickException(f"{result.failed} row(s) were not acknowledged by the broker; "
                                   "running the same load again is safe")
