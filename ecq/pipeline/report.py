"""``ecq pipeline report``: what the queues did, computed with Spark from the event lake.

Definitions (times in ms since the epoch, latencies in ms, per clientid = per consumer queue):

- a message is (clientid, seqno, publish_ts_ms), not (clientid, seqno): a queue that state GC forgot starts
  again at seqno 1 (docs/topics.md), so one seqno can name several messages of a queue over the lake's life.
  A ``compacted`` event names the message it removed by ``replaced_seqno`` only: it removes the latest message
  of that seqno appended at or before it.
- backlog: messages appended and not yet removed, where removed means acked, expired, evicted by a queue
  quota, or deleted by compaction (the ``replaced_seqno`` of a ``compacted`` event). Only what the lake saw counts: a message
  appended before events were recorded, or whose event was dropped by the buffer, is not in the backlog.
- acks: the first ``acked`` event of each message; a repeated ack (after a rewind) is not counted again.
- delivery latency (``delivery_*_ms``): from the send that was acked to the ack: ``ack ts_ms`` minus the
  ``ts_ms`` of the last ``delivered`` event of the same message at or before the ack. What the
  consumer and the network took; null for an ack whose send the lake did not see.
- end-to-end latency (``end_to_end_*_ms``): from the append to the ack, ``ack ts_ms - publish_ts_ms``,
  including any time the consumer was offline or the message waited behind others.
- p50/p95/p99 come from Spark's ``percentile_approx`` with accuracy 10,000 (rank error at most 1/10,000
  of the count; each is a latency that occurred); max is exact.
- latency histogram: integer bucket edges 0, 1, 2, 5, 10, 20, 50, 100, ... ms (1-2-5 per decade, up to
  10^12 ms); a latency L is in the bucket with lower_ms <= L < upper_ms (negative ones count as 0).
- redeliveries: ``delivered`` events with ``attempt >= 2``.
- compaction ratio: ``compacted / appended``, the share of writes that replaced an older value.
- over time: every time bucket (UTC-aligned) from the first event to the last: writes (``appended``),
  deliveries (all attempts), acks, and the fleet backlog at the end of the bucket. The bucket is the finest
  of 1 s, 1 min and 1 h that gives at most 1,800 buckets (`time_bucket_s`): seconds for up to about 30
  minutes of data, minutes for up to about 30 hours, hours beyond.

Kinds: every table above counts ECQ queues only (rows of kind ``ecq``); an SCQ (``kind`` ``scq``, a shared
compacted queue read by many readers) has one row in ``scq_queues`` instead, so its deliveries to thousands of
readers inflate no consumer's figures. Files written before the ``kind`` column have it null: an event whose
clientid starts ``$SCQ/`` is an SCQ's, any other an ECQ queue's.

Output tables under ``--out`` (Parquet, one directory each): consumers, over_time, fleet (one row),
refused_reasons, latency_histogram, scq_queues; plus report.html (ecq.pipeline.render).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from ecq.pipeline import PipelineError
from ecq.pipeline.render import TABLE_ROWS, render_html, utc, write_html
from ecq.pipeline.spark import (SPARK_ERRORS, check_lake, lake_bytes, read_events, spark_error_message,
                                spark_session)
from ecq.queue.topics import SCQ_PREFIX, printable

PERCENTILES = (0.5, 0.95, 0.99)
PERCENTILE_ACCURACY = 10_000
LATENCIES = {"delivery": "delivery_ms", "end_to_end": "end_to_end_ms"}  # column prefix -> per-ack column
LATENCY_COLUMNS = tuple(f"{name}_{stat}_ms" for name in LATENCIES
                        for stat in [f"p{round(p * 100)}" for p in PERCENTILES] + ["max"])
LATENCY_EDGES_MS = (0, *(m * 10**e for e in range(12) for m in (1, 2, 5)), 10**12)  # 0, 1, 2, 5, 10, 20, ...
TIME_BUCKETS_S = (1, 60, 3600)
MAX_TIME_BUCKETS = 1_800
HTML_NAME = "report.html"
MESSAGE = ("clientid", "seqno", "publish_ts_ms")  # what names one message in the lake (see the definitions above)


@dataclass
class Report:
    """The report's tables (Spark DataFrames computed from the cached ``events``; call `unpersist` when done).

    - consumers: clientid, appended, compacted, compaction_ratio, delivered, redeliveries, acked, expired,
      refused, backlog, delivery_{p50,p95,p99,max}_ms, end_to_end_{p50,p95,p99,max}_ms, first_event_ms,
      last_event_ms. One row per clientid seen in any event (refused writes included).
    - over_time: start_ms (UTC-aligned start of the bucket), bucket_s (its length in seconds, the same in
      every row, see `time_bucket_s`), writes, deliveries, acks, backlog (at the end of the bucket).
    - fleet: one row: consumers, consumers_with_backlog, events, appended, compacted, compaction_ratio,
      delivered, redeliveries, acked, expired, refused, backlog, delivery_*_ms, end_to_end_*_ms,
      first_event_ms, last_event_ms.
    - refused_reasons: reason, refused.
    - scq_queues: queue (the SCQ's name), appended, compacted, readers (distinct readers, a client id or
      ``$share/<group>``, with a delivery, ack or rewind in the lake), delivered, redeliveries, acked (acks by every
      reader), fan_out (acked / appended: the readers each write reached, on average; null without writes),
      refused, first_event_ms, last_event_ms; by queue name.
    - latency_histogram: bucket (index into LATENCY_EDGES_MS), lower_ms, upper_ms, delivery_acks,
      end_to_end_acks (acks whose latency L has lower_ms <= L < upper_ms); every bucket from the lowest to
      the highest one holding an ack of either kind, empty ones with 0.
    """

    consumers: DataFrame
    over_time: DataFrame
    fleet: DataFrame
    refused_reasons: DataFrame
    latency_histogram: DataFrame
    scq_queues: DataFrame
    events: DataFrame

    def tables(self) -> dict[str, DataFrame]:
        """Table name -> DataFrame, in output order."""
        return {"consumers": self.consumers, "over_time": self.over_time, "fleet": self.fleet,
                "refused_reasons": self.refused_reasons, "latency_histogram": self.latency_histogram,
                "scq_queues": self.scq_queues}

    def unpersist(self) -> None:
        """Release the cached events."""
        self.events.unpersist()


def compute_report(events: DataFrame) -> Report:
    """All report tables from ``events`` (the columns of ecq.events.schema.SCHEMA, e.g. from read_events).

    Runs one Spark job at once (the time span of the events, to choose the over_time bucket); the tables
    are computed when read.
    """
    events = _with_kind(events).cache()
    first_ms, last_ms = events.agg(F.min("ts_ms"), F.max("ts_ms")).first()
    ecq = events.where(F.col("kind") == "ecq")
    lifetimes = _lifetimes(ecq)
    acks = _acks(ecq)
    consumers = _consumers(ecq, lifetimes, acks)
    return Report(
        consumers=consumers,
        over_time=_over_time(ecq, lifetimes, acks, time_bucket_s(first_ms, last_ms)),
        fleet=_fleet(events, consumers, acks),
        refused_reasons=(ecq.where(_is("refused")).groupBy("reason").agg(F.count("*").alias("refused"))
                         .orderBy(F.desc("refused"), "reason")),
        latency_histogram=_latency_histogram(acks),
        scq_queues=_scq_queues(events.where(F.col("kind") == "scq")),
        events=events,
    )


def _with_kind(events: DataFrame) -> DataFrame:
    """``events`` with ``kind`` set on every row: as recorded, or, in files written before the column, ``scq`` for a
    clientid under ``$SCQ/`` and ``ecq`` for any other (see the module docstring)."""
    from_clientid = F.when(F.col("clientid").startswith(SCQ_PREFIX), F.lit("scq")).otherwise(F.lit("ecq"))
    return events.withColumn("kind", F.coalesce(F.col("kind"), from_clientid))


def time_bucket_s(first_ms: int | None, last_ms: int | None) -> int:
    """The over_time bucket length in seconds for events from ``first_ms`` to ``last_ms`` (ms since the
    epoch): the first of TIME_BUCKETS_S (1 s, 1 min, 1 h) giving at most MAX_TIME_BUCKETS (1,800) UTC-aligned
    buckets, else 1 h. So 2 minutes of data get seconds, 3 hours minutes, 3 days hours. 1 s without events."""
    if first_ms is None or last_ms is None:
        return TIME_BUCKETS_S[0]
    for bucket_s in TIME_BUCKETS_S:
        bucket_ms = bucket_s * 1000
        if last_ms // bucket_ms - first_ms // bucket_ms + 1 <= MAX_TIME_BUCKETS:
            return bucket_s
    return TIME_BUCKETS_S[-1]


def _is(event_type: str) -> Column:
    return F.col("type") == event_type


def _count_if(condition: Column) -> Column:
    return F.count(F.when(condition, True))


def _lifetimes(events: DataFrame) -> DataFrame:
    """(clientid, seqno, publish_ts_ms, appended_ms, removed_ms) per appended message; removed_ms null while
    queued. A compaction removes the latest message of its ``replaced_seqno`` appended at or before it."""
    appended = events.where(_is("appended")).groupBy(*MESSAGE).agg(F.min("ts_ms").alias("appended_ms"))
    removed = (events.where(_is("acked") | _is("expired") | _is("evicted")).groupBy(*MESSAGE)
               .agg(F.min("ts_ms").alias("removed_ms")))
    compactions = events.where(_is("compacted")).select("clientid", F.col("replaced_seqno").alias("seqno"),
                                                         F.col("ts_ms").alias("compacted_ms"))
    latest_before = (compactions.join(appended, ["clientid", "seqno"])
                     .where(F.col("appended_ms") <= F.col("compacted_ms"))
                     .groupBy("clientid", "seqno", "compacted_ms")
                     .agg(F.max_by("publish_ts_ms", "appended_ms").alias("publish_ts_ms")))
    compacted = latest_before.groupBy(*MESSAGE).agg(F.min("compacted_ms").alias("compacted_ms"))
    return (appended.join(removed, list(MESSAGE), "left").join(compacted, list(MESSAGE), "left")
            .select(*MESSAGE, "appended_ms", F.least("removed_ms", "compacted_ms").alias("removed_ms")))


def _acks(events: DataFrame) -> DataFrame:
    """(clientid, seqno, publish_ts_ms, ack_ms, delivery_ms, end_to_end_ms) for the first ack of each message;
    delivery_ms is null when no send of it at or before the ack is in the lake."""
    first = events.where(_is("acked")).groupBy(*MESSAGE).agg(F.min("ts_ms").alias("ack_ms"))
    sends = events.where(_is("delivered")).select(*MESSAGE, F.col("ts_ms").alias("sent_ms"))
    acked_send = (first.join(sends, list(MESSAGE)).where(F.col("sent_ms") <= F.col("ack_ms"))
                  .groupBy(*MESSAGE).agg(F.max("sent_ms").alias("sent_ms")))
    return (first.join(acked_send, list(MESSAGE), "left")
            .select(*MESSAGE, "ack_ms", (F.col("ack_ms") - F.col("sent_ms")).alias("delivery_ms"),
                    (F.col("ack_ms") - F.col("publish_ts_ms")).alias("end_to_end_ms")))


def _latency_aggregates() -> list[Column]:
    aggregates = []
    for name, column in LATENCIES.items():
        aggregates += [F.percentile_approx(column, list(PERCENTILES), PERCENTILE_ACCURACY).alias(f"_{name}_p"),
                       F.max(column).alias(f"{name}_max_ms")]
    return aggregates


def _latency_columns() -> list[Column]:
    columns = []
    for name in LATENCIES:
        columns += [F.col(f"_{name}_p")[i].alias(f"{name}_p{round(p * 100)}_ms") for i, p in enumerate(PERCENTILES)]
        columns.append(F.col(f"{name}_max_ms"))
    return columns


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
                    "expired", "refused", "backlog", *LATENCY_COLUMNS, "first_event_ms", "last_event_ms"))


def _ratio(numerator: str, denominator: str) -> Column:
    return F.when(F.col(denominator) > 0, F.col(numerator) / F.col(denominator))


def _over_time(events: DataFrame, lifetimes: DataFrame, acks: DataFrame, bucket_s: int) -> DataFrame:
    measures = ("writes", "deliveries", "acks", "backlog_delta")
    bucket_ms = bucket_s * 1000

    def start(ts: Column) -> Column:
        return (F.floor(ts / bucket_ms) * bucket_ms).cast("long").alias("start_ms")

    def counted(frame: DataFrame, ts: str, measure: str, sign: int = 1) -> DataFrame:
        zeros = [F.lit(0).cast("long").alias(m) for m in measures if m != measure]
        return frame.select(start(F.col(ts)), F.lit(sign).cast("long").alias(measure), *zeros).select(
            "start_ms", *measures)

    parts = [counted(events.where(_is("appended")), "ts_ms", "writes"),
             counted(events.where(_is("delivered")), "ts_ms", "deliveries"),
             counted(acks, "ack_ms", "acks"),
             counted(lifetimes, "appended_ms", "backlog_delta"),
             counted(lifetimes.where(F.col("removed_ms").isNotNull()), "removed_ms", "backlog_delta", -1)]
    combined = parts[0]
    for part in parts[1:]:
        combined = combined.unionByName(part)
    sums = combined.groupBy("start_ms").agg(*(F.sum(m).alias(m) for m in measures))
    every_bucket = (events.agg(start(F.min("ts_ms")).alias("lo"), start(F.max("ts_ms")).alias("hi"))
                    .select(F.explode(F.sequence("lo", "hi", F.lit(bucket_ms).cast("long"))).alias("start_ms")))
    running = Window.orderBy("start_ms").rowsBetween(Window.unboundedPreceding, Window.currentRow)
    return (every_bucket.join(sums, "start_ms", "left").fillna(0, list(measures))
            .withColumn("backlog", F.sum("backlog_delta").over(running))
            .select("start_ms", F.lit(bucket_s).alias("bucket_s"), "writes", "deliveries", "acks", "backlog")
            .orderBy("start_ms"))


def _fleet(events: DataFrame, consumers: DataFrame, acks: DataFrame) -> DataFrame:
    sums = consumers.agg(
        F.count("*").alias("consumers"),
        _count_if(F.col("backlog") > 0).alias("consumers_with_backlog"),
        *(F.sum(c).alias(c) for c in ("appended", "compacted", "delivered", "redeliveries", "acked", "expired",
                                      "backlog")))
    totals = events.agg(F.count("*").alias("events"),
                        _count_if(_is("refused") & (F.col("kind") == "ecq")).alias("refused"),
                        F.min("ts_ms").alias("first_event_ms"), F.max("ts_ms").alias("last_event_ms"))
    latency = acks.agg(*_latency_aggregates()).select(*_latency_columns())
    return (sums.crossJoin(totals).crossJoin(latency)
            .withColumn("compaction_ratio", _ratio("compacted", "appended"))
            .select("consumers", "consumers_with_backlog", "events", "appended", "compacted", "compaction_ratio",
                    "delivered", "redeliveries", "acked", "expired", "refused", "backlog", *LATENCY_COLUMNS,
                    "first_event_ms", "last_event_ms"))


def _scq_queues(scq: DataFrame) -> DataFrame:
    """One row per SCQ in the events of kind ``scq`` (see `Report`). The queue is the name after ``$SCQ/`` up to the
    next ``/``: files written before the ``reader`` column name a reader's deliveries by its position id
    (``$SCQ/<queue>/<reader>``)."""
    return (scq.where(F.col("clientid").isNotNull())
            .withColumn("queue", F.regexp_extract("clientid", r"^\$SCQ/([^/]+)", 1))
            .groupBy("queue").agg(
                _count_if(_is("appended")).alias("appended"),
                _count_if(_is("compacted")).alias("compacted"),
                F.countDistinct("reader").alias("readers"),
                _count_if(_is("delivered")).alias("delivered"),
                _count_if(_is("delivered") & (F.col("attempt") >= 2)).alias("redeliveries"),
                _count_if(_is("acked")).alias("acked"),
                _count_if(_is("refused")).alias("refused"),
                F.min("ts_ms").alias("first_event_ms"),
                F.max("ts_ms").alias("last_event_ms"))
            .withColumn("fan_out", _ratio("acked", "appended"))
            .select("queue", "appended", "compacted", "readers", "delivered", "redeliveries", "acked", "fan_out",
                    "refused", "first_event_ms", "last_event_ms")
            .orderBy("queue"))


def _latency_histogram(acks: DataFrame) -> DataFrame:
    """Acks per latency bucket of LATENCY_EDGES_MS, both kinds; the bucket index is found by comparing
    integers with the edges (no logarithm, so 10 ms is in the bucket starting at 10, not 9)."""
    edges = F.array(*(F.lit(edge).cast("long") for edge in LATENCY_EDGES_MS))

    def bucket(column: str) -> Column:
        latency = F.least(F.greatest(F.col(column), F.lit(0)), F.lit(LATENCY_EDGES_MS[-1] - 1))
        return (F.size(F.filter(edges, lambda edge: edge <= latency)) - 1).alias("bucket")

    kinds = [f"{name}_acks" for name in LATENCIES]
    per_kind = [acks.where(F.col(column).isNotNull())
                .select(bucket(column), *(F.lit(int(kind == mine)).alias(kind) for kind in kinds))
                for mine, column in zip(kinds, LATENCIES.values(), strict=True)]
    counts = per_kind[0].unionByName(per_kind[1]).groupBy("bucket").agg(*(F.sum(k).cast("long").alias(k)
                                                                          for k in kinds))
    every_bucket = counts.agg(F.explode(F.sequence(F.min("bucket"), F.max("bucket"))).alias("bucket"))
    return (every_bucket.join(counts, "bucket", "left").fillna(0, kinds)
            .select("bucket", F.element_at(edges, F.col("bucket") + 1).alias("lower_ms"),
                    F.element_at(edges, F.col("bucket") + 2).alias("upper_ms"), *kinds)
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
    """The ``limit`` consumers with the largest backlog (then the slowest end-to-end p99, then by clientid in
    natural order: client3 before client10), as dicts."""
    consumers = read_table(out, "consumers")
    consumers = consumers.append_column("natural", natural_order_key(consumers["clientid"])).sort_by(
        [("backlog", "descending"), ("end_to_end_p99_ms", "descending"), ("natural", "ascending"),
         ("clientid", "ascending")])
    return consumers.drop_columns("natural").slice(0, limit).to_pylist()


def natural_order_key(names: pa.ChunkedArray) -> pa.ChunkedArray:
    """Keys that sort ``names`` in natural order (client3 before client10): each run of digits padded with
    zeros to 20 (longer runs kept as they are), so that comparing the keys as text compares the numbers."""
    padded = pc.replace_substring_regex(names, r"(\d+)", "0" * 20 + r"\1")
    return pc.replace_substring_regex(padded, r"0*(\d{20})", r"\1")


def summary(fleet: dict[str, Any], top_backlog: list[dict[str, Any]], scq_queues: Sequence[dict[str, Any]] = ()) -> str:
    """A few lines for the terminal: volumes, backlog, latency, the consumers with the largest backlog (their
    clientids escaped by ecq.queue.topics.printable), and the SCQs' totals (``scq_queues`` rows) when there are."""
    ratio = "-" if fleet["compaction_ratio"] is None else f"{fleet['compaction_ratio']:.2f}"
    lines = [
        f"events {fleet['events']} from {utc(fleet['first_event_ms'])} to {utc(fleet['last_event_ms'])}",
        f"consumers {fleet['consumers']} ({fleet['consumers_with_backlog']} with backlog), "
        f"backlog {fleet['backlog']} messages",
        f"writes {fleet['appended']}, compactions {fleet['compacted']} (ratio {ratio}), deliveries "
        f"{fleet['delivered']} ({fleet['redeliveries']} redeliveries), acks {fleet['acked']}, expired "
        f"{fleet['expired']}, refused {fleet['refused']}",
        _latency_line("delivery latency (sent->ack)", "delivery", fleet),
        _latency_line("end-to-end latency (append->ack, including time offline)", "end_to_end", fleet),
    ]
    backlogged = [c for c in top_backlog if c["backlog"]]
    if backlogged:
        lines.append("largest backlog: " + ", ".join(f"{printable(c['clientid'])} {c['backlog']}"
                                                     for c in backlogged[:5]))
    if scq_queues:
        lines.append(f"SCQs {len(scq_queues)}: " + ", ".join(
            f"{name} {sum(q[column] for q in scq_queues)}" for name, column in (
                ("writes", "appended"), ("readers", "readers"), ("deliveries", "delivered"), ("acks", "acked"))))
    return "\n".join(lines)


def _latency_line(label: str, name: str, fleet: dict[str, Any]) -> str:
    def ms(stat: str) -> str:
        value = fleet[f"{name}_{stat}_ms"]
        return "-" if value is None else f"{value} ms"

    return f"{label} p50 {ms('p50')}, p95 {ms('p95')}, p99 {ms('p99')}, max {ms('max')}"


def run_report(lake: Path, out: Path, master: str, verbose: bool = False) -> str:
    """``ecq pipeline report``: compute the report from ``lake`` on ``master``, write the tables and the
    HTML page under ``out``; returns the summary text (with where things went).

    Raises PipelineError for a missing or empty lake, ``out`` inside the lake, missing Java, or a Spark
    failure (e.g. a corrupt lake file), with Spark's reason.
    """
    check_lake(lake)
    check_out_dir(out, lake)
    with spark_session(master, "ecq-pipeline-report", verbose, input_bytes=lake_bytes(lake)) as spark:
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
    scq_queues = read_table(out, "scq_queues").to_pylist()
    page = render_html(fleet, top, read_table(out, "over_time").to_pylist(),
                       read_table(out, "latency_histogram").to_pylist(),
                       read_table(out, "refused_reasons").to_pylist(), str(lake), scq_queues)
    html_path = write_html(page, out / HTML_NAME)
    return "\n".join([summary(fleet, top, scq_queues), f"tables: {', '.join(str(p) for p in paths.values())}",
                      f"page: {html_path}"])
