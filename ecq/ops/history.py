"""The dashboard's memory of the last minutes: the broker's counters sampled every few seconds into a ring
buffer, so that a page opened now can draw rates over the last ten minutes at once.

A sample is cheap and taken on the event loop: the Prometheus counters of :class:`ecq.ops.metrics.EcqMetrics`
(read through their public ``collect()``), the engine's in-memory totals, the lag index's totals and the event
recorder's counters. Nothing here reads the store, except the size of LevelDB's files on disk (a directory
listing, in a thread).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from ecq.ops.metrics import EcqMetrics
from ecq.queue.clock import now_ms
from ecq.queue.engine import QueueEngine

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 2.0   # one sample every 2 s ...
HISTORY_S = 600.0         # ... over the last 10 minutes
RATE_WINDOW_S = 60.0      # the headline rates: over the last minute (or since start, when younger)


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading: ``t_ms`` (ms since the epoch), ``counters`` (totals since broker start; refusals as
    ``refused:<reason>``) and ``gauges`` (values now)."""

    t_ms: int
    counters: dict[str, float]
    gauges: dict[str, float]


def counter_total(counter: Counter) -> float:
    """The sum of ``counter`` over every label set (0 before the first increment)."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def counter_by_label(counter: Counter, label: str) -> dict[str, float]:
    """``{label value: total}`` of a labelled ``counter`` (only label values counted at least once)."""
    return {s.labels[label]: s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")}


def read_counters(metrics: EcqMetrics, events: dict[str, Any]) -> dict[str, float]:
    """The counters the dashboard plots, as totals since start: writes, deliveries, redeliveries, acks,
    compactions, evictions (quota), gc_deleted (rows), gc_runs (passes), events_recorded, events_exported and
    ``refused:<reason>`` for each refusal reason seen. ``events`` is the event recorder's stats (may be {})."""
    counters = {
        "writes": counter_total(metrics.writes_accepted),
        "deliveries": counter_total(metrics.deliveries),
        "redeliveries": counter_total(metrics.redeliveries),
        "acks": counter_total(metrics.acks),
        "compactions": counter_total(metrics.compactions),
        "evictions": counter_total(metrics.quota_evictions),
        "gc_deleted": counter_total(metrics.gc_deleted),
        "gc_runs": counter_total(metrics.gc_runs),
        "events_recorded": float(events.get("recorded", 0)),
        "events_exported": float(events.get("exported_items", 0)),
    }
    counters.update({f"refused:{reason}": n for reason, n in counter_by_label(metrics.writes_refused, "reason").items()})
    return counters


def read_gauges(engine: QueueEngine) -> dict[str, float]:
    """Values now: queues, messages (stored entries), bytes (their payload bytes), inflight, consumers_online
    (engine totals, kept in memory), pending (entries not acked) and oldest_pending_age_s (lag index)."""
    totals = engine.totals()
    pending, age_s = engine.lag.totals()
    return {"queues": totals.queues, "messages": totals.stored_entries, "bytes": totals.stored_bytes,
            "inflight": totals.inflight, "consumers_online": totals.online, "pending": pending,
            "oldest_pending_age_s": round(age_s, 3)}


def disk_bytes(directory: Path) -> int | None:
    """Bytes of the regular files directly in ``directory`` (LevelDB keeps no subdirectories); None when it is
    not there. Blocking: call it in a thread."""
    try:
        with os.scandir(directory) as entries:
            return sum(e.stat().st_size for e in entries if e.is_file(follow_symlinks=False))
    except OSError:
        return None


def rate(newer: Sample | tuple[int, dict[str, float]], older: Sample, name: str) -> float | None:
    """Per second of counter ``name`` between two readings; None when less than 0.5 s apart."""
    t_ms, counters = (newer.t_ms, newer.counters) if isinstance(newer, Sample) else newer
    elapsed_s = (t_ms - older.t_ms) / 1000
    if elapsed_s < 0.5:
        return None
    return round(max(0.0, counters.get(name, 0.0) - older.counters.get(name, 0.0)) / elapsed_s, 3)


@dataclass
class History:
    """The ring buffer of samples (oldest first), the GC pass seen last and the LevelDB size on disk.

    ``read_events()`` returns the event recorder's stats; ``store_dir`` is LevelDB's directory (None on a
    cluster, whose store is NATS)."""

    engine: QueueEngine
    metrics: EcqMetrics
    read_events: Callable[[], dict[str, Any]]
    store_dir: Path | None = None
    interval_s: float = SAMPLE_INTERVAL_S
    samples: deque[Sample] = field(init=False)
    gc_pass: dict[str, Any] = field(init=False)
    disk: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.samples = deque(maxlen=int(HISTORY_S / self.interval_s) + 1)
        self.gc_pass = {"started_ms": None, "deleted_before": 0.0}

    def take(self) -> Sample:
        """Read the counters and gauges now and append them (dropping the oldest beyond ``HISTORY_S``)."""
        sample = Sample(now_ms(), read_counters(self.metrics, self.read_events()), read_gauges(self.engine))
        if self.samples and sample.counters["gc_runs"] > self.samples[-1].counters["gc_runs"]:
            self.gc_pass = {"started_ms": self.samples[-1].t_ms, "deleted_before": self.samples[-1].counters["gc_deleted"]}
        self.samples.append(sample)
        return sample

    async def run(self) -> None:
        """Sample every ``interval_s`` until cancelled (the admin app's lifetime)."""
        while True:
            try:
                self.take()
                if self.store_dir is not None:
                    self.disk = await asyncio.to_thread(disk_bytes, self.store_dir)
            except Exception:  # a sample missed leaves a gap, never stops the broker's API
                log.exception("ECQ dashboard sample failed")
            await asyncio.sleep(self.interval_s)

    def series(self) -> dict[str, Any]:
        """The samples as columns: ``t_ms`` (n sample times), ``rates`` ({counter: n-1 per-second rates, each
        over the interval ending at ``t_ms[i+1]``}) and ``gauges`` ({gauge: n values})."""
        samples = list(self.samples)
        names = sorted({name for s in samples for name in s.counters if name != "gc_runs"})
        pairs = list(zip(samples, samples[1:]))
        return {"t_ms": [s.t_ms for s in samples],
                "rates": {name: [rate(new, old, name) for old, new in pairs] for name in names},
                "gauges": {name: [s.gauges[name] for s in samples] for name in (samples[-1].gauges if samples else ())}}

    def rates_now(self, counters: dict[str, float], at_ms: int) -> dict[str, Any]:
        """Per-second rates of ``counters`` (read at ``at_ms``) over the last ``RATE_WINDOW_S`` or since the oldest
        sample: ``{"window_s": s, counter: rate}`` (rates None right after start, with no sample 0.5 s old)."""
        window = [s for s in self.samples if s.t_ms >= at_ms - RATE_WINDOW_S * 1000 - self.interval_s * 500]
        if not window:
            return {"window_s": None}
        older = window[0]
        rates = {name: rate((at_ms, counters), older, name) for name in counters if name != "gc_runs"}
        return {"window_s": round((at_ms - older.t_ms) / 1000, 1), **rates}

    def gc(self, counters: dict[str, float]) -> dict[str, Any]:
        """GC progress: ``running`` (a pass holds the engine's GC lock now), ``passes`` and ``deleted`` (rows,
        since start), ``interval_s`` (between passes), and for the running or last pass seen by the sampler
        ``pass_started_ms`` (within one sample interval; None before the first) and ``pass_deleted`` (rows)."""
        started = self.gc_pass["started_ms"]
        return {"running": self.engine.gc_lock.locked(), "passes": int(counters["gc_runs"]),
                "deleted": int(counters["gc_deleted"]), "interval_s": self.engine.settings.gc_interval,
                "pass_started_ms": started,
                "pass_deleted": int(counters["gc_deleted"] - self.gc_pass["deleted_before"]) if started else None}
