"""The report as one self-contained HTML page: inline SVG charts drawn by matplotlib
(glyphs as paths, so no font, script, stylesheet or image is fetched), and the main tables.

Charts: delivery latency (sent to ack) and end-to-end latency (append to ack) distributions (acks per
latency bucket on the same log-scale axis, each with its p50/p95/p99 marked), fleet backlog over time,
and writes/deliveries/acks per time bucket (the over_time table's ``bucket_s``, named in the headings).
"""

from __future__ import annotations

import html
import io
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from itertools import groupby
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

MAX_POINTS = 2_000  # over_time series longer than this are merged into coarser steps for the charts
TABLE_ROWS = 50
plt.rcParams.update({"svg.fonttype": "path", "font.size": 9, "axes.spines.top": False, "axes.spines.right": False})

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; padding: 0 1rem; max-width: 1100px; color: #222; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.15rem; margin-top: 2rem; }
.cards { display: grid; grid-auto-flow: column; grid-auto-columns: minmax(0, 1fr); gap: .75rem; }
@media (max-width: 900px) { .cards { grid-auto-flow: row; grid-template-columns: repeat(3, minmax(0, 1fr)); } }
@media (max-width: 480px) { .cards { grid-template-columns: repeat(2, minmax(0, 1fr)); } }
.card { border: 1px solid #ddd; border-radius: 6px; padding: .6rem .9rem; }
.card b { display: block; font-size: 1.3rem; }
.card span { color: #666; font-size: .8rem; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: .85rem; }
th, td { padding: .25rem .45rem; border-bottom: 1px solid #eee; text-align: right; white-space: nowrap; }
th { vertical-align: bottom; }
th.group { text-align: center; border-bottom: 1px solid #ccc; }
th:first-child, td:first-child { text-align: left; }
.muted { color: #777; font-size: .85rem; }
svg { max-width: 100%; height: auto; }
"""


def render_html(fleet: dict[str, Any], consumers: Sequence[dict[str, Any]], over_time: Sequence[dict[str, Any]],
                histogram: Sequence[dict[str, Any]], refused: Sequence[dict[str, Any]], source: str,
                scq_queues: Sequence[dict[str, Any]] = ()) -> str:
    """The page for one report: ``fleet`` (the fleet row), ``consumers`` (the rows to list, e.g. the top
    by backlog), ``over_time``, ``histogram`` (latency_histogram rows), ``refused`` (refused_reasons
    rows) and ``scq_queues`` (its rows), as dicts with the columns of ecq.pipeline.report.Report; ``source`` names
    the lake."""
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    series, seconds = _coarsen(over_time)
    step = _duration(seconds)
    sections = [
        f"<h1>ECQ queue report</h1><p class=muted>Lake {html.escape(source)}; events from "
        f"{utc(fleet['first_event_ms'])} to {utc(fleet['last_event_ms'])}; generated {generated}. "
        "Times in UTC, latencies in ms.</p>",
        _cards(fleet),
        "<h2>Delivery latency (sent to ack)</h2><p class=muted>From the send that was acked to its ack: what "
        "the consumer and the network took.</p>", _latency_chart(histogram, fleet, "delivery", "sent to ack"),
        "<h2>End-to-end latency (append to ack)</h2><p class=muted>From the write to its ack, including any "
        "time the consumer was offline.</p>", _latency_chart(histogram, fleet, "end_to_end", "append to ack"),
        f"<h2>Backlog over time (per {step})</h2><p class=muted>Messages appended and not yet acked, expired "
        f"or compacted away, at the end of each {step}.</p>", _backlog_chart(series, seconds),
        f"<h2>Traffic per {step}</h2>", _traffic_chart(series, seconds),
        f"<h2>Consumers (top {min(len(consumers), TABLE_ROWS)} by backlog)</h2>", _consumer_table(consumers),
        "<h2>Refused writes</h2>", _refused_table(refused),
    ]
    if scq_queues:  # a lake without SCQ events gets no empty section
        sections += ["<h2>Shared compacted queues (SCQ)</h2><p class=muted>Each SCQ is written once and read by many "
                     "readers (a client or a <code>$share</code> group, each from its own position); the figures "
                     "above count ECQ queues only. Fan-out: acks per write.</p>", _scq_table(scq_queues)]
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>ECQ queue report</title>"
            f"<style>{_CSS}</style></head><body>{''.join(sections)}</body></html>")


def utc(ts_ms: int | None) -> str:
    """``2026-11-21 06:11:13 UTC`` for ms since the epoch; ``-`` for None."""
    if ts_ms is None:
        return "-"
    return datetime.fromtimestamp(ts_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def write_html(page: str, path: Path) -> Path:
    """Write ``page`` to ``path`` (creating its directory); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def _cards(fleet: dict[str, Any]) -> str:
    ratio = fleet["compaction_ratio"]
    cards = [("backlog", fleet["backlog"], f"{fleet['consumers_with_backlog']} of {fleet['consumers']} consumers"),
             ("delivery p99", _ms(fleet["delivery_p99_ms"]), f"sent to ack; p50 {_ms(fleet['delivery_p50_ms'])}"),
             ("end-to-end p99", _ms(fleet["end_to_end_p99_ms"]),
              f"append to ack; p50 {_ms(fleet['end_to_end_p50_ms'])}"),
             ("writes", fleet["appended"], f"compaction ratio {'-' if ratio is None else f'{ratio:.2f}'}"),
             ("deliveries", fleet["delivered"], f"{fleet['redeliveries']} redeliveries"),
             ("acks", fleet["acked"], f"{fleet['expired']} expired, {fleet['refused']} refused")]
    return "<div class=cards>" + "".join(
        f"<div class=card><span>{html.escape(label)}</span><b>{html.escape(str(value))}</b>"
        f"<span>{html.escape(note)}</span></div>" for label, value, note in cards) + "</div>"


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value} ms"


def _svg(fig: plt.Figure) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and DOCTYPE: inline SVG needs neither


def _latency_chart(histogram: Sequence[dict[str, Any]], fleet: dict[str, Any], name: str, measured: str) -> str:
    """Acks per bucket of the ``name`` latency (``delivery`` or ``end_to_end``), percentiles marked."""
    if not any(h[f"{name}_acks"] for h in histogram):
        return "<p class=muted>No acks with this latency in the lake yet.</p>"
    fig, ax = plt.subplots(figsize=(9, 3.2))
    positions = [h["bucket"] for h in histogram]
    ax.bar(positions, [h[f"{name}_acks"] for h in histogram], width=0.9, align="edge", color="#4c78a8")
    # a tick at every bucket edge: each bar's lower bound, and the last bar's upper bound at its right edge
    ax.set_xticks([*positions, positions[-1] + 1], [*(f"{h['lower_ms']}" for h in histogram),
                                                    f"{histogram[-1]['upper_ms']}"], rotation=45, ha="right")
    ax.set_xlabel(f"latency from {measured}, ms (bucket edges, log scale)")
    ax.set_ylabel("acks")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for label, colour, style in (("p50", "#54a24b", "--"), ("p95", "#f58518", "-."), ("p99", "#e45756", ":")):
        value = fleet[f"{name}_{label}_ms"]
        if value is not None:
            ax.axvline(_bucket_position(value, histogram), color=colour, linestyle=style, linewidth=1.5,
                       label=f"{label} {value} ms")
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _svg(fig)


def _bucket_position(latency_ms: float, histogram: Sequence[dict[str, Any]]) -> float:
    """Where a latency falls on the histogram's axis: its bucket number plus its place inside the bucket."""
    for h in histogram:
        if h["lower_ms"] <= latency_ms < h["upper_ms"]:
            return h["bucket"] + (latency_ms - h["lower_ms"]) / (h["upper_ms"] - h["lower_ms"])
    return histogram[-1]["bucket"] + 1.0


def _coarsen(over_time: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Merge runs of time buckets so that at most MAX_POINTS remain: counts are summed per run, the backlog
    is the one at the end of the run, the time the start of the run. Returns (rows, seconds per row)."""
    if not over_time:
        return [], 1
    step = max(1, -(-len(over_time) // MAX_POINTS))
    merged = []
    for start in range(0, len(over_time), step):
        run = over_time[start:start + step]
        merged.append({"start_ms": run[0]["start_ms"], "backlog": run[-1]["backlog"],
                       **{k: sum(r[k] for r in run) for k in ("writes", "deliveries", "acks")}})
    return merged, step * over_time[0]["bucket_s"]


def _duration(seconds: int) -> str:
    """``second``, ``minute``, ``hour`` for one of them, else ``2 seconds``, ``15 minutes``, ..."""
    for unit, size in (("hour", 3600), ("minute", 60)):
        if seconds % size == 0:
            count = seconds // size
            return unit if count == 1 else f"{count} {unit}s"
    return "second" if seconds == 1 else f"{seconds} seconds"


def _steps(series: Sequence[dict[str, Any]], column: str, seconds_per_step: int) -> tuple[list[datetime], list[Any]]:
    """(times, values) for a post-step line, with one more point so that the last step has its width too."""
    times = [datetime.fromtimestamp(r["start_ms"] / 1000, UTC) for r in series]
    values = [r[column] for r in series]
    if times:
        times.append(times[-1] + timedelta(seconds=seconds_per_step))
        values.append(values[-1])
    return times, values


def _time_axis(ax: plt.Axes, seconds_per_step: int) -> None:
    locator = mdates.AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=UTC))
    ax.set_xlabel(f"time (UTC), one step per {_duration(seconds_per_step)}")


def _backlog_chart(series: Sequence[dict[str, Any]], seconds: int) -> str:
    times, backlog = _steps(series, "backlog", seconds)
    fig, ax = plt.subplots(figsize=(9, 3))
    ax.step(times, backlog, where="post", color="#e45756")
    ax.fill_between(times, backlog, step="post", alpha=0.15, color="#e45756")
    ax.set_ylabel("messages in backlog")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    _time_axis(ax, seconds)
    return _svg(fig)


def _traffic_chart(series: Sequence[dict[str, Any]], seconds: int) -> str:
    return _svg(traffic_figure(series, seconds))


def traffic_figure(series: Sequence[dict[str, Any]], seconds: int) -> plt.Figure:
    """The traffic chart: writes, deliveries and acks per step of ``seconds`` (rows of `_coarsen`).

    While consumers keep up the three counts are equal and the lines lie on one another, so each is drawn
    narrower than the one below it (writes a wide pale band, deliveries inside it, acks a thin line on top):
    where they coincide every one still shows.
    """
    fig, ax = plt.subplots(figsize=(9, 3))
    for z, (name, colour, width, alpha) in enumerate((("writes", "#4c78a8", 7.0, 0.4),
                                                      ("deliveries", "#f58518", 3.6, 1.0),
                                                      ("acks", "#1b5e20", 1.2, 1.0))):
        ax.plot(*_steps(series, name, seconds), label=name, color=colour, linewidth=width, alpha=alpha,
                drawstyle="steps-post", solid_joinstyle="miter", zorder=2 + z)
    ax.set_ylabel(f"per {_duration(seconds)}")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _time_axis(ax, seconds)
    return fig


# (column, header, group header or None): the latency columns share a group header so that each header
# and each cell fits on one line and the 14 columns fit the page (no word-by-word wrapping)
_CONSUMER_COLUMNS = (("clientid", "clientid", None), ("backlog", "backlog", None), ("appended", "writes", None),
                     ("compaction_ratio", "compaction", None), ("delivered", "deliveries", None),
                     ("redeliveries", "redeliveries", None), ("acked", "acks", None), ("expired", "expired", None),
                     ("refused", "refused", None), ("delivery_p50_ms", "p50", "delivery ms"),
                     ("delivery_p99_ms", "p99", "delivery ms"), ("end_to_end_p50_ms", "p50", "end-to-end ms"),
                     ("end_to_end_p99_ms", "p99", "end-to-end ms"), ("last_event_ms", "last event (UTC)", None))


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column in ("compaction_ratio", "fan_out"):
        return f"{value:.2f}"
    if column == "last_event_ms":
        return utc(value).removesuffix(" UTC")  # the header says UTC
    return str(value)


def _consumer_table(consumers: Sequence[dict[str, Any]]) -> str:
    top, below = [], []
    for group, columns in groupby(_CONSUMER_COLUMNS, key=lambda c: c[2]):
        labels = [label for _, label, _ in columns]
        if group is None:
            top += [f"<th rowspan=2>{html.escape(label)}</th>" for label in labels]
        else:
            top.append(f"<th colspan={len(labels)} class=group>{html.escape(group)}</th>")
            below += [f"<th>{html.escape(label)}</th>" for label in labels]
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(column, row[column]))}</td>"
                                    for column, _, _ in _CONSUMER_COLUMNS) + "</tr>"
                   for row in consumers[:TABLE_ROWS])
    return f"<div class=scroll><table><tr>{''.join(top)}</tr><tr>{''.join(below)}</tr>{body}</table></div>"


_SCQ_COLUMNS = (("queue", "SCQ"), ("appended", "writes"), ("compacted", "compacted"), ("readers", "readers"),
                ("delivered", "deliveries"), ("redeliveries", "redeliveries"), ("acked", "acks"),
                ("fan_out", "fan-out"), ("refused", "refused"), ("last_event_ms", "last event (UTC)"))


def _scq_table(scq_queues: Sequence[dict[str, Any]]) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in _SCQ_COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(column, row[column]))}</td>"
                                    for column, _ in _SCQ_COLUMNS) + "</tr>" for row in scq_queues[:TABLE_ROWS])
    return f"<div class=scroll><table><tr>{head}</tr>{body}</table></div>"


def _refused_table(refused: Sequence[dict[str, Any]]) -> str:
    if not refused:
        return "<p class=muted>None.</p>"
    body = "".join(f"<tr><td>{html.escape(str(r['reason']))}</td><td>{r['refused']}</td></tr>" for r in refused)
    return f"<div class=scroll><table><tr><th>reason</th><th>writes</th></tr>{body}</table></div>"
