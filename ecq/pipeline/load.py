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

Timing: the publishing phase runs from the first PUBLISH of any partition to the last PUBACK of any, by
the executors' wall clocks (one machine in local mode; on a cluster, as far as their clocks agree), so
Spark's start-up and the reading and checking of the input are reported apart from it. Progress: Spark
accumulators reach the driver only when a task ends, and a task here is a whole partition, so each
partition instead sends its running totals (a UDP datagram at most every ``PROGRESS_SEND_S`` seconds, or
half the progress interval when shorter, and when it ends) to a `Progress` listener on the driver, which
prints a line every few seconds. That works in local mode and wherever executors can reach the driver's
address (they must for Spark anyway); a lost datagram only delays a line.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
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
PROGRESS_SEND_S = 0.5  # how often a partition tells the driver its running totals


@dataclass(frozen=True)
class Target:
    """Where and how to publish: broker ``host``/``port``, ``window`` unacknowledged PUBLISHes per
    connection, ``ack_timeout_s`` seconds without a PUBACK before a connection gives up, a ``run_id``
    that makes the MQTT client ids (``ecq-load-<run_id>-<partition>``) unique, and ``progress_to``, the
    driver's (host, UDP port) for progress datagrams (None: none sent), sent at most every
    ``progress_send_s`` seconds."""

    host: str
    port: int
    window: int = 100
    ack_timeout_s: float = 30.0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    progress_to: tuple[str, int] | None = None
    progress_send_s: float = PROGRESS_SEND_S


@dataclass
class LoadResult:
    """Rows read, published (PUBACKed), failed, the first few error messages; ``seconds`` from the start
    (Spark start-up included when the caller passed its start time), ``publish_seconds`` from the first
    PUBLISH to the last PUBACK (0 when nothing was published) and ``startup_seconds`` before the first
    PUBLISH (Spark start-up, reading and checking the input)."""

    rows: int
    published: int
    failed: int
    errors: list[str]
    seconds: float
    publish_seconds: float = 0.0
    startup_seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Rows published per second of the publishing phase (0 when nothing was published)."""
        return self.published / self.publish_seconds if self.publish_seconds > 0 else 0.0


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


def load(spark: SparkSession, path: Path, fmt: str, target: Target, partitions: int | None = None, *,
         started_at: float | None = None, progress_every_s: float = 0.0,
         echo: Callable[[str], None] = print) -> LoadResult:
    """Publish every row of the input at ``path`` to the broker of ``target``, one MQTT connection per
    partition (``partitions``, default Spark's default parallelism). ``started_at`` (``time.time()``,
    default now) is when the run began, Spark's start-up included; with ``progress_every_s`` > 0 a line
    of progress goes to ``echo`` at most that often (seconds) while rows are published. Raises
    PipelineError for bad input (nothing is published then); connection and PUBACK failures are counted
    in the result instead."""
    started_at = time.time() if started_at is None else started_at
    rows = read_rows(spark, path, fmt)
    total = check_rows(rows, path)
    ordered = (rows.withColumn("_order", F.monotonically_increasing_id())
               .repartition(partitions or spark.sparkContext.defaultParallelism, "clientid")
               .sortWithinPartitions("_order")
               .select("clientid", "key", "payload"))
    with Progress(_driver_host(spark), total, progress_every_s, echo) as progress:
        target = replace(target, progress_to=progress.address,
                         progress_send_s=min(PROGRESS_SEND_S, progress_every_s / 2))
        try:
            results = ordered.rdd.mapPartitionsWithIndex(lambda index, part: publish_partition(target, index, part))
            totals = results.collect()
        except SPARK_ERRORS as exc:
            raise PipelineError(f"load of {path} failed in Spark: {spark_error_message(exc)}") from exc
    return _result(total, totals, started_at)


def _result(total: int, totals: list[tuple], started_at: float) -> LoadResult:
    """Sum the partitions' (published, failed, errors, first publish, last ack) into a LoadResult."""
    firsts = [t[3] for t in totals if t[3] is not None]
    lasts = [t[4] for t in totals if t[4] is not None]
    first = min(firsts, default=None)
    publish_seconds = max(lasts) - first if first is not None and lasts else 0.0
    startup = (first if first is not None else time.time()) - started_at
    return LoadResult(total, sum(t[0] for t in totals), sum(t[1] for t in totals),
                      [e for t in totals for e in t[2]][:MAX_ERRORS], time.time() - started_at,
                      publish_seconds, startup)


def _driver_host(spark: SparkSession) -> str:
    return spark.sparkContext.getConf().get("spark.driver.host", "127.0.0.1")


class Progress:
    """On the driver: receives the partitions' running totals (UDP on ``host``, a free port) and, every
    ``every_s`` seconds while the published count grows, prints through ``echo`` a line such as
    ``progress: 120000 of 1000000 rows published (24000 rows/s), 0 failed``. ``every_s`` <= 0: nothing
    is listened to or printed (``address`` is None). A context manager; leaving it stops both threads."""

    def __init__(self, host: str, total: int, every_s: float, echo: Callable[[str], None]) -> None:
        self.address: tuple[str, int] | None = None
        self._total, self._every_s, self._echo = total, every_s, echo
        self._partitions: dict[int, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socket: socket.socket | None = None
        if every_s > 0:
            self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._socket.bind((host, 0))
            self._socket.settimeout(0.2)
            self.address = (host, self._socket.getsockname()[1])

    def __enter__(self) -> Progress:
        if self._socket is not None:
            self._threads = [threading.Thread(target=self._receive, daemon=True),
                             threading.Thread(target=self._report, daemon=True)]
            for thread in self._threads:
                thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        if self._socket is not None:
            self._socket.close()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                index, published, failed = map(int, self._socket.recv(256).split())
            except (TimeoutError, ValueError):
                continue
            self._partitions[index] = (published, failed)

    def _report(self) -> None:
        shown, shown_at = 0, time.monotonic()
        while not self._stop.wait(self._every_s):
            published = sum(p for p, _ in self._partitions.values())
            failed = sum(f for _, f in self._partitions.values())
            now = time.monotonic()
            if published > shown:
                rate = (published - shown) / (now - shown_at)
                self._echo(f"progress: {published} of {self._total} rows published ({rate:.0f} rows/s), "
                           f"{failed} failed")
            shown, shown_at = published, now


def publish_partition(target: Target, index: int, rows: Iterable) -> Iterator[tuple]:
    """Runs on an executor: publish one partition's rows in order over one connection; yields one
    (published, failed, errors, first publish, last PUBACK) tuple, times in ``time.time()`` seconds or
    None when nothing was published."""
    publisher = _Publisher(target, f"ecq-load-{target.run_id}-{index}", index)
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
    publisher.failed += sum(1 for _ in rows)  # whatever was not sent after a failure
    yield publisher.published, publisher.failed, publisher.errors, publisher.first_publish, publisher.last_ack


class _Publisher:
    """One paho connection that publishes at QoS 1 with at most ``2 * window`` unacknowledged messages."""

    def __init__(self, target: Target, client_id: str, index: int) -> None:
        self.target = target
        self.index = index
        self.published = 0
        self.failed = 0
        self.errors: list[str] = []
        self.first_publish: float | None = None  # time.time() of the first PUBLISH
        self.last_ack: float | None = None  # time.time() of the last PUBACK counted
        self._progress_socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM) if target.progress_to else None
        self._told_at = 0.0
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
        if self.first_publish is None:
            self.first_publish = time.time()
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
                self.last_ack = time.time()
            if self._progress_socket and time.monotonic() - self._told_at >= self.target.progress_send_s:
                self.tell_progress()
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

    def tell_progress(self) -> None:
        """Send the running totals to the driver's `Progress` (a lost or refused datagram is ignored)."""
        if self._progress_socket is None:
            return
        self._told_at = time.monotonic()
        try:
            self._progress_socket.sendto(f"{self.index} {self.published} {self.failed}".encode(),
                                         self.target.progress_to)
        except OSError:
            pass

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()
        self.tell_progress()
        if self._progress_socket is not None:
            self._progress_socket.close()
