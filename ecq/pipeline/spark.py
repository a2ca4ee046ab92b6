"""The Spark side shared by the pipeline jobs: Java check, session, event lake reader, error type."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession

from ecq.events.schema import COLUMNS, SCHEMA
from ecq.pipeline import PipelineError

MIN_JAVA = 17  # pyspark 4 runs on Java 17 or 21
JAVA_PACKAGE = "openjdk-17-jre-headless"
SPARK_ERRORS = (PySparkException, Py4JJavaError)  # what failing Spark calls raise
_SPARK_TYPES = {"int64": "BIGINT", "int32": "INT", "string": "STRING"}
EVENTS_DDL = ", ".join(f"{field.name} {_SPARK_TYPES[str(field.type)]}" for field in SCHEMA)
_LOOPBACK_MASTER = re.compile(r"local(\[.*\])?|spark://(127\.0\.0\.1|localhost)(:\d+)?")
_LOCAL_THREADS = re.compile(r"local(?:\[(\d+|\*)(?:,\d+)?\])?")
# Start-up settings (issue 26; figures in BENCHMARKS.md). The driver JVM compiles with C1 only and collects
# with the serial collector: on a small machine C2's compiler threads and G1's workers take as much CPU as
# the report itself while Spark's classes warm up; measured not to slow a 1,000,000-event report.
DRIVER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
SHUFFLE_INPUT_BYTES = 1024 * 1024  # Parquet bytes of input per shuffle partition (~100,000 events)
MAX_LOCAL_SHUFFLE_PARTITIONS = 8  # few cores: more would only add tasks
MAX_SHUFFLE_PARTITIONS = 200  # Spark's default, for a cluster


def check_java() -> str:
    """The Java runtime Spark will use (``$JAVA_HOME/bin/java``, else ``java`` on PATH) as its version string.

    Raises PipelineError naming what to install when there is none, or when it is older than Java 17.
    """
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not os.access(java, os.X_OK):
        where = f"JAVA_HOME={java_home} has no bin/java" if java_home else "no 'java' on PATH"
        raise PipelineError(f"PySpark needs a Java {MIN_JAVA}+ runtime and found none ({where}). Install one, "
                            f"e.g. 'apt-get install {JAVA_PACKAGE}' (scripts/setup pipeline does), or set JAVA_HOME.")
    try:
        banner = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PipelineError(f"cannot run {java} -version: {exc}") from exc
    match = re.search(r'version "(\d+)(?:\.(\d+))?', banner)
    if not match:
        raise PipelineError(f"cannot tell the Java version of {java} from: {banner.strip()[:200]}")
    major = int(match.group(2)) if match.group(1) == "1" else int(match.group(1))  # "1.8.0" is Java 8
    if major < MIN_JAVA:
        raise PipelineError(f"PySpark needs Java {MIN_JAVA}+, but {java} is Java {major}. Install "
                            f"{JAVA_PACKAGE} and set JAVA_HOME to it.")
    return banner.splitlines()[0]


def shuffle_partitions(master: str, input_bytes: int | None) -> int:
    """``spark.sql.shuffle.partitions`` for a job reading ``input_bytes`` of Parquet on ``master``: one
    partition per SHUFFLE_INPUT_BYTES, at least 1, at most MAX_LOCAL_SHUFFLE_PARTITIONS on a local master
    (MAX_SHUFFLE_PARTITIONS on a cluster). Unknown input (None): the maximum."""
    cap = MAX_LOCAL_SHUFFLE_PARTITIONS if _LOCAL_THREADS.fullmatch(master) else MAX_SHUFFLE_PARTITIONS
    if input_bytes is None:
        return cap
    return max(1, min(cap, -(-input_bytes // SHUFFLE_INPUT_BYTES)))


@contextmanager
def spark_session(master: str, app_name: str, verbose: bool = False,
                  input_bytes: int | None = None) -> Iterator[SparkSession]:
    """A SparkSession on ``master`` (``local[*]``, ``local[2]``, ``spark://HOST:PORT``), stopped on exit
    unless it already existed (then it is reused as it is, whatever its master: tests share one).

    Executors run this interpreter (``PYSPARK_PYTHON`` defaults to ``sys.executable``), so ecq and
    paho-mqtt must be importable there. For a local or loopback master everything binds to 127.0.0.1.
    The session's time zone is UTC. Spark's own log is off unless ``verbose`` (WARN).

    Configured to start quickly (issue 26): no Spark UI, no console progress bar, the in-memory catalog
    (no Hive metastore), shuffle partitions sized to ``input_bytes`` (`shuffle_partitions`), and, when
    this call starts the JVM, DRIVER_JAVA_OPTIONS. Raises PipelineError when Java is missing or too old.
    """
    check_java()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    existing = SparkSession.getActiveSession()
    builder = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.catalogImplementation", "in-memory")
               .config("spark.sql.shuffle.partitions", str(shuffle_partitions(master, input_bytes)))
               .config("spark.driver.extraJavaOptions", DRIVER_JAVA_OPTIONS))
    if _LOOPBACK_MASTER.fullmatch(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN" if verbose else "OFF")
    try:
        yield spark
    finally:
        if existing is None:
            spark.stop()


def lake_bytes(lake: Path) -> int:
    """The size of the lake's event files (``date=*/hour=*/*.parquet``) in bytes."""
    return sum(path.stat().st_size for path in lake.glob("date=*/hour=*/*.parquet"))


def check_lake(lake: Path) -> None:
    """Raise PipelineError when ``lake`` is missing, not a directory, or holds no event file."""
    if not lake.is_dir():
        what = "is not a directory" if lake.exists() else "does not exist"
        raise PipelineError(f"lake {lake} {what}: pass the broker's lake_dir (default <data_dir>/lake)")
    if next(lake.glob("date=*/hour=*/*.parquet"), None) is None:
        raise PipelineError(f"lake {lake} holds no event files (date=*/hour=*/*.parquet): is the broker running "
                            "with 'events: true' and has it exported yet (after lake_file_age, 1 min by default, "
                            "or when it stops)?")


def read_events(spark: SparkSession, lake: Path) -> DataFrame:
    """The events in the lake directory ``lake`` (layout of ecq/events/lake.py) with the columns of
    ecq.events.schema.SCHEMA, in that order. Raises PipelineError as `check_lake` does."""
    check_lake(lake)
    lake_uri = lake.resolve().as_uri()
    return spark.read.schema(EVENTS_DDL).option("basePath", lake_uri).parquet(lake_uri).select(*COLUMNS)


def spark_error_message(exc: BaseException) -> str:
    """Spark's error in one line for a PipelineError: its first line, and the root cause from the Java
    stack trace when there is one ("... (cause: file:/x.parquet is not a Parquet file ...)")."""
    text = str(exc.java_exception) if isinstance(exc, Py4JJavaError) else str(exc)
    trace = str(exc) if isinstance(exc, Py4JJavaError) else text
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    causes = [line.strip()[len("Caused by:"):].strip() for line in trace.splitlines()
              if line.strip().startswith("Caused by:")]
    return f"{first} (cause: {causes[-1]})" if causes and causes[-1] not in first else first
