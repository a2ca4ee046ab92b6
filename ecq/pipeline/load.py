"""``ecq pipeline load``: publish a dataset of rows (clientid, key, payload) as ECQ writes from the Spark
executors.

Input: Parquet, CSV (with a header line) or JSON Lines, a file or a directory of files, with the columns
``clientid``, ``key`` and ``payload`` (others are ignored). ``payload`` may be a string (sent as UTF-8) or
binary; any other type is sent as its string form; null is an empty payload. A row is malformed when
clientid is null, empty or contains ``/``, ``+``, ``#`` or NUL, or key is null, empty or contains ``+``,
``#`` or NUL (the broker would refuse the write); then nothing is published.

Publishing: rows are hash-partitioned by clientid; each partition is one MQTT connection that sends its
rows in input order as QoS 1 PUBLISHes to ``$ECQ/w/<clientid>/<key>``, at most ``window`` unacknowledged
at a time, so one client's rows are stored in the order they appear in the input (for a directory of
several files, in the order Spark reads the files). A row counts as published once its PUBACK came,
which the broker sends after the write is stored (or after it refused it: refused writes show up as
``refused`` events in the lake). When no PUBACK arrives for ``ack_timeout_s`` seconds the partition gives
up and counts its remaining rows as failed; they may or may not be stored. Running the same load again
is safe: a queue keeps only the newest value per key.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as mqtt
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType

from ecq.pipeline import PipelineError
from ecq.pipeline.spark import SPARK_ERRORS, spark_error_message
from ecq.queue.topics import write_topic

FORMATS = ("parquet", "csv", "json")
REQUIRED_COLUMNS = ("clientid", "key", "payload")
MAX_ERRORS = 5
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Target:
    """Where and how to publish: broker ``host``/``port``, ``window`` unacknowledged PUBLISHes per
    connection, ``ack_timeout_s`` seconds without a PUBACK before a connection gives up, and a ``run_id``
    that makes the MQTT client ids (``ecq-load-<run_id>-<partition>``) unique."""

    host: str
    port: int
    window: int = 100
    ack_timeout_s: float = 30.0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


@dataclass
class LoadResult:
    """Rows read, published (PUBACKed), failed, the first few error messages, and the seconds it took."""

    rows: int
    published: int
    failed: int
    errors: list[str]
    seconds: float


def read_rows(spark: SparkSession, path: Path, fmt: str) -> DataFrame:
    """Read the input as (clientid string, key string, payload binary), in input order.

    Raises PipelineError for a missing path, an unknown format, a file that cannot be read as ``fmt``
    (the message carries Spark's reason), or missing columns.
    """
    if fmt not in FORMATS:
        raise PipelineError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    if not path.exists():
        raise PipelineError(f"input {path} does not exist")
    uri = path.resolve().as_uri()
    try:
        if fmt == "parquet":
            frame = spark.read.parquet(uri)
        elif fmt == "csv":
            frame = spark.read.option("header", True).option("mode", "FAILFAST").csv(uri)
        else:
            frame = spark.read.option("mode", "FAILFAST").json(uri)
    except SPARK_ERRORS as exc:
        raise PipelineError(f"cannot read {path} as {fmt}: {spark_error_message(exc)}") from exc
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise PipelineError(f"{path} has no column(s) {', '.join(missing)} (it has: {', '.join(frame.columns)}); "
                            f"{fmt} input needs {', '.join(REQUIRED_COLUMNS)}")
    payload = F.col("payload")
    if not isinstance(frame.schema["payload"].dataType, BinaryType):
        payload = F.encode(payload.cast("string"), "UTF-8")
    return frame.select(F.col("clientid").cast("string"), F.col("key").cast("string"),
                        F.coalesce(payload, F.lit(b"")).alias("payload"))


def _malformed() -> Column:
    """True for a row the broker would refuse for its clientid or key (see the module docstring)."""
    clientid, key = F.col("clientid"), F.col("key")
    bad_clientid = clientid.isNull() | (clientid == "") | clientid.rlike("[/+#\\x00]")
    bad_key = key.isNull() | (key == "") | key.rlike("[+#\\x00]")
    return bad_clientid | bad_key


def check_rows(rows: DataFrame, path: Path) -> int:
    """Parse every row once (all three columns, so a bad CSV or JSON line is found now) and return the row
    count. Raises PipelineError naming how many rows are malformed, with examples, or why the input
    cannot be parsed; nothing has been published then."""
    try:
        total, malformed, _ = rows.agg(F.count("*"), F.count(F.when(_malformed(), True)),
                                       F.sum(F.length("payload"))).first()
        examples = rows.where(_malformed()).limit(3).collect() if malformed else []
    except SPARK_ERRORS as exc:
        raise PipelineError(f"cannot read the rows of {path}: {spark_error_message(exc)}") from exc
    if malformed:
        shown = "; ".join(f"clientid={r.clientid!r} key={r.key!r}" for r in examples)
        raise PipelineError(f"{malformed} row(s) of {path} have a missing or invalid clientid or key (e.g. {shown}); "
                            "clientid must be non-empty without '/', '+', '#' or NUL, key non-empty without "
                            "'+', '#' or NUL. Nothing was published.")
    return total


def load(spark: SparkSession, path: Path, fmt: str, target: Target, partitions: int | None = None) -> LoadResult:
    """Publish every row of the input at ``path`` to the broker of ``target``, one MQTT connection per
    partition (``partitions``, default Spark's default parallelism). Raises PipelineError for bad input
    (nothing is published then); connection and PUBACK failures are counted in the result instead."""
    started = time.monotonic()
    rows = read_rows(spark, path, fmt)
    total = check_rows(rows, path)
    ordered = (rows.withColumn("_order", F.monotonically_increasing_id())
               .repartition(partitions or spark.sparkContext.defaultParallelism, "clientid")
               .sortWithinPartitions("_order")
               .select("clientid", "key", "payload"))
    try:
        results = ordered.rdd.mapPartitionsWithIndex(lambda index, part: publish_partition(target, index, part))
        totals = results.collect()
    except SPARK_ERRORS as exc:
        raise PipelineError(f"load of {path} failed in Spark: {spark_error_message(exc)}") from exc
    published = sum(t[0] for t in totals)
    failed = sum(t[1] for t in totals)
    errors = [e for t in totals for e in t[2]][:MAX_ERRORS]
    return LoadResult(total, published, failed, errors, time.monotonic() - started)


def publish_partition(target: Target, index: int, rows: Iterable) -> Iterator[tuple[int, int, list[str]]]:
    """Runs on an executor: publish one partition's rows in order over one connection; yields one
    (published, failed, errors) tuple."""
    publisher = _Publisher(target, f"ecq-load-{target.run_id}-{index}")
    try:
        publisher.connect()
        for row in rows:
            if not publisher.publish(write_topic(row.clientid, row.key), bytes(row.payload)):
                break
        publisher.finish()
    except OSError as exc:
        publisher.fail(f"{target.host}:{target.port}: {exc}")
    finally:
        publisher.close()
    failed_unsent = sum(1 for _ in rows)  # whatever was not sent after a failure
    yield publisher.published, publisher.failed + failed_unsent, publisher.errors


class _Publisher:
    """One paho connection that publishes at QoS 1 with at most ``2 * window`` unacknowledged messages."""

    def __init__(self, target: Target, client_id: str) -> None:
        self.target = target
        self.published = 0
        self.failed = 0
        self.errors: list[str] = []
        self._unacked: deque[mqtt.MQTTMessageInfo] = deque()
        self._progress = threading.Condition()
        self._connected = threading.Event()
        self._last_ack = time.monotonic()
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
        self._client.max_inflight_messages_set(target.window)
        self._client.on_connect = self._on_connect
        self._client.on_publish = self._on_publish

    def _on_connect(self, _client, _userdata, _flags, reason, _properties) -> None:
        if reason.is_failure:
            self.errors.append(f"connection refused: {reason}")
        else:
            self._connected.set()

    def _on_publish(self, *_args) -> None:
        with self._progress:
            self._progress.notify_all()

    def connect(self) -> None:
        """Connect and wait for the CONNACK; raises OSError when the broker is unreachable or refuses."""
        self._client.connect(self.target.host, self.target.port, keepalive=60)
        self._client.loop_start()
        if not self._connected.wait(CONNECT_TIMEOUT_S):
            raise OSError(self.errors[-1] if self.errors else f"no CONNACK within {CONNECT_TIMEOUT_S:.0f} s")
        self._last_ack = time.monotonic()

    def publish(self, topic: str, payload: bytes) -> bool:
        """Send one QoS 1 PUBLISH once the window has room; False (the message counted as failed) when
        the broker stopped acknowledging."""
        if not self._wait_below(2 * self.target.window):
            self.failed += 1
            return False
        self._unacked.append(self._client.publish(topic, payload, qos=1))
        return True

    def finish(self) -> None:
        """Wait for the outstanding PUBACKs (until one takes longer than ack_timeout_s)."""
        self._wait_below(1)

    def _wait_below(self, limit: int) -> bool:
        while True:
            while self._unacked and self._unacked[0].is_published():
                self._unacked.popleft()
                self.published += 1
                self._last_ack = time.monotonic()
            if len(self._unacked) < limit:
                return True
            if time.monotonic() - self._last_ack > self.target.ack_timeout_s:
                self.fail(f"no PUBACK from {self.target.host}:{self.target.port} for "
                          f"{self.target.ack_timeout_s:.0f} s")
                return False
            with self._progress:
                self._progress.wait(0.05)

    def fail(self, error: str) -> None:
        """Count every unacknowledged message as failed and note ``error``."""
        self.failed += len(self._unacked)
        self._unacked.clear()
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(error)

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()
