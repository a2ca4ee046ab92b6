"""The cluster scenario's table: each figure of a JetStream configuration beside LevelDB's from the same run,
with the issue-24 targets (a ratio against LevelDB, or an absolute floor) and whether each is met."""

from __future__ import annotations

from typing import Any

from benchlib.report import Row, ScenarioResult

TITLES = {"leveldb": "LevelDB, 1 node", "jetstream-1": "JetStream, 1 node", "jetstream-2": "JetStream, 2 nodes"}
WRITES_MIN_RATIO = 0.6        # acked writes/s of one JetStream node against one LevelDB broker
CPU_MAX_RATIO = 3.0           # CPU per write, ECQ node(s) + NATS servers, against the LevelDB broker's
ONE_QUEUE_MIN_PER_S = 2000.0  # deliveries/s of one consumer draining its stored queue
P50_MAX_RATIO = 2.0           # steady-state write-to-delivery latency at --cluster-rate
P99_MAX_RATIO = 1.2
IDLE_MAX_PCT = 2.0            # CPU % of one core per idle node holding --cluster-idle-entries


def cpu_ms_per_write(writes: dict[str, Any]) -> dict[str, float | None]:
    """CPU milliseconds per acked write of the write phase, per process kind: ``ecq`` (the node(s)),
    ``nats`` (the servers, summed), ``cluster`` (both) and ``load`` (the load processes, summed)."""
    load, acked = writes["load"], writes["acked"]

    def per_write(percent: float | None) -> float | None:
        if percent is None or not acked:
            return None
        return round(percent / 100 * load["seconds"] * 1000 / acked, 3)

    ecq, nats = per_write(load["broker_cpu_pct"]), per_write(load["nats_cpu_pct"])
    return {"ecq": ecq, "nats": nats, "cluster": None if ecq is None else round(ecq + (nats or 0.0), 3),
            "load": per_write(sum(v or 0.0 for v in load["load_cpu_pct"]))}


def cluster_rows(bench: Any, out: ScenarioResult) -> None:
    """A row per figure and JetStream configuration, against LevelDB's figure as the baseline; what a
    configuration did not measure (timeout, error) is left out."""
    for run in out.details.values():
        if "writes" in run:
            run["cpu_ms_per_write"] = cpu_ms_per_write(run["writes"])
    base = out.details.get("leveldb", {})
    for name in ("jetstream-1", "jetstream-2"):
        run = out.details.get(name, {})
        rows = (_write_rows(name, run, base) + _read_rows(name, run, base)
                + _flow_rows(name, run, base, bench.args.cluster_rate) + _idle_rows(name, run, base))
        for row in rows:
            row.payload_bytes = bench.args.cluster_size
        out.rows.extend(rows)


def _ratio_row(metric: str, unit: str, value: float | None, baseline: float | None, target: str,
               bound: float | None, higher_is_better: bool, note: str = "") -> Row:
    """A row whose target is ``bound`` times the baseline (None: no target)."""
    row = Row("cluster", metric, unit, None, value, baseline, target, note=note)
    if bound is not None and row.ratio is not None:
        row.met = row.ratio >= bound if higher_is_better else row.ratio <= bound
    return row


def _write_rows(name: str, run: dict[str, Any], base: dict[str, Any]) -> list[Row]:
    title, rows = TITLES[name], []
    if "writes" in run:
        one_node = name == "jetstream-1"
        rows.append(_ratio_row(f"acked writes/s, {title}", "/s", run["writes"]["per_s"], _get(base, "writes", "per_s"),
                               f">={WRITES_MIN_RATIO}x" if one_node else "", WRITES_MIN_RATIO if one_node else None,
                               True, f"{run['writes']['acked']} of {run['writes']['messages']}"))
    if "cpu_ms_per_write" in run:
        cpu = run["cpu_ms_per_write"]
        rows.append(_ratio_row(f"CPU per write, ECQ + NATS, {title}", "ms", cpu["cluster"],
                               base.get("cpu_ms_per_write", {}).get("ecq"), f"<={CPU_MAX_RATIO:g}x", CPU_MAX_RATIO,
                               False, f"ECQ node(s) {cpu['ecq']} + NATS servers {cpu['nats']} ms; load procs "
                                      f"{cpu['load']} ms; over the write phase"))
    return rows


def _read_rows(name: str, run: dict[str, Any], base: dict[str, Any]) -> list[Row]:
    title, rows = TITLES[name], []
    if "reads" in run:
        reads = run["reads"]
        rows.append(Row("cluster", f"deliveries/s, 1,000 queues, {title}", "/s", None, reads["per_s"],
                        _get(base, "reads", "per_s"),
                        note=f"reactive drain; missing {reads['missing']}, duplicates {reads['duplicates']}"))
    if "one_queue" in run:
        one = run["one_queue"]
        row = Row("cluster", f"deliveries/s, one queue, {title}", "/s", None, one["per_s"],
                  _get(base, "one_queue", "per_s"), f">={ONE_QUEUE_MIN_PER_S:,.0f}/s",
                  note=f"one consumer drains {one['expected']} stored entries; missing {one['missing']}, "
                       f"duplicates {one['duplicates']}")
        row.met = one["per_s"] is not None and one["per_s"] >= ONE_QUEUE_MIN_PER_S and not one["missing"]
        rows.append(row)
    return rows


def _flow_rows(name: str, run: dict[str, Any], base: dict[str, Any], rate: float) -> list[Row]:
    if "flow" not in run:
        return []
    title, flow, base_flow = TITLES[name], run["flow"], base.get("flow", {})
    steady, base_steady = flow["steady"], base_flow.get("steady", {})
    first, base_first = flow["first_second"], base_flow.get("first_second", {})
    losses = (f"{flow['undelivered']} of {flow['sent']} not delivered; duplicates {flow['duplicates']}; "
              f"whole flow p50/p99 {flow['p50_ms']} / {flow['p99_ms']} ms")
    return _floor_rows(run, base_steady, rate) + [
        _ratio_row(f"p50 @{rate:g}/s steady, {title}", "ms", steady["p50_ms"], base_steady.get("p50_ms"),
                   f"<={P50_MAX_RATIO:g}x", P50_MAX_RATIO, False, "writes sent after the flow's first second"),
        _ratio_row(f"p99 @{rate:g}/s steady, {title}", "ms", steady["p99_ms"], base_steady.get("p99_ms"),
                   f"<={P99_MAX_RATIO:g}x", P99_MAX_RATIO, False, losses),
        Row("cluster", f"p99 @{rate:g}/s first second, {title}", "ms", None, first["p99_ms"], base_first.get("p99_ms"),
            note=f"p50 {first['p50_ms']} ms (LevelDB {base_first.get('p50_ms')}); consumers attach as it starts"),
    ]


def _floor_rows(run: dict[str, Any], base_steady: dict[str, Any], rate: float) -> list[Row]:
    """The bare quorum publish's p50/p99 against LevelDB's whole write-to-delivery latency (benchlib.cluster_floor):
    where it alone exceeds a latency target, no node can meet that target on these servers."""
    if "publish_floor" not in run:
        return []
    floor = run["publish_floor"]
    note = "no ECQ: nats-py publishes to a shard stream, each awaited; the floor of the cluster's latency"
    return [Row("cluster", f"bare JetStream publish p50 @{rate:g}/s", "ms", None, floor["p50_ms"],
                base_steady.get("p50_ms"), note=note),
            Row("cluster", f"bare JetStream publish p99 @{rate:g}/s", "ms", None, floor["p99_ms"],
                base_steady.get("p99_ms"), note=f"{floor['measured']} publishes after the first second")]


def _idle_rows(name: str, run: dict[str, Any], base: dict[str, Any]) -> list[Row]:
    if "idle" not in run:
        return []
    title, idle, base_idle = TITLES[name], run["idle"], base.get("idle", {})
    per_node = [v for v in idle["node_cpu_pct"] if v is not None]
    busiest = max(per_node, default=None)
    base_node = max((v for v in base_idle.get("node_cpu_pct", []) if v is not None), default=None)
    entries = f"{idle['preload']['entries']:,} entries stored, idle {idle['seconds']:g} s"
    row = Row("cluster", f"idle CPU % per node, {title}", "%", None, busiest, base_node, f"<{IDLE_MAX_PCT:g} %",
              note=f"busiest node; each: {idle['node_cpu_pct']}; {entries}")
    row.met = busiest is not None and busiest < IDLE_MAX_PCT and len(per_node) == len(idle["node_cpu_pct"])
    return [row, Row("cluster", f"idle CPU % NATS servers, {title}", "%", None, idle["nats_cpu_pct"],
                     note=f"3 servers summed; {entries}")]


def _get(run: dict[str, Any], phase: str, figure: str) -> float | None:
    return run.get(phase, {}).get(figure)
