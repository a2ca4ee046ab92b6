"""The benchmark scenarios, each measured against its plain QoS 1 pub/sub baseline in the same run.

Every scenario starts its own brokers (a fresh ECQ data dir each time) unless --host/--port name one,
drives them through the :class:`~benchlib.loadgen.LoadPool`, and fills a :class:`~benchlib.report.ScenarioResult`
as it goes, so a scenario that times out still reports what it measured. Rates are messages per second
between the moment the load processes pass their start barrier and the last PUBACK or delivery.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho

from benchlib.brokers import EcqBroker, ExternalBroker, StockBroker, elapsed_s
from benchlib.loadgen import ConsumeTask, FlowTask, LoadPool, Messages, PublishTask, identified_payload, split
from benchlib.report import Row, ScenarioResult, source_digest
from benchlib.sampler import ResourceSampler, listen_drops, rss_split_bytes
from ecq.store.leveldb import LevelDbStore as Store
from ecq.store.protocol import Append
from ecq.queue.topics import queue_filter, write_topic

SETUP_ALLOWANCE_S = 180.0     # connecting thousands of clients before a phase's barrier, and the way back
MIN_RATE_PER_S = 300.0        # a phase gets count / MIN_RATE_PER_S seconds (at least 60) before TIMEOUT
IDLE_CPU_PCT = 10.0           # a broker below this CPU for IDLE_WINDOW_S has finished its backlog
IDLE_WINDOW_S = 1.0
IDLE_TIMEOUT_S = 180.0
ACKS_TIMEOUT_S = 15.0
GC_TIMEOUT_S = 1200.0
PRELOAD_BATCH = 10_000        # Appends per LevelDB write batch when the scale preload bypasses MQTT
MB = 1_000_000

REPO = Path(__file__).resolve().parents[2]
ECQ_WRITE = write_topic("{cid}", "{key}")  # str.format templates for the load processes
ECQ_QUEUE = queue_filter("{cid}")


def phase_deadline_s(messages: int) -> float:
    """How long a phase of ``messages`` may run before it counts as TIMEOUT."""
    return max(60.0, messages / MIN_RATE_PER_S)


def keys(count: int) -> tuple[str, ...]:
    """Compaction keys ``k0`` .. ``k<count-1>``."""
    return tuple(f"k{i}" for i in range(count))


class PhaseError(RuntimeError):
    """A load process reported an error; the message carries the first ones."""


@dataclass
class Bench:
    """What every scenario needs: options, load processes, sampler, a scratch directory, and the load checks so far."""

    args: Any
    pool: LoadPool
    sampler: ResourceSampler
    workdir: Path
    tag: str = ""
    load_checks: list[dict[str, Any]] = field(default_factory=list)
    brokers: list[dict[str, Any]] = field(default_factory=list)   # each broker run: config, log problems
    nats_pids: list[int] = field(default_factory=list)   # NATS servers running beside the brokers (cluster)

    def ids(self, prefix: str, count: int) -> tuple[str, ...]:
        """Clientids ``<tag><prefix><n>`` (the tag keeps runs against a long-lived broker apart)."""
        return tuple(f"{self.tag}{prefix}{i}" for i in range(count))

    @contextmanager
    def serving(self, broker, label: str) -> Iterator[Any]:
        """Start ``broker`` (one already running passes through), sample it, and stop it on the way out,
        keeping its configuration and the problems it logged (see :attr:`brokers`)."""
        started = time.monotonic()
        broker.start()
        self.sampler.watch(broker.pid)
        record = {"label": label, "broker": broker.name, "ready_s": elapsed_s(started),
                  "config": broker.config_in_use(), "source_digest": source_digest(REPO)}
        self.brokers.append(record)
        progress(f"{label}: broker ready in {record['ready_s']:.1f} s")
        try:
            yield broker
        finally:
            stopping = time.monotonic()
            record["stop"] = broker.stop()
            record["stop_s"] = elapsed_s(stopping)
            record["log_problems"] = broker.problems()
            if self.args.keep_logs and broker.log_path:
                self.args.keep_logs.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(broker.log_path, self.args.keep_logs / f"{label}.log")
            progress(f"{label}: broker stopped in {record['stop_s']:.1f} s ({record['stop']})")

    def new_ecq(self, workdir: Path, **options) -> EcqBroker:
        """An `ecq broker` (not started) on ``workdir`` with the --ecq-option options, then ``options``."""
        return EcqBroker(workdir, **{**self.args.ecq_options, **options})

    @contextmanager
    def ecq(self, name: str, **options) -> Iterator[EcqBroker | ExternalBroker]:
        """A fresh `ecq broker` with its data dir under the scratch dir (kept until the run ends, so the
        store can be checked after the broker stopped), or the --host/--port one."""
        broker = (ExternalBroker("ECQ at --host/--port", self.args.host, self.args.port) if self.args.port
                  else self.new_ecq(self.workdir / f"ecq-{name}", **options))
        with self.serving(broker, f"{name}-ecq") as running:
            yield running

    @contextmanager
    def baseline(self, name: str) -> Iterator[StockBroker | ExternalBroker]:
        """A fresh stock amqtt broker without ECQ, or the --baseline-host/--baseline-port one."""
        broker = (ExternalBroker("baseline at --baseline-host/--baseline-port", self.args.baseline_host,
                                 self.args.baseline_port) if self.args.baseline_port
                  else StockBroker(self.workdir / f"stock-{name}"))
        with self.serving(broker, f"{name}-baseline") as running:
            yield running

    def run_phase(self, tasks: list[Any], deadline_s: float) -> list[dict]:
        """Run one task per load process; raises PhaseError when a load process reported an error."""
        results = self.pool.run(tasks, deadline_s + SETUP_ALLOWANCE_S)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise PhaseError("; ".join(errors[:3]))
        return results

    def load_check(self, phase: str, broker, start_s: float, end_s: float,
                   load_pids: list[int] | None = None) -> dict[str, Any]:
        """CPU of the broker (summed over its processes when it has several, see broker_pids), the NATS
        servers (summed; None without), the load processes (``load_pids``, default the pool's), the machine
        and everything else over [start_s, end_s] (monotonic seconds); also kept for the load-check table."""
        broker_pct = self._cpu_sum(broker_pids(broker), start_s, end_s)
        nats_pct = self._cpu_sum(self.nats_pids, start_s, end_s)
        loads = [self.sampler.cpu_percent(pid, start_s, end_s) for pid in (load_pids or self.pool.pids)]
        machine = self.sampler.machine_percent(start_s, end_s)
        others = None
        if machine is not None:
            ours = (broker_pct or 0.0) + (nats_pct or 0.0) + sum(v or 0.0 for v in loads)
            others = round(max(0.0, machine * self.sampler.cores - ours), 1)
        peaks = [self.sampler.peak_rss_bytes(pid, start_s, end_s) for pid in broker_pids(broker)]
        check = {"phase": phase, "seconds": round(end_s - start_s, 3), "broker_cpu_pct": broker_pct,
                 "broker_peak_rss_mb": _mb(max((p for p in peaks if p is not None), default=None)),
                 "nats_cpu_pct": nats_pct,
                 "load_cpu_pct": loads, "machine_busy_pct": machine, "others_cpu_pct": others}
        self.load_checks.append(check)
        progress(f"{phase}: {check['seconds']:.1f} s, broker CPU {check['broker_cpu_pct']}%")
        return check

    def _cpu_sum(self, pids: list[int], start_s: float, end_s: float) -> float | None:
        """Summed CPU percent (of one core) of ``pids`` over [start_s, end_s]; None when none is known."""
        values = [v for v in (self.sampler.cpu_percent(pid, start_s, end_s) for pid in pids) if v is not None]
        return round(sum(values), 1) if values else None

    def wait_idle(self, broker) -> float:
        """Wait until each process of the broker, and each NATS server, stays below IDLE_CPU_PCT for
        IDLE_WINDOW_S (the backlog is done); returns the seconds waited (gives up after IDLE_TIMEOUT_S;
        returns at once when the broker has no pid)."""
        started = time.monotonic()
        pids = broker_pids(broker)
        if not pids:
            return 0.0
        pids += self.nats_pids
        time.sleep(IDLE_WINDOW_S)
        while time.monotonic() - started < IDLE_TIMEOUT_S:
            now = time.monotonic()
            busy = [self.sampler.cpu_percent(pid, now - IDLE_WINDOW_S, now) for pid in pids]
            if all(b is not None and b < IDLE_CPU_PCT for b in busy):
                break
            time.sleep(0.2)
        return elapsed_s(started)


def broker_pids(broker) -> list[int]:
    """The processes of what is measured as one broker: its ``pids`` when it has several (the nodes of a
    cluster), else its ``pid``; [] when not started here."""
    pids = getattr(broker, "pids", None)
    if pids is not None:
        return list(pids)
    return [broker.pid] if broker.pid else []


def progress(message: str) -> None:
    """A progress line on stderr (the table goes to stdout)."""
    print(f"[bench]   {message}", file=sys.stderr, flush=True)


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / MB, 1)


def _split_mb(split: dict[str, int] | None) -> dict[str, float] | None:
    return None if split is None else {part: _mb(size) for part, size in split.items()}


def _span_s(results: list[dict]) -> tuple[float, float]:
    """(first start, last end) of a phase in monotonic seconds."""
    start = min(r["start_ns"] for r in results) / 1e9
    end = max(max(r["end_ns"], r["start_ns"]) for r in results) / 1e9
    return start, end


def _errors(results: list[dict]) -> list[str]:
    return sorted({e for r in results for e in r.get("errors", [])})[:5]


# --- measuring building blocks ------------------------------------------------------------------------


def publish(bench: Bench, broker, phase: str, topic_format: str, cids: tuple[str, ...], key_names: tuple[str, ...],
            size: int, mqtt5: bool = False) -> dict[str, Any]:
    """QoS 1 PUBLISHes of ``size`` bytes to ``topic_format`` for every clientid x key, from all load
    processes (MQTT 5.0 clients with ``mqtt5``, else 3.1.1; the broker's endpoint must then be one
    :class:`~benchlib.loadgen.Endpoint`); acked per second from the barrier to the last PUBACK. Then waits
    until the broker is idle, so that the next phase never competes with this one's backlog; ``busy_after_s``
    (within 0.2 s) is how long it stayed busy after the last PUBACK (stock amqtt acknowledges before it
    routes) and ``per_s_until_idle`` the rate counted to then."""
    count = len(cids) * len(key_names)
    deadline = phase_deadline_s(count)
    endpoint = replace(broker.endpoint, mqtt5=True) if mqtt5 else broker.endpoint
    tasks = [PublishTask(endpoint, Messages(topic_format, part, key_names, size), f"{bench.tag}{phase}-p",
                         bench.args.connections, bench.args.window, deadline)
             for part in split(cids, bench.pool.size)]
    results = bench.run_phase(tasks, deadline)
    start, end = _span_s(results)
    acked = sum(r["acked"] for r in results)
    load = bench.load_check(phase, broker, start, end)
    busy_after_s = max(0.0, bench.wait_idle(broker) - IDLE_WINDOW_S)
    return {"messages": count, "acked": acked, "seconds": round(end - start, 3),
            "per_s": round(acked / (end - start), 1) if end > start else None,
            "busy_after_s": round(busy_after_s, 3), "per_s_until_idle": round(acked / (end - start + busy_after_s), 1)
            if end > start else None, "timed_out": any(r["timed_out"] for r in results),
            "errors": _errors(results), "load": load}


def consume(bench: Bench, broker, phase: str, make_task: Callable[[tuple[str, ...]], ConsumeTask],
            cids: tuple[str, ...], missing_into: list[str] | None = None) -> dict[str, Any]:
    """Consumers for ``cids`` spread over the load processes (``make_task`` builds each process's task);
    delivered per second from the barrier to the last delivery, with losses and duplicates. The
    ``<clientid>/<key>`` identities never received are appended to ``missing_into`` when given."""
    tasks = [make_task(part) for part in split(cids, bench.pool.size)]
    drops_before = listen_drops()
    results = bench.run_phase(tasks, tasks[0].deadline_s)
    drops_after = listen_drops()
    start, end = _span_s(results)
    unique = sum(r["unique"] for r in results)
    if missing_into is not None:
        missing_into.extend(m for r in results for m in r["missing_idents"])
    connects = sorted(t for r in results for t in r["connect_s"])
    return {"clients": sum(r["clients"] for r in results), "expected": sum(r["expected"] for r in results),
            "received": sum(r["received"] for r in results), "unique": unique,
            "duplicates": sum(r["duplicates"] for r in results), "unexpected": sum(r["unexpected"] for r in results),
            "missing": sum(r["missing"] for r in results),
            "missing_sample": [m for r in results for m in r["missing_idents"]][:10],
            "seconds": round(end - start, 3), "per_s": round(unique / (end - start), 1) if end > start else None,
            "connect_p50_s": quantile(connects, 0.5), "connect_max_s": quantile(connects, 1.0),
            "connect_failures": sum(r["connect_failures"] for r in results),
            "reconnects": sum(r["reconnects"] for r in results),
            "listen_drops": None if drops_before is None else drops_after - drops_before,
            "timed_out": any(r["timed_out"] for r in results), "errors": _errors(results),
            "load": bench.load_check(phase, broker, start, end) if unique else None}


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of sorted ``values``, rounded to 4 digits."""
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


def flow_tasks(bench: Bench, broker, phase: str, cids: tuple[str, ...], subscribe_format: str, write_format: str,
               duration_s: float, rate_per_s: float | None = None) -> list[FlowTask]:
    """One paced-flow task per load process, together sending ``rate_per_s`` (default --latency-rate)
    writes per second."""
    args = bench.args
    rate = args.latency_rate if rate_per_s is None else rate_per_s
    return [FlowTask(broker.endpoint, part, subscribe_format, write_format, f"{bench.tag}{phase}-p",
                     rate / bench.pool.size, duration_s, args.latency_size)
            for part in split(cids, bench.pool.size)]


def flow_summary(bench: Bench, broker, phase: str, results: list[dict],
                 window_s: tuple[float, float] | None = None) -> dict[str, Any]:
    """Latency (receive time - send time, ms) quantiles of a flow, optionally only of the messages sent in
    ``window_s`` (monotonic seconds); plus messages not delivered by the end of the grace period,
    duplicates, achieved rate and the load check."""
    samples = [s for r in results for s in r["samples"]]
    if window_s:
        samples = [s for s in samples if window_s[0] <= s[0] / 1e9 <= window_s[1]]
    latencies_ms = sorted(lat_us / 1000 for _sent, lat_us in samples)
    start = min(r["start_ns"] for r in results) / 1e9
    send_end = max(r["send_end_ns"] for r in results) / 1e9
    sent = sum(r["sent"] for r in results)
    return {"sent": sent, "received_unique": sum(r["unique"] for r in results),
            "undelivered": sent - sum(r["unique"] for r in results), "duplicates": sum(r["duplicates"] for r in results),
            "send_rate_per_s": round(sent / (send_end - start), 1) if send_end > start else None,
            "measured": len(latencies_ms), "p50_ms": quantile(latencies_ms, 0.5),
            "p99_ms": quantile(latencies_ms, 0.99), "max_ms": latencies_ms[-1] if latencies_ms else None,
            "p99_ms_by_second": p99_by_second(samples, start),
            "errors": _errors(results), "load": bench.load_check(phase, broker, *(window_s or (start, send_end)))}


def p99_by_second(samples: list[tuple[int, int]], start_s: float) -> list[float | None]:
    """p99 latency (ms) of the messages sent in each second of a flow (None for a second with no delivery):
    shows whether a tail comes from warm-up, from periodic stalls, or from a growing backlog."""
    buckets: dict[int, list[float]] = {}
    for sent_ns, lat_us in samples:
        buckets.setdefault(int(sent_ns / 1e9 - start_s), []).append(lat_us / 1000)
    last = max(buckets, default=-1)
    return [quantile(sorted(buckets[s]), 0.99) if s in buckets else None for s in range(last + 1)]


def flow(bench: Bench, broker, phase: str, cids: tuple[str, ...], subscribe_format: str,
         write_format: str, rate_per_s: float | None = None, duration_s: float | None = None) -> dict[str, Any]:
    """A paced realtime flow for ``duration_s`` (default --latency-seconds) to online consumers at
    ``rate_per_s`` writes per second (default --latency-rate); latency quantiles and losses."""
    duration_s = bench.args.latency_seconds if duration_s is None else duration_s
    tasks = flow_tasks(bench, broker, phase, cids, subscribe_format, write_format, duration_s, rate_per_s)
    results = bench.run_phase(tasks, duration_s + tasks[0].grace_s)
    return flow_summary(bench, broker, phase, results)


def store_check(queues_dir: Path, cids: tuple[str, ...], missing_idents: list[str]) -> dict[str, int]:
    """From a stopped broker's LevelDB (``<data_dir>/queues``): how many of ``cids`` have every stored entry acked, how many entries
    are still pending (stored, above the acked seqno, not acked out of order), and how many of the
    ``<clientid>/<key>`` identities a consumer never received are NOT pending: those are lost."""
    store = Store(queues_dir)
    try:
        pending: dict[str, set[str]] = {}
        for cid in cids:
            state = store.ack_state(cid)
            keys_pending = {m.key for m in store.read_after(cid, state.acked, 1 << 20) if m.seqno not in state.above}
            if keys_pending:
                pending[cid] = keys_pending
        lost = sum(1 for ident in missing_idents
                   if ident.split("/", 1)[1] not in pending.get(ident.split("/", 1)[0], set()))
        return {"queues": len(cids), "fully_acked": len(cids) - len(pending),
                "pending_entries": sum(len(keys) for keys in pending.values()), "undelivered_and_lost": lost}
    finally:
        store.close()


def wait_acks(broker, expected_total: int) -> float | None:
    """Seconds until the broker counted ``expected_total`` PUBACKs from consumers (ecq_acks_total);
    None when it has no admin API or not within ACKS_TIMEOUT_S."""
    if not isinstance(broker, EcqBroker):
        return None
    started = time.monotonic()
    while time.monotonic() - started < ACKS_TIMEOUT_S:
        if broker.metric("ecq_acks_total") >= expected_total:
            return elapsed_s(started)
        time.sleep(0.1)
    return None


# --- (1) writes ------------------------------------------------------------------------------------------

WRITE_TARGETS_PER_S = {256: 8000, 1024: 2000}
MIN_WRITE_RATIO = 0.8
MIN_V5_WRITE_RATIO = 0.9      # issue 25: MQTT 5 acked writes/s against 3.1.1 on the same ECQ broker


def writes(bench: Bench, out: ScenarioResult) -> None:
    """QoS 1 writes to $ECQ/w/<clientid>/<key> over --write-clientids x --write-keys, acked writes/s, per
    payload size; rounds alternate ECQ and baseline (plain topics bench/w/<clientid>/<key>, no subscriber),
    and each round also writes to ECQ over MQTT 5.0, right before or after its 3.1.1 ECQ run (the order
    alternates), for the row "v5 acked writes/s vs 3.1.1"."""
    args = bench.args
    cids, key_names = bench.ids("w", args.write_clientids), keys(args.write_keys)
    with bench.ecq("writes") as ecq, bench.baseline("writes") as plain:
        for size in args.write_sizes:
            runs: dict[str, list[dict]] = {"ecq": [], "ecq_v5": [], "baseline": []}
            out.details[f"{size}B"] = runs
            for round_no in range(args.write_rounds):
                for mqtt5 in (False, True) if round_no % 2 == 0 else (True, False):
                    runs["ecq_v5" if mqtt5 else "ecq"].append(publish(
                        bench, ecq, f"writes-{size}B-ecq{'-v5' if mqtt5 else ''}-{round_no}", ECQ_WRITE, cids,
                        key_names, size, mqtt5=mqtt5))
                runs["baseline"].append(publish(bench, plain, f"writes-{size}B-plain-{round_no}", "bench/w/{cid}/{key}",
                                                cids, key_names, size))
            out.rows.append(write_row(args, size, runs, len(cids) * len(key_names)))
            out.rows.append(v5_write_row(args, size, runs))


def write_row(args: Any, size: int, runs: dict[str, list[dict]], count: int) -> Row:
    """ECQ's (3.1.1) acked writes/s against the baseline's: medians of the rounds, with the issue's targets."""
    ecq_rate = statistics.median(r["per_s"] for r in runs["ecq"])
    plain_rate = statistics.median(r["per_s"] for r in runs["baseline"])
    floor = WRITE_TARGETS_PER_S.get(size)
    row = Row("writes", "acked writes/s", "/s", size, ecq_rate, plain_rate,
              (f">={floor}/s, " if floor else "") + f">={MIN_WRITE_RATIO}x")
    rate_ok = floor is None or ecq_rate >= floor
    ratio_ok = row.ratio is not None and row.ratio >= MIN_WRITE_RATIO
    row.met = rate_ok and ratio_ok
    row.note = (f"median of {args.write_rounds} rounds of {count}; "
                + (f"{floor}/s {'met' if rate_ok else 'missed'}, " if floor else "")
                + f"{MIN_WRITE_RATIO}x {'met' if ratio_ok else 'missed'}")
    return row


def v5_write_row(args: Any, size: int, runs: dict[str, list[dict]]) -> Row:
    """ECQ's acked writes/s over MQTT 5.0 (ECQ column) against its 3.1.1 figure of the same rounds (baseline
    column): medians, the ratio's target MIN_V5_WRITE_RATIO. The note gives each round's own ratio and the
    median broker CPU per write of each protocol (µs): a second view of the same runs."""
    v5_rate = statistics.median(r["per_s"] for r in runs["ecq_v5"])
    v311_rate = statistics.median(r["per_s"] for r in runs["ecq"])
    row = Row("writes", "v5 acked writes/s vs 3.1.1, same run", "/s", size, v5_rate, v311_rate,
              f">={MIN_V5_WRITE_RATIO}x")
    row.met = row.ratio is not None and row.ratio >= MIN_V5_WRITE_RATIO
    per_round = [f"{v5['per_s'] / v311['per_s']:.2f}" for v5, v311 in zip(runs["ecq_v5"], runs["ecq"])
                 if v5["per_s"] and v311["per_s"]]
    row.note = (f"medians of {args.write_rounds} interleaved rounds; per round {', '.join(per_round)}; broker CPU "
                f"per write v5 {_median_cpu_us(runs['ecq_v5'])} µs, 3.1.1 {_median_cpu_us(runs['ecq'])} µs")
    return row


def _median_cpu_us(runs: list[dict]) -> str:
    """The median over ``runs`` (results of :func:`publish`) of the broker's CPU µs per acked write; ``-`` when
    no run has its broker's CPU (a broker not started here)."""
    values = [r["load"]["broker_cpu_pct"] / 100 * r["seconds"] / r["acked"] * 1e6 for r in runs
              if r["load"]["broker_cpu_pct"] is not None and r["acked"]]
    return f"{statistics.median(values):.0f}" if values else "-"


# --- (2) reads -------------------------------------------------------------------------------------------

READ_TARGET_PER_S = 3000


def reads(bench: Bench, out: ScenarioResult) -> None:
    """--read-consumers consumers drain --read-keys preloaded entries each; deliveries/s, acks checked in the
    store afterwards. Baseline: as many plain subscribers, one topic each, and the same count published."""
    args = bench.args
    size, key_names = args.read_size, keys(args.read_keys)
    rounds: list[dict[str, Any]] = []
    out.details["rounds"] = rounds
    all_cids: list[str] = []
    missing: list[str] = []
    deadline = phase_deadline_s(args.read_consumers * args.read_keys)
    with bench.ecq("reads") as ecq, bench.baseline("reads") as plain:
        for round_no in range(args.read_rounds):
            cids = bench.ids(f"r{round_no}-", args.read_consumers)
            all_cids.extend(cids)
            entry: dict[str, Any] = {}
            rounds.append(entry)
            entry["ecq_preload"] = publish(bench, ecq, f"reads-preload-{round_no}", ECQ_WRITE, cids, key_names, size)
            entry["ecq"] = consume(bench, ecq, f"reads-ecq-{round_no}", lambda part: ConsumeTask(
                ecq.endpoint, part, key_names, ECQ_QUEUE, subscribe_after_start=True, deadline_s=deadline), cids,
                missing)
            entry["ecq"]["acks_counted_after_s"] = wait_acks(ecq, args.read_consumers * args.read_keys * (round_no + 1))
            entry["baseline"] = consume(bench, plain, f"reads-plain-{round_no}", lambda part: ConsumeTask(
                plain.endpoint, part, key_names, "bench/r/{cid}", deadline_s=deadline,
                then_publish=PublishTask(plain.endpoint, Messages("bench/r/{cid}", part, key_names, size),
                                         f"{bench.tag}reads-plain-p", args.connections, args.window)), cids)
    if isinstance(ecq, EcqBroker):
        out.details["acks_in_store"] = store_check(ecq.queues_dir, tuple(all_cids), missing)
    ecq_rate = statistics.median(r["ecq"]["per_s"] for r in rounds)
    plain_rate = statistics.median(r["baseline"]["per_s"] for r in rounds)
    missing_total = sum(r["ecq"]["missing"] for r in rounds)
    row = Row("reads", "deliveries/s", "/s", size, ecq_rate, plain_rate, f">={READ_TARGET_PER_S}/s",
              ecq_rate >= READ_TARGET_PER_S and missing_total == 0)
    stored = out.details.get("acks_in_store")
    row.note = (f"median of {args.read_rounds} rounds of {args.read_consumers}x{args.read_keys}; missing {missing_total}"
                + (f"; acks in store: {stored['fully_acked']}/{stored['queues']} queues fully acked" if stored else ""))
    out.rows.append(row)


# --- (3) latency ------------------------------------------------------------------------------------------

LATENCY_TARGET_P99_MS = 20.0


def latency(bench: Bench, out: ScenarioResult) -> None:
    """A paced flow of --latency-rate writes/s to --latency-consumers online consumers for --latency-seconds;
    write-to-delivery latency p50/p99. Baseline: the same flow on plain topics bench/l/<clientid>."""
    cids = bench.ids("l", bench.args.latency_consumers)
    with bench.ecq("latency") as ecq:
        out.details["ecq"] = flow(bench, ecq, "latency-ecq", cids, ECQ_QUEUE, ECQ_WRITE)
    with bench.baseline("latency") as plain:
        out.details["baseline"] = flow(bench, plain, "latency-plain", cids, "bench/l/{cid}", "bench/l/{cid}")
    ecq, base, size = out.details["ecq"], out.details["baseline"], bench.args.latency_size
    out.rows.append(Row("latency", f"p50 @{bench.args.latency_rate:g}/s", "ms", size, ecq["p50_ms"], base["p50_ms"]))
    out.rows.append(Row("latency", f"p99 @{bench.args.latency_rate:g}/s", "ms", size, ecq["p99_ms"], base["p99_ms"],
                        f"<={LATENCY_TARGET_P99_MS:g} ms", ecq["p99_ms"] is not None
                        and ecq["p99_ms"] <= LATENCY_TARGET_P99_MS and ecq["undelivered"] == 0,
                        note=f"{ecq['undelivered']} of {ecq['sent']} not delivered within 10 s of the last send; "
                             f"duplicates {ecq['duplicates']}"))


# --- (4) reconnect storm ------------------------------------------------------------------------------------


def storm(bench: Bench, out: ScenarioResult) -> None:
    """--storm-consumers consumers with --storm-keys pending each all connect at once (clean session, then
    SUBSCRIBE $ECQ/<clientid>/#); time until every message is delivered, lost and duplicates.
    Baseline: persistent sessions (clean_session=False) subscribed to bench/s/<clientid>, offline while the
    same messages were published (amqtt keeps them in its offline queue), reconnecting at once."""
    args = bench.args
    cids, key_names, size = bench.ids("s", args.storm_consumers), keys(args.storm_keys), args.storm_size
    deadline = phase_deadline_s(len(cids) * len(key_names))
    with bench.ecq("storm") as ecq:
        out.details["ecq_preload"] = publish(bench, ecq, "storm-preload-ecq", ECQ_WRITE, cids, key_names, size)
        missing: list[str] = []
        out.details["ecq"] = consume(bench, ecq, "storm-ecq", lambda part: ConsumeTask(
            ecq.endpoint, part, key_names, ECQ_QUEUE, connect_after_start=True, deadline_s=deadline), cids, missing)
        out.details["ecq"]["acks_counted_after_s"] = wait_acks(ecq, len(cids) * len(key_names))
    if isinstance(ecq, EcqBroker):
        out.details["ecq"]["acks_in_store"] = store_check(ecq.queues_dir, cids, missing)
    with bench.baseline("storm") as plain:
        out.details["baseline_sessions"] = consume(bench, plain, "storm-sessions-plain", lambda part: ConsumeTask(
            plain.endpoint, part, (), "bench/s/{cid}", clean_session=False, deadline_s=deadline), cids)
        out.details["baseline_preload"] = publish(bench, plain, "storm-preload-plain", "bench/s/{cid}", cids,
                                                  key_names, size)
        out.details["baseline"] = consume(bench, plain, "storm-plain", lambda part: ConsumeTask(
            plain.endpoint, part, key_names, None, clean_session=False, connect_after_start=True,
            deadline_s=deadline), cids)
    ecq_run, base_run = out.details["ecq"], out.details["baseline"]
    total = len(cids) * len(key_names)
    still_stored = ecq_run.get("acks_in_store", {}).get("pending_entries")
    lost = ecq_run.get("acks_in_store", {}).get("undelivered_and_lost")
    out.rows.append(Row("storm", f"all {total} delivered", "s", size, _storm_seconds(ecq_run), _storm_seconds(base_run),
                        "all delivered, 0 lost", ecq_run["missing"] == 0 and not ecq_run["timed_out"],
                        note=f"{len(cids)} consumers at once; ECQ connect p50 {ecq_run['connect_p50_s']} s, max "
                             f"{ecq_run['connect_max_s']} s; SYNs dropped by full listen queues: {ecq_run['listen_drops']}"))
    out.rows.append(Row("storm", "undelivered at deadline", "msgs", size, ecq_run["missing"], base_run["missing"], "0",
                        ecq_run["missing"] == 0,
                        note="" if still_stored is None else f"still pending in the ECQ store afterwards: {still_stored}"))
    out.rows.append(Row("storm", "lost (gone from the store)", "msgs", size, lost, None, "0",
                        None if lost is None else lost == 0))
    out.rows.append(Row("storm", "duplicates", "msgs", size, ecq_run["duplicates"], base_run["duplicates"]))


def _storm_seconds(run: dict[str, Any]) -> float | None:
    """Seconds to deliver everything, or None when something never arrived."""
    return run["seconds"] if run["missing"] == 0 and not run["timed_out"] else None


# --- (5) scale and GC ----------------------------------------------------------------------------------------

RSS_LIMIT_MB = 300
RSS_GROWTH_LIMIT_MB = 50
GC_P99_FACTOR = 2.0
SCALE_KEYS = 10
SCALE_DRAINERS = 1000         # consumers draining their queues at each checkpoint (at most half the queues)


def scale(bench: Bench, out: ScenarioResult) -> None:
    """--scale-entries / 10 queues: first 1 key each written over MQTT (the small checkpoint), then keys
    k1..k9 added straight into the data dir with ecq.store.leveldb.LevelDbStore while the broker is stopped (this preload
    bypasses MQTT), then one more MQTT write per queue. At each checkpoint: broker RSS after traffic that
    touched every queue, and disk bytes per stored entry. Finally GC of every entry, with the p99 of a
    paced realtime flow during GC next to the same flow without GC."""
    if bench.args.port:
        out.status, out.message = "skipped", "needs a broker this run starts (it preloads the data dir)"
        return
    args = bench.args
    queues = args.scale_entries // SCALE_KEYS
    cids = bench.ids("q", queues)
    drainers = min(SCALE_DRAINERS, queues // 2)
    workdir = bench.workdir / "ecq-scale"
    try:
        out.details["small"] = scale_checkpoint(bench, workdir, "small", cids, cids[:drainers], ("k0",))
        out.details["preload_direct"] = preload_store(workdir / "data" / "queues", cids, keys(SCALE_KEYS)[1:], args.scale_size)
        out.details["large"] = scale_checkpoint(bench, workdir, "large", cids, cids[drainers:2 * drainers],
                                                keys(SCALE_KEYS))
        scale_rows(out, args.scale_size)
        out.details["gc"] = gc_under_flow(bench, workdir)
        gc_rows(out, args.latency_size)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def scale_checkpoint(bench: Bench, workdir: Path, label: str, cids: tuple[str, ...], drainers: tuple[str, ...],
                     drained_keys: tuple[str, ...]) -> dict[str, Any]:
    """Start the broker on ``workdir``, write k0 of every queue over MQTT, let ``drainers`` drain their
    queues, then read RSS and the data dir's size; stops the broker."""
    size = bench.args.scale_size
    started = time.monotonic()
    result: dict[str, Any] = {}
    with bench.serving(bench.new_ecq(workdir), f"scale-{label}") as broker:
        result["ready_s"] = elapsed_s(started)
        result["rss_at_start_mb"] = _mb(bench.sampler.rss_bytes(broker.pid))
        result["rss_at_start_split_mb"] = _split_mb(rss_split_bytes(broker.pid))
        result["mqtt_writes"] = publish(bench, broker, f"scale-{label}-writes", ECQ_WRITE, cids, ("k0",), size)
        result["drain"] = consume(bench, broker, f"scale-{label}-drain", lambda part: ConsumeTask(
            broker.endpoint, part, drained_keys, ECQ_QUEUE, subscribe_after_start=True,
            deadline_s=phase_deadline_s(len(drainers) * len(drained_keys))), drainers)
        bench.wait_idle(broker)
        status = broker.admin("GET", "/api/v1/status")
        result["stored_entries"] = status["messages"]
        result["queues"] = status["queues"]
        result["rss_mb"] = _mb(bench.sampler.rss_bytes(broker.pid))
        result["rss_split_mb"] = _split_mb(rss_split_bytes(broker.pid))
        result["peak_rss_mb"] = _mb(bench.sampler.peak_rss_bytes(broker.pid, started, time.monotonic()))
    result["disk_bytes"] = dir_bytes(workdir / "data" / "queues")
    result["disk_bytes_per_entry"] = round(result["disk_bytes"] / max(1, result["stored_entries"]), 1)
    result["other_data_dir_bytes"] = {sub.name: dir_bytes(sub) for sub in (workdir / "data").iterdir()
                                      if sub.is_dir() and sub.name != "queues"}
    result["seconds"] = elapsed_s(started)
    return result


def dir_bytes(path: Path) -> int:
    """Total size of the files under ``path`` in bytes (what `du -b` counts)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def preload_store(queues_dir: Path, cids: tuple[str, ...], key_names: tuple[str, ...], size: int) -> dict[str, Any]:
    """Append every clientid x key (``size``-byte payloads ``<clientid>/<key>|<random bytes>``, published a
    day ago, so GC may delete them) straight into the stopped broker's LevelDB, PRELOAD_BATCH per write batch. Bypasses MQTT."""
    started = time.monotonic()
    day_ago_ms = int(time.time() * 1000) - 86_400_000
    store = Store(queues_dir)
    try:
        for key in key_names:
            for part in range(0, len(cids), PRELOAD_BATCH):
                store.commit([Append(cid, key, identified_payload(f"{cid}/{key}", os.urandom(size)), day_ago_ms)
                              for cid in cids[part:part + PRELOAD_BATCH]])
    finally:
        store.close()
    entries = len(cids) * len(key_names)
    seconds = elapsed_s(started)
    return {"entries": entries, "seconds": seconds, "per_s": round(entries / seconds, 1), "bypassed_mqtt": True}


def scale_rows(out: ScenarioResult, size: int) -> None:
    """RSS and disk rows for both checkpoints."""
    small, large = out.details["small"], out.details["large"]
    for point in (small, large):
        entries = point["stored_entries"]
        split = point["rss_split_mb"] or {}
        out.rows.append(Row("scale", f"broker RSS @{entries:,} stored", "MB", size, point["rss_mb"], None,
                            f"<{RSS_LIMIT_MB} MB", point["rss_mb"] < RSS_LIMIT_MB,
                            note=f"{point['queues']:,} queues; peak {point['peak_rss_mb']} MB; mapped files "
                                 f"{split.get('file')} MB"))
        out.rows.append(Row("scale", f"  of which anon @{entries:,}", "MB", size, split.get("anon"), None,
                            note="heap and stacks; the rest is mapped files: libraries and LevelDB tables"))
    growth = round(large["rss_mb"] - small["rss_mb"], 1)
    anon_growth = None
    if small["rss_split_mb"] and large["rss_split_mb"]:
        anon_growth = round(large["rss_split_mb"]["anon"] - small["rss_split_mb"]["anon"], 1)
    out.rows.append(Row("scale", "RSS growth small->large", "MB", size, growth, None, f"<{RSS_GROWTH_LIMIT_MB} MB",
                        growth < RSS_GROWTH_LIMIT_MB, note=f"anon part grew {anon_growth} MB"))
    for point in (small, large):
        out.rows.append(Row("scale", f"disk per entry @{point['stored_entries']:,}", "B", size,
                            point["disk_bytes_per_entry"], note=f"{point['disk_bytes']:,} bytes of LevelDB files"))


def gc_under_flow(bench: Bench, workdir: Path) -> dict[str, Any]:
    """Restart with data_retention short enough that everything stored is expired, run the paced flow
    without GC, then again while POST /api/v1/gc runs; p99 during GC against p99 without."""
    retention_s = 10
    result: dict[str, Any] = {"data_retention_s": retention_s}
    with bench.serving(bench.new_ecq(workdir, data_retention=f"{retention_s}s", gc_interval="1d"), "scale-gc") as broker:
        result["stored_before"] = broker.admin("GET", "/api/v1/status")["messages"]
        time.sleep(retention_s)  # the last MQTT writes of the checkpoint are now expired too
        cids = bench.ids("g", bench.args.latency_consumers)
        result["flow_rate_per_s"] = bench.args.gc_rate
        result["no_gc"] = flow(bench, broker, "gc-flow-without-gc", cids, ECQ_QUEUE, ECQ_WRITE, bench.args.gc_rate)
        result["during_gc"] = flow_with_gc(bench, broker, cids)
        result["stored_after"] = broker.admin("GET", "/api/v1/status")["messages"]
    return result


def flow_with_gc(bench: Bench, broker: EcqBroker, cids: tuple[str, ...]) -> dict[str, Any]:
    """The paced flow, with a GC pass started 2 s in; the flow stops 1 s after the GC call returns."""
    tasks = flow_tasks(bench, broker, "gc-flow", cids, ECQ_QUEUE, ECQ_WRITE, GC_TIMEOUT_S, bench.args.gc_rate)
    bench.pool.submit(tasks)
    gc: dict[str, Any] = {}
    if bench.pool.flowing.wait(SETUP_ALLOWANCE_S):
        time.sleep(2)
        gc_start = time.monotonic()
        try:
            gc["answer"] = broker.admin("POST", "/api/v1/gc", timeout_s=GC_TIMEOUT_S)
        except OSError as exc:
            gc["error"] = str(exc)
        gc_end = time.monotonic()
        gc["seconds"] = round(gc_end - gc_start, 3)
        time.sleep(1)
    bench.pool.stop.set()
    results = bench.pool.collect(GC_TIMEOUT_S + SETUP_ALLOWANCE_S)
    errors = [r["error"] for r in results if "error" in r]
    if errors or "seconds" not in gc:
        raise PhaseError("; ".join(errors[:3]) or "the flow never started")
    return {"gc": gc, **flow_summary(bench, broker, "gc-flow-during-gc", results, (gc_start, gc_end))}


def gc_rows(out: ScenarioResult, size: int) -> None:
    """GC time and the p99 during GC against the p99 without GC (the baseline of that row)."""
    gc = out.details["gc"]
    during, without = gc["during_gc"], gc["no_gc"]
    deleted = during["gc"].get("answer", {}).get("deleted")
    out.rows.append(Row("gc", f"full pass, {deleted:,} deleted" if deleted is not None else "full pass", "s", None,
                        during["gc"]["seconds"], note=f"{gc['stored_before']:,} stored before, {gc['stored_after']:,} after"))
    ok = (during["p99_ms"] is not None and without["p99_ms"] is not None
          and during["p99_ms"] <= GC_P99_FACTOR * without["p99_ms"])
    rate = gc.get("flow_rate_per_s")
    metric = f"delivery p99 @{rate:g}/s during GC vs without" if rate else "delivery p99 during GC vs without"
    out.rows.append(Row("gc", metric, "ms", size, during["p99_ms"], without["p99_ms"],
                        f"<={GC_P99_FACTOR:g}x", bool(ok) and during["undelivered"] == 0,
                        note=f"{during['measured']} delivered of those sent during GC; flow total "
                             f"{during['undelivered']} of {during['sent']} not delivered in time"))


# --- single producer (the original scripts/bench figure) ------------------------------------------------------


def single_producer(bench: Bench, out: ScenarioResult) -> None:
    """One paho producer (no load processes) pipelines --single-writes QoS 1 writes over --single-clientids
    and waits for every PUBACK; the baseline is the same producer on plain topics. Alternating runs, medians."""
    args = bench.args
    payload = os.urandom(args.single_size)
    runs: dict[str, list[float]] = {"ecq": [], "baseline": []}
    out.details["runs_per_s"] = runs
    with bench.ecq("single") as ecq, bench.baseline("single") as plain:
        for run in range(args.single_repeats):
            ecq_topics = [write_topic(f"{bench.tag}bench{i % args.single_clientids}",
                                      f"r{run}k{i // args.single_clientids}")
                          for i in range(args.single_writes)]
            plain_topics = [f"bench/plain/{i % args.single_clientids}/k{i // args.single_clientids}"
                            for i in range(args.single_writes)]
            runs["ecq"].append(round(paho_publish_all(ecq.endpoint, ecq_topics, payload)))
            runs["baseline"].append(round(paho_publish_all(plain.endpoint, plain_topics, payload)))
    out.rows.append(Row("single-producer", "acked writes/s", "/s", args.single_size, statistics.median(runs["ecq"]),
                        statistics.median(runs["baseline"]),
                        note=f"1 paho client, {args.single_writes} writes, median of {args.single_repeats}"))


def paho_publish_all(endpoint, topics: list[str], payload: bytes) -> float:
    """Pipeline one QoS 1 PUBLISH per topic from one paho connection; returns PUBLISHes acked per second.

    Raises TimeoutError when not every PUBACK came within phase_deadline_s(len(topics)).
    """
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"bench-{time.monotonic_ns()}",
                         protocol=paho.MQTTv311)
    client.username_pw_set(endpoint.username)
    client.max_inflight_messages_set(1000)
    client.max_queued_messages_set(0)
    done = threading.Event()
    acked = [0]

    def on_publish(*_args):
        acked[0] += 1
        if acked[0] == len(topics):
            done.set()

    client.on_publish = on_publish
    client.connect(endpoint.host, endpoint.port)
    client.loop_start()
    try:
        start = time.perf_counter()
        for topic in topics:
            client.publish(topic, payload, qos=1)
        if not done.wait(phase_deadline_s(len(topics))):
            raise TimeoutError(f"only {acked[0]} of {len(topics)} PUBLISHes acknowledged")
        return len(topics) / (time.perf_counter() - start)
    finally:
        client.disconnect()
        client.loop_stop()


# --- cluster on NATS JetStream ---------------------------------------------------------------------------------


def cluster(bench: Bench, out: ScenarioResult) -> None:
    """The cluster scenario, in benchlib.cluster (imported here when it runs, since it builds on this module)."""
    from benchlib.cluster import cluster as cluster_scenario
    cluster_scenario(bench, out)


from benchlib.failover import failover  # noqa: E402  (issue 24 point 5)

SCENARIOS: dict[str, Callable[[Bench, ScenarioResult], None]] = {
    "writes": writes, "reads": reads, "latency": latency, "storm": storm, "scale": scale,
    "single-producer": single_producer, "cluster": cluster, "failover": failover}


def netdelay(bench: Bench, out: ScenarioResult) -> None:
    """The netdelay scenario, in benchlib.netdelay (imported when it runs, since it builds on this module)."""
    from benchlib.netdelay import netdelay as netdelay_scenario
    netdelay_scenario(bench, out)


SCENARIOS["netdelay"] = netdelay


def fleet(bench: Bench, out: ScenarioResult) -> None:
    """The fleet scenario (issue 32), in benchlib.fleet (imported when it runs, since it builds on this module)."""
    from benchlib.fleet import fleet as fleet_scenario
    fleet_scenario(bench, out)


SCENARIOS["fleet"] = fleet


def fanout(bench: Bench, out: ScenarioResult) -> None:
    """The fanout scenario (issue 33 point 8), in benchlib.fanout (imported when it runs, since it builds on this
    module)."""
    from benchlib.fanout import fanout as fanout_scenario
    fanout_scenario(bench, out)


SCENARIOS["fanout"] = fanout


def floor(bench: Bench, out: ScenarioResult) -> None:
    """The floor scenario (issue 32: what a Python server costs per device), in benchlib.floor (imported when it
    runs, since it builds on this module)."""
    from benchlib.floor import floor as floor_scenario
    floor_scenario(bench, out)


SCENARIOS["floor"] = floor
