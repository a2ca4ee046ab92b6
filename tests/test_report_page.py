"""The report tells the truth (issue 14): exact latency bucket edges, delivery latency apart from
end-to-end latency, time buckets chosen from the span of the data, and the page as a browser shows it
(headless Chromium: its DOM after layout and a screenshot).

Lakes are written here with pyarrow in the broker's layout (date=/hour= directories, ecq.events.schema),
so each holds exactly the events a test needs; one local[2] Spark session serves the whole module.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import matplotlib.colors
import matplotlib.pyplot
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ecq.events.schema import SCHEMA
from ecq.pipeline.render import traffic_figure
from ecq.pipeline.report import (compute_report, read_table, run_report, summary, time_bucket_s,
                                 top_consumers)
from ecq.pipeline.spark import (DRIVER_JAVA_OPTIONS, lake_bytes, read_events, shuffle_partitions,
                                spark_session)

T = 1_767_225_600_000  # 2026-01-01T00:00:00Z
SECOND, MINUTE, HOUR, DAY = 1000, 60_000, 3_600_000, 86_400_000
EDGE_LATENCIES_MS = (1, 10, 999, 1000)
OFFLINE_MESSAGES = 20
BACK_ONLINE_MS = T + 12 * SECOND  # the offline consumer's writes are all at least 10 s old by then
ACK_AFTER_MS = 5
BROWSER_TIMEOUT_S = 90
SPARK = pytest.mark.timeout(600)  # a test that starts the module's Spark session and first report pays for both


@pytest.fixture(scope="module")
def spark():
    with spark_session("local[2]", "ecq-report-page-tests") as session:
        yield session


def write_lake(lake: Path, events: list[dict]) -> Path:
    """``events`` (dicts with SCHEMA's columns; absent ones null) as one Parquet file per UTC hour."""
    by_hour = defaultdict(list)
    for event in events:
        by_hour[event["ts_ms"] // HOUR].append(event)
    for hour, rows in by_hour.items():
        moment = datetime.fromtimestamp(hour * 3600, UTC)
        directory = lake / f"date={moment:%Y-%m-%d}" / f"hour={moment:%H}"
        directory.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), directory / "part-test.parquet")
    return lake


def message(event_type: str, ts_ms: int, clientid: str, seqno: int, publish_ts_ms: int, **more) -> dict:
    return dict(ts_ms=ts_ms, type=event_type, clientid=clientid, key=f"k{seqno}", seqno=seqno,
                publish_ts_ms=publish_ts_ms, payload_bytes=3, **more)


def truth_events() -> list[dict]:
    """- edges: 4 writes, each sent at once and acked after exactly 1, 10, 999 and 1000 ms.
    - offline: 20 writes in the first 2 s while its consumer is away (the first one sent and never acked:
      the consumer dropped); back at T + 12 s it gets each (the first as attempt 2) and acks 5 ms later."""
    events = []
    for seqno, latency in enumerate(EDGE_LATENCIES_MS, start=1):
        appended = T + seqno * SECOND
        events += [message("appended", appended, "edges", seqno, appended),
                   message("delivered", appended, "edges", seqno, appended, attempt=1),
                   message("acked", appended + latency, "edges", seqno, appended)]
    for seqno in range(1, OFFLINE_MESSAGES + 1):
        appended = T + seqno * 100
        sent = BACK_ONLINE_MS + seqno * 10
        events.append(message("appended", appended, "offline", seqno, appended))
        if seqno == 1:
            events.append(message("delivered", appended, "offline", seqno, appended, attempt=1))
        events += [message("delivered", sent, "offline", seqno, appended, attempt=2 if seqno == 1 else 1),
                   message("acked", sent + ACK_AFTER_MS, "offline", seqno, appended)]
    return events


@pytest.fixture(scope="module")
def truth_report(spark, tmp_path_factory) -> tuple[Path, str]:
    """(out dir, printed summary) of the whole report on the truth lake."""
    base = tmp_path_factory.mktemp("truth")
    out = base / "out"
    return out, run_report(write_lake(base / "lake", truth_events()), out, "local[2]")


@SPARK
def test_latency_buckets_have_exact_integer_edges(truth_report):
    out, _ = truth_report
    histogram = read_table(out, "latency_histogram").to_pylist()
    assert [h["lower_ms"] for h in histogram] == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
    assert [h["upper_ms"] for h in histogram] == [2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]
    delivery = {h["lower_ms"]: h["delivery_acks"] for h in histogram if h["delivery_acks"]}
    end_to_end = {h["lower_ms"]: h["end_to_end_acks"] for h in histogram if h["end_to_end_acks"]}
    assert delivery == {1: 1, 5: OFFLINE_MESSAGES, 10: 1, 500: 1, 1000: 1}  # 999 ms is below 1000, not at 999
    assert end_to_end == {1: 1, 10: 1, 500: 1, 1000: 1, 10000: OFFLINE_MESSAGES}


@SPARK
def test_delivery_latency_leaves_out_the_time_offline(truth_report):
    out, text = truth_report
    consumers = {row["clientid"]: row for row in read_table(out, "consumers").to_pylist()}
    offline = consumers["offline"]
    assert (offline["delivery_p50_ms"], offline["delivery_p99_ms"], offline["delivery_max_ms"]) == (
        ACK_AFTER_MS, ACK_AFTER_MS, ACK_AFTER_MS)  # from the acked send (attempt 2), not the first one
    assert offline["end_to_end_p50_ms"] >= 10 * SECOND and offline["end_to_end_p99_ms"] >= 10 * SECOND
    edges = consumers["edges"]
    assert (edges["delivery_max_ms"], edges["end_to_end_max_ms"]) == (1000, 1000)
    (fleet,) = read_table(out, "fleet").to_pylist()
    assert fleet["delivery_p50_ms"] == ACK_AFTER_MS and fleet["delivery_p99_ms"] <= 1000
    assert fleet["end_to_end_p99_ms"] >= 10 * SECOND
    assert f"delivery latency (sent->ack) p50 {ACK_AFTER_MS} ms" in text
    end_to_end_line = next(line for line in text.splitlines() if line.startswith("end-to-end latency"))
    assert "including time offline" in end_to_end_line
    assert int(re.search(r"p99 (\d+) ms", end_to_end_line).group(1)) >= 10 * SECOND


def test_the_session_starts_lean(spark):
    """What cuts Spark's start-up (issue 26): no UI, no progress bar, no Hive, the driver JVM's options."""
    conf = spark.sparkContext.getConf()
    assert conf.get("spark.ui.enabled") == "false" and spark.sparkContext.uiWebUrl is None
    assert conf.get("spark.ui.showConsoleProgress") == "false"
    assert spark.conf.get("spark.sql.catalogImplementation") == "in-memory"
    jvm_options = list(spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
                       .getInputArguments())
    assert set(DRIVER_JAVA_OPTIONS.split()) <= set(jvm_options), jvm_options


def test_shuffle_partitions_follow_the_input(tmp_path):
    assert shuffle_partitions("local[*]", 10_000) == 1  # a small lake: one task per shuffle, not 8 or 200
    assert shuffle_partitions("local[2]", 5 * 2**20) == 5  # one per MiB of Parquet
    assert shuffle_partitions("local[*]", 10**12) == shuffle_partitions("local[4]", None) == 8
    assert shuffle_partitions("spark://10.0.0.5:7077", 10**12) == 200
    lake = write_lake(tmp_path / "lake", truth_events())
    (tmp_path / "lake" / "date=2026-01-01" / "notes.txt").write_text("not an event file")
    assert lake_bytes(lake) == sum(p.stat().st_size for p in lake.rglob("*.parquet")) > 0


def span_lake(base: Path, span_ms: int) -> Path:
    """Writes, each acked a second later, every ``span_ms / 20`` ms from T to T + span_ms."""
    events = []
    for seqno, appended in enumerate(range(T, T + span_ms + 1, span_ms // 20), start=1):
        events += [message("appended", appended, "c", seqno, appended),
                   message("acked", appended + SECOND, "c", seqno, appended)]
    return write_lake(base / "lake", events)


@SPARK
@pytest.mark.parametrize(("span_ms", "bucket_s"), [(2 * MINUTE, 1), (3 * HOUR, 60), (3 * DAY, 3600)],
                         ids=["2-minutes-in-seconds", "3-hours-in-minutes", "3-days-in-hours"])
def test_the_time_bucket_follows_the_span_of_the_data(spark, tmp_path, span_ms, bucket_s):
    report = compute_report(read_events(spark, span_lake(tmp_path, span_ms)))
    try:
        over_time = [row.asDict() for row in report.over_time.collect()]
    finally:
        report.unpersist()
    assert {row["bucket_s"] for row in over_time} == {bucket_s}
    starts = [row["start_ms"] for row in over_time]
    assert starts == list(range(T, T + span_ms + SECOND + 1, bucket_s * 1000))  # every bucket, the last ack's too
    assert sum(row["writes"] for row in over_time) == 21 and sum(row["acks"] for row in over_time) == 21
    assert over_time[-1]["backlog"] == 0


def test_the_page_lists_consumers_by_backlog_then_clientid_in_natural_order(tmp_path):
    names = ["client10", "client3", "client2", "client1", "client20", "c1x10", "c1x9", "client03"]
    (tmp_path / "consumers").mkdir()
    pq.write_table(pa.table({"clientid": names, "backlog": [0, 0, 0, 0, 5, 0, 0, 0],
                             "end_to_end_p99_ms": pa.array([None] * 8, pa.int64())}),
                   tmp_path / "consumers" / "part-0.parquet")
    assert [row["clientid"] for row in top_consumers(tmp_path, 50)] == [
        "client20", "c1x9", "c1x10", "client1", "client2", "client03", "client3", "client10"]
    assert [row["clientid"] for row in top_consumers(tmp_path, 3)] == ["client20", "c1x9", "c1x10"]


def test_the_printed_summary_escapes_control_characters_in_clientids():
    fleet = {"compaction_ratio": None, "events": 1, "first_event_ms": T, "last_event_ms": T, "consumers": 1,
             "consumers_with_backlog": 1, "backlog": 1, "appended": 1, "compacted": 0, "delivered": 0,
             "redeliveries": 0, "acked": 0, "expired": 0, "refused": 0,
             **{f"{name}_{stat}_ms": None for name in ("delivery", "end_to_end")
                for stat in ("p50", "p95", "p99", "max")}}
    text = summary(fleet, [{"clientid": "evil\x1b[2J\r\nfake", "backlog": 1}])
    assert r"largest backlog: evil\x1b[2J\r\nfake 1" in text and "\x1b" not in text and "\r" not in text


def test_time_bucket_thresholds():
    assert time_bucket_s(T, T + 1799 * SECOND) == 1  # 1,800 seconds
    assert time_bucket_s(T, T + 1800 * SECOND) == 60
    assert time_bucket_s(T, T + 1799 * MINUTE) == 60
    assert time_bucket_s(T, T + 1800 * MINUTE) == 3600
    assert time_bucket_s(T, T + 365 * DAY) == 3600
    assert time_bucket_s(None, None) == 1


def test_every_traffic_line_shows_where_they_coincide():
    """A consumer that keeps up has as many writes, deliveries and acks in each step: the three lines lie on
    one another, and each must still show inside the plot (not only in its legend)."""
    counts = [3, 7, 7, 2, 0, 5, 9, 4]
    series = [{"start_ms": T + i * SECOND, "writes": n, "deliveries": n, "acks": n, "backlog": 0}
              for i, n in enumerate(counts)]
    fig = traffic_figure(series, 1)
    fig.canvas.draw()
    (ax,) = fig.axes
    box = ax.get_window_extent()
    pixels = np.asarray(fig.canvas.buffer_rgba())[:, :, :3].astype(int)
    height = pixels.shape[0]
    plot = pixels[round(height - box.y1):round(height - box.y0), round(box.x0):round(box.x1)]
    for line in ax.get_lines():
        red, green, blue, alpha = matplotlib.colors.to_rgba(line.get_color(), line.get_alpha())
        shown = np.array([255 * (alpha * c + 1 - alpha) for c in (red, green, blue)])  # over the white plot
        near = np.count_nonzero(np.abs(plot - shown).max(axis=2) < 40)
        assert near >= 150, f"{line.get_label()}: {near} pixels of its colour in the plot"
    matplotlib.pyplot.close(fig)


# --- the page in a browser ---------------------------------------------------------------------------

MEASURE = """<script>
const drawn = svg => [...svg.querySelectorAll("path")].filter(p => !p.closest("defs")).filter(p => {
  const box = p.getBBox(); return box.width > 0 || box.height > 0; }).length;
const measured = {
  headings: [...document.querySelectorAll("h1, h2")].map(h => h.innerText),
  svgs: [...document.querySelectorAll("svg")].map(svg => { const r = svg.getBoundingClientRect();
    return {x: r.x, y: r.y + scrollY, width: r.width, height: r.height, drawn: drawn(svg)}; }),
  height: document.documentElement.scrollHeight,
  cards: [...document.querySelectorAll(".card")].map(c => c.getBoundingClientRect().top),
  cells: [...document.querySelectorAll("th, td")].map(cell => {  // the lines a cell's text takes
    const range = document.createRange(); range.selectNodeContents(cell);
    return {text: cell.innerText, lines: new Set([...range.getClientRects()].map(r => Math.round(r.top))).size}; }),
  tables: [...document.querySelectorAll("table")].map(t => ({  // the table's width, the room it has
    width: t.getBoundingClientRect().width, room: t.parentElement.clientWidth}))};
const pre = document.createElement("pre"); pre.id = "measured"; pre.textContent = JSON.stringify(measured);
document.body.appendChild(pre);
</script>"""


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium, which scripts/setup test installs (scripts/test runs it first); the test fails without it."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("chromium is not installed: run scripts/setup test (it installs Debian's chromium)")
    return path


def run_chromium(chromium: str, profile: Path, *args: str) -> str:
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
               "--force-device-scale-factor=1", f"--user-data-dir={profile}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@SPARK
def test_the_page_shows_its_charts_in_a_browser(chromium, truth_report, tmp_path):
    out, _ = truth_report
    measuring = out / "measure.html"
    measuring.write_text((out / "report.html").read_text().replace("</body>", MEASURE + "</body>"))
    dom = run_chromium(chromium, tmp_path / "profile", "--window-size=1200,900", "--dump-dom", measuring.as_uri())
    measured = json.loads(html.unescape(re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S).group(1)))
    assert measured["headings"] == [
        "ECQ queue report", "Delivery latency (sent to ack)", "End-to-end latency (append to ack)",
        "Backlog over time (per second)", "Traffic per second", "Consumers (top 2 by backlog)", "Refused writes"]
    assert len(measured["svgs"]) == 4
    assert len(measured["cards"]) == 6 and len(set(measured["cards"])) == 1, measured["cards"]  # one row of cards
    wrapped = [cell["text"] for cell in measured["cells"] if cell["lines"] != 1]
    assert not wrapped, f"table cells on more than one line: {wrapped}"
    assert all(t["width"] <= t["room"] for t in measured["tables"]), measured["tables"]  # none scrolls or spills
    for svg in measured["svgs"]:
        assert svg["width"] > 400 and svg["height"] > 150 and svg["drawn"] >= 5, svg

    latency_svgs = dom.split("<svg")[1:3]
    for svg, axis_label in zip(latency_svgs, ("sent to ack", "append to ack"), strict=True):
        texts = re.findall(r"<!-- (.*?) -->", svg)  # matplotlib notes each text it draws as glyph paths
        x_labels = texts[:next(i for i, t in enumerate(texts) if t.startswith("latency from"))]
        assert x_labels == ["1", "2", "5", "10", "20", "50", "100", "200", "500", "1000", "2000", "5000", "10000",
                            "20000"]  # every bar has both its edges labelled, the last one too
        assert f"latency from {axis_label}, ms" in " ".join(texts)

    screenshot = tmp_path / "page.png"
    run_chromium(chromium, tmp_path / "profile", f"--window-size=1200,{measured['height']}",
                 f"--screenshot={screenshot}", (out / "report.html").as_uri())
    pixels = np.asarray(Image.open(screenshot).convert("L"))
    for svg in measured["svgs"]:
        top, left = round(svg["y"]), round(svg["x"])
        chart = pixels[top:top + round(svg["height"]), left:left + round(svg["width"])]
        inked = np.count_nonzero(chart < 200) / chart.size
        assert 0.01 < inked < 0.6, f"chart at y={top} is blank or a solid block: {inked:.1%} inked"
