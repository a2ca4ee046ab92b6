"""PySpark jobs over ECQ queues, run by ``ecq pipeline ...`` (ecq/pipeline/cli.py).

- `ecq.pipeline.report`: per-consumer, per-minute and fleet tables computed from the event lake that
  ecq.events.lake exports, written as Parquet; `ecq.pipeline.render` turns them into one self-contained
  HTML page with charts.
- `ecq.pipeline.compact`: merges the files of each finished hour partition of the lake into one, exactly once.
- `ecq.pipeline.load`: publishes rows (clientid, key, payload) from Parquet, CSV or JSON Lines as QoS 1
  ECQ writes, from the Spark executors.
- `ecq.pipeline.spark`: the Java check, the Spark session and the shared error type.

Everything runs on ``local[*]`` with nothing installed but the ``pyspark`` package and a Java 17+
runtime, and unchanged against a standalone cluster (``--master spark://HOST:PORT``, see
scripts/spark-cluster) whose workers share this machine's (or a shared) filesystem and Python.

This module itself imports nothing heavy, so that the ``ecq`` command starts fast.
"""


class PipelineError(Exception):
    """A problem the user can fix (missing Java, lake or input; bad format or rows); the message says what."""
