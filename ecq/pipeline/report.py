"""``ecq pipeline report``: what the queues did, computed with Spark from the event lake.

Definitions (times in ms since the epoch, latencies in ms, per clientid = per consumer queue):

- backlog: messages appended and not yet removed, where removed means acked, expired, or deleted by
  compaction (the ``replaced_seqno`` of a ``compacted`` event). Only what the lake saw counts: a message
  appended before events were recorded, or whose event was dropped by the buffer, is not in the backlog.
- acks: the first ``acked`` event of each (clientid, seqno); a repeated ack is not counted again.
- delivery latency: ``ack ts_ms - publish_ts_ms`` over those acks; p50/p95/p99 come from Spark's
  ``percentile_approx`` with accuracy 10,000 (rank error at most 1/10,000 of the count; each is a
  latency that occurred), max is exact.
- redeliveries: ``delivered`` events with ``attempt >= 2``.
- compaction ratio: ``compacted / appended``, the share of writes that replaced an older value.
- per minute (UTC minutes, every minute from the first event to the last): writes (``appended``),
  deliveries (all attempts), acks, and the fleet backlog at the end of the minute.

Output tables under ``--out`` (Parquet, one directory each): consumers, per_minute, fleet (one row),
refused_reasons, latency_histogram; plus report.html (ecq.pipeline.render).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from ecq.pipeline import PipelineError
from ecq.pipeline.render import TABLE_ROWS, render_html, utc, write_html
from ecq.pipeline.spark import SPARK_ERRORS, check_lake, read_events, spark_error_message, spark_session

PERCENTILES = (0.5, 0.95, 0.99)
PERCENTILE_ACCURACY = 10_000
MS_PER_MINUTE = 60_000
HISTOGRAM_BUCKETS_PER_DECADE = 4  # latency histogram: 4 buckets per power of ten (1, 1.8, 3.2, 5.6, 10 ...)
HTML_NAME = "report.html"


@dataclass
class Report:
    """The report's tables (Spark DataFrames computed from the cached ``events``; call `unpersist` when done).

    - consumers: clientid, appended, compacted, compaction_ratio, delivered, redeliveries, acked, expired,
      refused, backlog, latency_p50_ms, latency_p95_ms, latency_p99_ms, latency_max_ms, first_event_ms,
      last_event_ms. One row per clientid seen in any event (refused writes included).
    - per_minute: minute_ms, writes, deliveries, acks, backlog.
    - fleet: one row: consumers, consumers_with_backlog, events, appended, compacted, compaction_ratio,
      delivered, redeliveries, acked, expired, refused, backlog, latency_*_ms, first_event_ms, last_event_ms.
    - refused_reasons: reason, refused.
    - latency_histogram: bucket, lower_ms, upper_ms, acks (latencies in [lower_ms, upper_ms)).
    """

    consumers: DataFrame
    per_minute: DataFrame
    fleet: DataFrame
    refused_reasons: DataFrame
    latency_histogram: DataFrame
    events: DataFrame

    def tables(self) -> dict[str, DataFrame]:
        """Table name -> DataFrame, in output order."""
        return {"consumers": self.consumers, "per_minute": self.per_minute, "fleet": self.fleet,
                "refused_reasons": self.refused_reasons, "latency_histogram": self.latency_histogram}

    def unpersist(self) -> None:
        """Release the cached events."""
        self.events.unpersist()


def compute_report(events: DataFrame) -> Report:
    """All report tables from ``events`` (the columns of ecq.events.schema.SCHEMA, e.g. from read_events)."""
    events = events.cache()
    lifetimes = _lifetimes(events)
    acks = _first_acks(events)
    consumers = _consumers(events, lifetimes, acks)
    return Report(
        consumers=consumers,
        per_minute=_per_minute(events, lifetimes, acks),
        fleet=_fleet(events, consumers, acks),
        refused_reasons=(events.where(_is("refused")).groupBy("reason").agg(F.count("*").alias("refused"))
                         .orderBy(F.desc("refused"), "reason")),
        latency_histogram=_latency_histogram(acks),
        events=events,
    )


def _is(event_type: str) -> Column:
    return F.col("type") == event_type


def _count_if(condition: Column) -> Column:
    return F.count(F.when(condition, True))


def _lifetimes(events: DataFrame) -> DataFrame:
    """(clientid, seqno, appended_ms, removed_ms) per appended message; removed_ms null while queued."""
    appended = events.where(_is("appended")).groupBy("clientid", "seqno").agg(F.min("ts_ms").alias("appended_ms"))
    removals = (events.where(_is("acked") | _is("expired")).select("clientid", "seqno", "ts_ms")
                .unionByName(events.where(_is("compacted"))
                             .select("clientid", F.col("replaced_seqno").alias("seqno"), "ts_ms")))
    removed = removals.groupBy("clientid", "seqno").agg(F.min("ts_ms").alias("removed_ms"))
    return appended.join(removed, ["clientid", "seqno"], "left")


def _first_acks(events: DataFrame) -> DataFrame:
    """(clientid, seqno, ack_ms, latency_ms) for the first ack of each message."""
    return (events.where(_is("acked")).groupBy("clientid", "seqno")
            .agg(F.min("ts_ms").alias("ack_ms"), F.min("publish_ts_ms").alias("publish_ts_ms"))
            .select("clientid", "seqno", "ack_ms", (F.col("ack_ms") - F.col("publish_ts_ms")).alias("latency_ms")))


def _latency_aggregates() -> list[Column]:
    return [F.percentile_approx("latency_ms", list(PERCENTILES), PERCENTILE_ACCURACY).alias("_p"),
            F.max("latency_ms").alias("latency_max_ms")]


def _latency_columns() -> list[Column]:
    names = [f"latency_p{round(p * 100)}_ms" for p in PERCENTILES]
    return [F.col("_p")[i].alias(name) for i, name in enumerate(names)] + [F.col("latency_max_ms")]


def _consumers(events: DataFrame, lifetimes: DataFrame, acks: DataFrame) -> DataFrame:
    counts = events.where(F.col("clientid").isNotNull()).groupBy("clientid").agg(
        _count_if(_is("appended")).alias("appended"),
        _count_if(_is("compacted")).alias("compacted"),
        _count_if(_is("delivered")).alias("delivered"),
        _count_if(_is("delivered") & (F.col("attempt") >= 2)).alias("redeliveries"),
        _count_if(_is("expired")).alias("expired"),
        _count_if(_is("refused")).alias("refused"),
        F.min("ts_ms").alias("first_event_ms"),
        F.max("ts_ms").alias("last_event_ms"))
    backlog = lifetimes.where(F.col("removed_ms").isNull()).groupBy("clientid").agg(F.count("*").alias("backlog"))
    latency = (acks.groupBy("clientid").agg(F.count("*").alias("acked"), *_latency_aggregates())
               .select("clientid", "acked", *_latency_columns()))
    return (counts.join(backlog, "clientid", "left").join(latency, "clientid", "left")
            .fillna(0, ["backlog", "acked"])
            .withColumn("compaction_ratio", _ratio("compacted", "appended"))
            .select("clientid", "appended", "compacted", "compaction_ratio", "delivered", "redeliveries", "acked",
                    "expired", "refused", "backlog", "latency_p50_ms", "latency_p95_ms", "latency_p99_ms",
                    "latency_max_ms", "first_event_ms", "last_event_ms"))


def _ratio(numerator: str, denominator: str) -> Column:
    return F.when(F.col(denominator) > 0, F.col(numerator) / F.col(denominator))


def _minute(ts: str | Column) -> Column:
    """The start of the UTC minute of ``ts`` (ms), named minute_ms."""
    ts = F.col(ts) if isinstance(ts, str) else ts
    return (F.floor(ts / MS_PER_MINUTE) * MS_PER_MINUTE).cast("long").alias("minute_ms")


def _per_minute(events: DataFrame, lifetimes: DataFrame, acks: DataFrame) -> DataFrame:
    measures = ("writes", "deliveries", "acks", "backlog_delta")

    def counted(frame: DataFrame, ts: str, measure: str, sign: int = 1) -> DataFrame:
        zeros = [F.lit(0).cast("long").alias(m) for m in measures if m != measure]
        return frame.select(_minute(ts), F.lit(sign).cast("long").alias(measure), *zeros).select("minute_ms", *measures)

    parts = [counted(events.where(_is("appended")), "ts_ms", "writes"),
             counted(events.where(_is("delivered")), "ts_ms", "deliveries"),
             counted(acks, "ack_ms", "acks"),
             counted(lifetimes, "appended_ms", "backlog_delta"),
             counted(lifetimes.where(F.col("removed_ms").isNotNull()), "removed_ms", "backlog_delta", -1)]
    combined = parts[0]
    for part in parts[1:]:
        combined = combined.unionByName(part)
    sums = combined.groupBy("minute_ms").agg(*(F.sum(m).alias(m) for m in measures))
    every_minute = (events.agg(_minute(F.min("ts_ms")).alias("lo"), _minute(F.max("ts_ms")).alias("hi"))
                    .select(F.explode(F.sequence("lo", "hi", F.lit(MS_PER_MINUTE).cast("long"))).alias("minute_ms")))
    running = Window.orderBy("minute_ms").rowsBetween(Window.unboundedPreceding, Window.currentRow)
    return (every_minute.join(sums, "minute_ms", "left").fillna(0, list(measures))
            .withColumn("backlog", F.sum("backlog_delta").over(running))
            .select("minute_ms", "writes", "deliveries", "acks", "backlog")
            .orderBy("minute_ms"))


def _fleet(events: DataFrame, consumers: DataFrame, acks: DataFrame) -> DataFrame:
    sums = consumers.agg(
        F.count("*").alias("consumers"),
        _count_if(F.col("backlog") > 0).alias("consumers_with_backlog"),
        *(F.sum(c).alias(c) for c in ("appended", "compacted", "delivered", "redeliveries", "acked", "expired",
                                      "backlog")))
    totals = events.agg(F.count("*").alias("events"), _count_if(_is("refused")).alias("refused"),
                        F.min("ts_ms").alias("first_event_ms"), F.max("ts_ms").alias("last_event_ms"))
    latency = acks.agg(*_latency_aggregates()).select(*_latency_columns())
    return (sums.crossJoin(totals).crossJoin(latency)
            .withColumn("compaction_ratio", _ratio("compacted", "appended"))
            .select("consumers", "consumers_with_backlog", "events", "appended", "compacted", "compaction_ratio",
                    "delivered", "redeliveries", "acked", "expired", "refused", "backlog", "latency_p50_ms",
                    "latency_p95_ms", "latency_p99_ms", "latency_max_ms", "first_event_ms", "last_event_ms"))


def _latency_histogram(acks: DataFrame) -> DataFrame:
    """Acks per latency bucket; bucket b holds latencies L with floor(log10(L + 1) * 4) == b."""
    per_decade = float(HISTOGRAM_BUCKETS_PER_DECADE)
    bucket = F.floor(F.log10(F.greatest(F.col("latency_ms"), F.lit(0)) + 1) * per_decade).cast("int")

    def edge(b: Column) -> Column:
        return F.ceil(F.pow(F.lit(10.0), b / per_decade) - 1).cast("long")

    return (acks.groupBy(bucket.alias("bucket")).agg(F.count("*").alias("acks"))
            .select("bucket", edge(F.col("bucket")).alias("lower_ms"), edge(F.col("bucket") + 1).alias("upper_ms"),
                    "acks")
            .orderBy("bucket"))


def check_out_dir(out: Path, lake: Path) -> None:
    """Raise PipelineError when ``out`` is the lake or inside it (the next report would read it as events)."""
    out_abs, lake_abs = out.resolve(), lake.resolve()
    if out_abs == lake_abs or lake_abs in out_abs.parents:
        raise PipelineError(f"--out {out} is inside the lake {lake}; write the report elsewhere")


def write_tables(report: Report, out: Path) -> dict[str, Path]:
    """Write every table as Parquet under ``out/<name>/`` (replacing an earlier report); returns name -> dir."""
    paths = {}
    for name, table in report.tables().items():
        path = out / name
        table.coalesce(1).write.mode("overwrite").parquet(path.resolve().as_uri())
        paths[name] = path
    return paths


def read_table(out: Path, name: str) -> pa.Table:
    """A table written by `write_tables`, read back with pyarrow (Spark's _SUCCESS and .crc files skipped)."""
    return pq.read_table(out / name)


def top_consumers(out: Path, limit: int) -> list[dict[str, Any]]:
    """The ``limit`` consumers with the largest backlog (then the slowest p99, then by clientid), as dicts."""
    consumers = read_table(out, "consumers").sort_by(
        [("backlog", "descending"), ("latency_p99_ms", "descending"), ("clientid", "ascending")])
    return consumers.slice(0, limit).to_pylist()


def summary(fleet: dict[str, Any], top_backlog: list[dict[str, Any]]) -> str:
    """A few lines for the terminal: volumes, backlog, latency, the consumers with the largest backlog."""
    def ms(value: Any) -> str:
        return "-" if value is None else f"{value} ms"

    ratio = "-" if fleet["compaction_ratio"] is None else f"{fleet['compaction_ratio']:.2f}"
    lines = [
        f"events {fleet['events']} from {utc(fleet['first_event_ms'])} to {utc(fleet['last_event_ms'])}",
        f"consumers {fleet['consumers']} ({fleet['consumers_with_backlog']} with backlog), "
        f"backlog {fleet['backlog']} messages",
        f"writes {fleet['appended']}, compactions {fleet['compacted']} (ratio {ratio}), deliveries "
        f"{fleet['delivered']} ({fleet['redeliveries']} redeliveries), acks {fleet['acked']}, expired "
        f"{fleet['expired']}, refused {fleet['refused']}",
        f"latency append->ack p50 {ms(fleet['latency_p50_ms'])}, p95 {ms(fleet['latency_p95_ms'])}, "
        f"p99 {ms(fleet['latency_p99_ms'])}, max {ms(fleet['latency_max_ms'])}",
    ]
    backlogged = [c for c in top_backlog if c["backlog"]]
    if backlogged:
        lines.append("largest backlog: " + ", ".join(f"{c['clientid']} {c['backlog']}" for c in backlogged[:5]))
    return "\n".join(lines)


def run_report(lake: Path, out: Path, master: str, verbose: bool = False) -> str:
    """``ecq pipeline report``: compute the report from ``lake`` on ``master``, write the tables and the
    HTML page under ``out``; returns the summary text (with where things went).

    Raises PipelineError for a missing or empty lake, ``out`` inside the lake, missing Java, or a Spark
    failure (e.g. a corrupt lake file), with Spark's reason.
    """
    check_lake(lake)
    check_out_dir(out, lake)
    with spark_session(master, "ecq-pipeline-report", verbose) as spark:
        report = None
        try:
            report = compute_report(read_events(spark, lake))
            paths = write_tables(report, out)
        except SPARK_ERRORS as exc:
            raise PipelineError(f"report on {lake} failed in Spark: {spark_error_message(exc)}") from exc
        finally:
            if report is not None:
                report.unpersist()
    fleet = read_table(out, "fleet").to_pylist()[0]
    top = top_consumers(out, TABLE_ROWS)
    page = render_html(fleet, top, read_table(out, "per_minute").to_pylist(),
                       read_table(out, "latency_histogram").to_pylist(),
                       read_table(out, "refused_reasons").to_pylist(), str(lake))
    html_path = write_html(page, out / HTML_NAME)
    return "\n".join([summary(fleet, top), f"tables: {', '.join(str(p) for p in paths.values())}",
                      f"page: {html_path}"])
