"""The fleet scenario (issue 32): what a device costs a broker, measured on ECQ, stock amqtt 0.12.1 and Mosquitto 2
in the same run, at each of --fleet-sizes clients, inside a private network namespace (benchlib.netns) with raw-socket
devices (benchlib.fleetload). For each size and broker, two fresh brokers:

* idle: N clean-session devices connect (keepalive 60 s): connects/s, RSS per connection, then the broker's CPU
  over IDLE_CPU_WINDOW_S while they stay connected and ping;
* persistent: N devices connect with clean session 0 and SUBSCRIBE at QoS 1 (ECQ ``$ECQ/<cid>/#``, the others
  ``dev/<cid>/#``): connect+subscribes/s and RSS per consumer; one QoS 1 write into each queue (ECQ
  ``$ECQ/w/<cid>/k``, the others ``dev/<cid>/k``): deliveries/s; the devices disconnect: RSS per offline session;
  one message to each of --fleet-sample offline devices, SIGTERM (timed), start again on the same data, and those
  devices connect with clean session 0 without subscribing, all at once: how many get session present 1 and their
  message, and when the last had it (the reconnect storm, with --fleet-sample as large as the fleet).

RSS figures are the growth of the broker's RSS over its RSS before the phase, each read once the broker is idle
(benchlib.scenarios.Bench.wait_idle), divided by the devices that connected; in KiB. Rates count from the first
CONNECT (or PUBLISH) to the last CONNACK/SUBACK (or delivery). Every phase has --fleet-phase-seconds; a broker that
does not keep up is reported with what it reached (``reached`` in the notes) and the run goes on.
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from collections.abc import Callable
from typing import Any

from benchlib.brokers import MosquittoBroker, StockBroker
from benchlib.fleetload import FleetLoad, FleetLoadTimeout, Target
from benchlib.loadgen import split
from benchlib.netns import private_netns, remove_stale, source_addresses
from benchlib.report import Row, ScenarioResult
from benchlib.sampler import listen_drops
from benchlib.scenarios import ECQ_QUEUE, ECQ_WRITE, Bench, progress

NETNS_PREFIX = "ecq-fleet-"    # + the pid of the run
FD_MARGIN = 200                # descriptors a broker needs beside its clients (logs, LevelDB files, listeners)
SOURCES = 16                   # loopback source addresses the devices bind to (127.0.0.2 ...)
IDLE_CPU_WINDOW_S = 10.0
RESUME_WAIT_S = 30.0           # for every resumed device's queued message to arrive (issue 32: a storm, 30 s)
ANSWER_SLACK_S = 60.0          # beyond a command's own deadline, before a load process counts as hung
KIB = 1024
CONNECTS_IN_FLIGHT = 64        # over all load processes: below the listen backlog of amqtt (100) and Mosquitto (100),
                               # so that a full accept queue never makes a connect wait for a SYN retransmit

TOPICS = {  # broker -> (what a consumer subscribes, where one write to it goes), str.format with cid
    "ECQ": (ECQ_QUEUE, ECQ_WRITE.replace("{key}", "k")),
    "stock amqtt": ("dev/{cid}/#", "dev/{cid}/k"),
    "Mosquitto": ("dev/{cid}/#", "dev/{cid}/k"),
}


def new_broker(bench: Bench, kind: str, workdir) -> Any:
    """A fresh broker of ``kind`` (a key of TOPICS), not started, in ``workdir``."""
    makers: dict[str, Callable[[], Any]] = {"ECQ": lambda: bench.new_ecq(workdir),
                                            "stock amqtt": lambda: StockBroker(workdir),
                                            "Mosquitto": lambda: MosquittoBroker(workdir)}
    return makers[kind]()


def capped_sizes(sizes: list[int]) -> tuple[list[int], str]:
    """``sizes`` cut to what the file descriptor limit allows (one descriptor per client in the broker, plus
    FD_MARGIN), and a message naming what was cut ("" when nothing was)."""
    most = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - FD_MARGIN
    kept = sorted({min(size, most) for size in sizes})
    if kept == sorted(set(sizes)):
        return kept, ""
    return kept, (f"sizes above {most:,} cut to {most:,}: the file descriptor limit is "
                  f"{most + FD_MARGIN:,} (ulimit -Hn), {FD_MARGIN} kept for the broker itself")


def skipped_without_own_brokers_in_a_netns(bench: Bench, out: ScenarioResult) -> bool:
    """Mark ``out`` skipped, and say so, when the run may not start its own brokers (--port/--baseline-port) or is
    not root (its brokers and clients run in a private network namespace)."""
    if bench.args.port or bench.args.baseline_port:
        out.status, out.message = "skipped", "needs the brokers this run starts (not --port/--baseline-port)"
        return True
    if os.geteuid() != 0:
        out.status, out.message = "skipped", "needs root: its brokers and clients run in a private network namespace"
        return True
    return False


def fleet(bench: Bench, out: ScenarioResult) -> None:
    """The scenario: every size, each broker in turn (so the three figures of a row share the machine's state)."""
    args = bench.args
    if skipped_without_own_brokers_in_a_netns(bench, out):
        return
    if not MosquittoBroker.version():
        out.status, out.message = "skipped", "no mosquitto on PATH (scripts/setup bench installs Debian's mosquitto)"
        return
    sizes, cut = capped_sizes(args.fleet_sizes)
    if cut:
        progress(cut)
    out.details.update(sizes=sizes, size_cut=cut, mosquitto_version=MosquittoBroker.version(), runs={})
    for stale in remove_stale(NETNS_PREFIX):
        progress(f"deleted network namespace {stale}, left by a run that was killed")
    with private_netns(f"{NETNS_PREFIX}{os.getpid()}"):
        load = FleetLoad(args.fleet_procs).start()
        try:
            for size in sizes:
                for kind in (kind for kind in TOPICS if kind in args.fleet_brokers):
                    if not load.pids:   # killed after a load process hung
                        load.start()
                    bench.sampler.watch(*load.pids)
                    out.details["runs"][f"{kind} @{size}"] = measure(bench, load, kind, size)
        finally:
            load.close()
            fleet_rows(out)
    if cut:
        out.message = cut


def measure(bench: Bench, load: FleetLoad, kind: str, size: int) -> dict[str, Any]:
    """Both broker runs of one broker at one size; a phase that fails ends its run, recorded as ``error``."""
    result: dict[str, Any] = {}
    cids = tuple(f"dev{i}" for i in range(size))
    label = f"fleet-{size}-{kind.replace(' ', '-').lower()}"
    try:
        with bench.serving(new_broker(bench, kind, bench.workdir / f"{label}-idle"), f"{label}-idle") as broker:
            result["idle"] = idle_run(bench, load, broker, target_of(broker), f"{label}-idle", cids)
        with bench.serving(new_broker(bench, kind, bench.workdir / f"{label}-persistent"),
                           f"{label}-persistent") as broker:
            persistent_run(bench, load, broker, target_of(broker), label, cids, TOPICS[kind], result)
    except (FleetLoadTimeout, RuntimeError, OSError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        progress(f"{label}: {result['error']}")
    finally:
        shutil.rmtree(bench.workdir / f"{label}-idle", ignore_errors=True)
        shutil.rmtree(bench.workdir / f"{label}-persistent", ignore_errors=True)
    return result


def target_of(broker) -> Target:
    """Where the devices of a run connect: ``broker``'s endpoint, from SOURCES loopback source addresses."""
    return Target(broker.endpoint.host, broker.endpoint.port, source_addresses(SOURCES))


def idle_run(bench: Bench, load: FleetLoad, broker, target: Target, label: str, cids) -> dict[str, Any]:
    """Clean-session devices connect and stay: connect rate, RSS per connection, idle CPU."""
    rss_before = settled_rss(bench, broker)
    connects = connect(bench, load, broker, target, f"{label}-connect", cids, True, None)
    rss_after = settled_rss(bench, broker)
    started = time.monotonic()
    time.sleep(IDLE_CPU_WINDOW_S)
    idle = bench.load_check(f"{label}-cpu", broker, started, time.monotonic(), load_pids=load.pids)
    load.run("disconnect", [{}] * load.size, ANSWER_SLACK_S)
    return {**connects, "rss_before": rss_before, "rss_after": rss_after,
            "rss_per_client_kib": per_client_kib(rss_before, rss_after, connects["connected"]),
            "idle_cpu_pct": idle["broker_cpu_pct"]}


def persistent_run(bench: Bench, load: FleetLoad, broker, target: Target, label: str, cids,
                   topics: tuple[str, str], result: dict[str, Any]) -> None:
    """Persistent consumers connect and subscribe, get one write each, go offline; then a restart. Fills
    ``result`` as it goes, so that what was measured before a failure stays."""
    subscribe, write = topics
    rss_before = settled_rss(bench, broker)
    consumers = connect(bench, load, broker, target, f"{label}-consumers", cids, False, subscribe)
    rss_online = settled_rss(bench, broker)
    result["consumers"] = {**consumers, "rss_before": rss_before, "rss_after": rss_online,
                           "rss_per_client_kib": per_client_kib(rss_before, rss_online, consumers["connected"])}
    result["fanout"] = fanout(bench, load, broker, target, f"{label}-fanout", cids, write, consumers["per_process"])
    load.run("disconnect", [{}] * load.size, ANSWER_SLACK_S)
    rss_offline = settled_rss(bench, broker)
    result["offline"] = {"rss_after": rss_offline,
                         "rss_per_session_kib": per_client_kib(rss_before, rss_offline, consumers["connected"])}
    result["restart"] = restart(bench, load, broker, target, cids[:bench.args.fleet_sample], write,
                                consumers["connected"])


def settled_rss(bench: Bench, broker) -> int | None:
    """The broker's RSS in bytes once it has been idle a moment (its backlog done)."""
    bench.wait_idle(broker)
    return bench.sampler.rss_bytes(broker.pid)


def per_client_kib(before: int | None, after: int | None, clients: int) -> float | None:
    """RSS growth per client in KiB (None without both readings or clients)."""
    if before is None or after is None or not clients:
        return None
    return round((after - before) / clients / KIB, 2)


def span_s(results: list[dict], start: str, end: str) -> tuple[float, float]:
    """(earliest ``start``, latest ``end``) over the load processes' results, in monotonic seconds."""
    return min(r[start] for r in results) / 1e9, max(r[end] for r in results) / 1e9


def checked(results: list[dict]) -> list[dict]:
    """The results, or RuntimeError with the first errors when a load process failed."""
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    return results


def connect(bench: Bench, load: FleetLoad, broker, target: Target, phase: str, cids, clean: bool,
            subscribe: str | None) -> dict[str, Any]:
    """Every clientid connects (and subscribes), spread over the load processes; the rate over the phase."""
    deadline = bench.args.fleet_phase_seconds
    drops_before = listen_drops()
    results = checked(load.run("connect", [
        {"target": target, "clientids": list(part), "clean_session": clean, "topic_format": subscribe,
         "deadline_s": deadline, "concurrency": in_flight(load)} for part in split(cids, load.size)],
        deadline + ANSWER_SLACK_S))
    drops = listen_drops()
    start, end = span_s(results, "start_ns", "end_ns")
    connected = sum(r["connected"] for r in results)
    check = bench.load_check(phase, broker, start, end, load_pids=load.pids)
    return {"clients": len(cids), "connected": connected, "failed": sum(r["failed"] for r in results),
            "session_present": sum(r["session_present"] for r in results), "seconds": round(end - start, 3),
            "per_s": round(connected / (end - start), 1) if end > start else None,
            "timed_out": any(r["timed_out"] for r in results), "errors": errors_of(results),
            "broker_cpu_pct": check["broker_cpu_pct"], "per_process": [r["connected"] for r in results],
            "listen_drops": None if drops is None or drops_before is None else drops - drops_before}


def in_flight(load: FleetLoad) -> int:
    """Connects in flight per load process."""
    return max(1, CONNECTS_IN_FLIGHT // load.size)


def errors_of(results: list[dict]) -> list[str]:
    return sorted({e for r in results for e in r.get("errors", [])})[:5]


def fanout(bench: Bench, load: FleetLoad, broker, target: Target, phase: str, cids, write: str,
           online: list[int]) -> dict[str, Any]:
    """One QoS 1 write to each clientid, from one producer per load process to its own devices; deliveries/s from
    the first PUBLISH to the last delivery."""
    deadline = bench.args.fleet_phase_seconds
    parts = split(cids, load.size)
    results = checked(load.run("publish", [
        {"target": target, "topics": [write.format(cid=cid) for cid in part], "wait_deliveries": count,
         "deadline_s": deadline, "producer_id": f"fleet-producer-{n}"}
        for n, (part, count) in enumerate(zip(parts, online))], deadline + ANSWER_SLACK_S))
    start, end = span_s(results, "start_ns", "delivered_end_ns")
    delivered = sum(r["delivered"] for r in results)
    check = bench.load_check(phase, broker, start, end, load_pids=load.pids) if delivered else None
    return {"published": len(cids), "acked": sum(r["acked"] for r in results), "delivered": delivered,
            "online": sum(online), "seconds": round(end - start, 3),
            "per_s": round(delivered / (end - start), 1) if delivered and end > start else None,
            "timed_out": any(r["timed_out"] for r in results), "errors": errors_of(results),
            "broker_cpu_pct": check and check["broker_cpu_pct"]}


def restart(bench: Bench, load: FleetLoad, broker, target: Target, sample, write: str,
            sessions: int) -> dict[str, Any]:
    """One message to each of ``sample`` (offline now, among ``sessions`` offline sessions), SIGTERM and start
    again, then the sample connects with clean session 0 and does not subscribe."""
    parts = split(sample, load.size)
    queued = checked(load.run("publish", [
        {"target": target, "topics": [write.format(cid=cid) for cid in part], "wait_deliveries": 0,
         "deadline_s": bench.args.fleet_phase_seconds, "producer_id": f"fleet-producer-{n}"}
        for n, part in enumerate(parts)], bench.args.fleet_phase_seconds + ANSWER_SLACK_S))
    stopping = time.monotonic()
    stopped = broker.stop()
    stop_s = round(time.monotonic() - stopping, 2)
    progress(f"SIGTERM with {sessions:,} offline sessions: {stopped} after {stop_s} s")
    broker.start()
    bench.sampler.watch(broker.pid)
    resumed = checked(load.run("resume", [{"target": target, "clientids": list(part), "wait_s": RESUME_WAIT_S,
                                           "concurrency": in_flight(load)} for part in parts],
                                         2 * RESUME_WAIT_S + ANSWER_SLACK_S))
    storm = [r["all_received_s"] for r in resumed]
    return {"sample": len(sample), "offline_sessions": sessions, "queued_acked": sum(r["acked"] for r in queued),
            "stop": stopped, "stop_s": stop_s, "reconnected": sum(r["connected"] for r in resumed),
            "session_present": sum(r["session_present"] for r in resumed),
            "received": sum(r["received"] for r in resumed), "errors": errors_of(resumed),
            "all_received_s": None if None in storm else max(storm), "log_problems": broker.problems()}


# --- rows -----------------------------------------------------------------------------------------------------

FIGURES = (  # (phase, key, metric, unit, target text, target check on (ECQ value, ratio to Mosquitto))
    ("idle", "rss_per_client_kib", "RSS per idle connection", "KiB", "<= 8 KiB", lambda v, r: v <= 8),
    ("idle", "per_s", "idle connects", "/s", ">= 0.5x", lambda v, r: r is not None and r >= 0.5),
    ("idle", "idle_cpu_pct", "idle CPU, keepalive 60 s", "% core", "<= 3 %", lambda v, r: v <= 3),
    ("consumers", "rss_per_client_kib", "RSS per connected consumer", "KiB", "<= 12 KiB", lambda v, r: v <= 12),
    ("consumers", "per_s", "consumer connect+subscribes", "/s", ">= 0.5x", lambda v, r: r is not None and r >= 0.5),
    ("offline", "rss_per_session_kib", "RSS per offline session", "KiB", "<= 2 KiB", lambda v, r: v <= 2),
    ("fanout", "per_s", "fan-out, 1 write per queue", "deliveries/s", ">= 0.6x at >= 10,000",
     lambda v, r: r is not None and r >= 0.6),
)


def value(run: dict[str, Any] | None, phase: str, key: str) -> float | None:
    return ((run or {}).get(phase) or {}).get(key)


def fleet_rows(out: ScenarioResult) -> None:
    """A row per figure and size (baseline column: Mosquitto; stock amqtt in the note), then the flatness of
    ECQ's rates from the smallest to the largest size and the sessions kept across a restart."""
    runs, sizes = out.details.get("runs", {}), out.details.get("sizes", [])
    for size in sizes:
        ecq, stock, mosq = (runs.get(f"{kind} @{size}") for kind in TOPICS)
        for phase, key, metric, unit, target, check in FIGURES:
            mine, theirs = value(ecq, phase, key), value(mosq, phase, key)
            if mine is None and theirs is None:
                continue
            ratio = round(mine / theirs, 3) if mine is not None and theirs else None
            applies = not target.endswith("at >= 10,000") or size >= 10_000
            out.rows.append(Row("fleet", f"{metric} @{size:,}", unit, None, mine, theirs, target if applies else "",
                                check(mine, ratio) if applies and mine is not None else None,
                                note=figure_note(ecq, stock, mosq, phase, key)))
        sessions_row(out, size, ecq, stock, mosq)
        for kind, run in (("ECQ", ecq), ("stock amqtt", stock), ("Mosquitto", mosq)):
            if run and "error" in run:
                out.rows.append(Row("fleet", f"{kind} @{size:,} stopped early", "", None, None,
                                    note=run["error"][:200]))
    flatness_rows(out, runs, sizes)


def figure_note(ecq, stock, mosq, phase: str, key: str) -> str:
    """Stock amqtt's figure and its ratio to Mosquitto, and who did not reach every client (or message)."""
    theirs, stock_value = value(mosq, phase, key), value(stock, phase, key)
    parts = [f"stock amqtt {stock_value:,.4g}" + (f" ({stock_value / theirs:.3g}x)" if theirs else "")
             if stock_value is not None else "stock amqtt -"]
    for kind, run in (("ECQ", ecq), ("amqtt", stock), ("Mosquitto", mosq)):
        phase_result = (run or {}).get(phase) or {}
        reached, wanted = ((phase_result.get("delivered"), phase_result.get("online")) if phase == "fanout"
                           else (phase_result.get("connected"), phase_result.get("clients")))
        if reached is not None and wanted is not None and reached < wanted:
            parts.append(f"{kind} reached {reached:,} of {wanted:,}")
        if key == "per_s" and kind == "ECQ" and phase_result.get("broker_cpu_pct") is not None:
            parts.append(f"ECQ CPU {phase_result['broker_cpu_pct']:.0f}%")
        if key == "per_s" and phase_result.get("listen_drops"):
            parts.append(f"{kind}: {phase_result['listen_drops']} SYNs dropped by a full listen queue")
    return "; ".join(parts)


def sessions_row(out: ScenarioResult, size: int, ecq, stock, mosq) -> None:
    """Sample clients with session present 1, and with their queued message, after SIGTERM and a restart."""
    def of(run, key):
        return ((run or {}).get("restart") or {}).get(key)

    sample = of(ecq, "sample") or of(mosq, "sample")
    if sample is None:
        return
    for key, metric in (("session_present", "session present 1 after SIGTERM+restart"),
                        ("received", "queued message back without SUBSCRIBE")):
        mine = of(ecq, key)
        out.rows.append(Row("fleet", f"{metric} @{size:,}", f"of {sample}", None, mine, of(mosq, key),
                            f"all {sample}", None if mine is None else mine == sample,
                            note=f"stock amqtt {of(stock, key)}; SIGTERM with {of(ecq, 'offline_sessions')} "
                                 f"offline sessions took {stops_note(ecq, stock, mosq)}"))
    storm_s = of(ecq, "all_received_s")
    out.rows.append(Row("fleet", f"reconnect storm: {sample:,} back with their message @{size:,}", "s", None,
                        storm_s, of(mosq, "all_received_s"), f"<= {RESUME_WAIT_S:.0f} s",
                        storm_s is not None and storm_s <= RESUME_WAIT_S,
                        note=f"all at once, {CONNECTS_IN_FLIGHT} CONNECTs in flight; ECQ log after it: "
                             f"{of(ecq, 'log_problems') or 'no warning or error'}"))


def stops_note(ecq, stock, mosq) -> str:
    """``ECQ 57.4 s, amqtt 15.1 s (KILLED: ...), Mosquitto 0.27 s``: each broker's exit after SIGTERM."""
    parts = []
    for kind, run in (("ECQ", ecq), ("amqtt", stock), ("Mosquitto", mosq)):
        restarted = (run or {}).get("restart") or {}
        stop = restarted.get("stop")
        parts.append(f"{kind} {restarted.get('stop_s')} s" + ("" if stop == "exit code 0" else f" ({stop})"))
    return ", ".join(parts)


def flatness_rows(out: ScenarioResult, runs: dict[str, Any], sizes: list[int]) -> None:
    """ECQ's rate at the largest size over its rate at the smallest (issue 32: flat, fan-out within 20 %)."""
    if len(sizes) < 2:
        return
    small, large = runs.get(f"ECQ @{sizes[0]}"), runs.get(f"ECQ @{sizes[-1]}")
    for phase, metric, target in (("consumers", "connect+subscribe rate", ">= 0.8 (flat)"),
                                  ("fanout", "fan-out deliveries/s", ">= 0.8 (within 20 %)")):
        first, last = value(small, phase, "per_s"), value(large, phase, "per_s")
        if first and last is not None:
            out.rows.append(Row("fleet", f"ECQ {metric} @{sizes[-1]:,} / @{sizes[0]:,}", "ratio", None,
                                round(last / first, 3), None, target, last / first >= 0.8,
                                note="the same ratio for Mosquitto: "
                                     f"{ratio_of(runs, 'Mosquitto', phase, sizes)}"))


def ratio_of(runs: dict[str, Any], kind: str, phase: str, sizes: list[int]) -> str:
    first = value(runs.get(f"{kind} @{sizes[0]}"), phase, "per_s")
    last = value(runs.get(f"{kind} @{sizes[-1]}"), phase, "per_s")
    return f"{last / first:.2f}" if first and last is not None else "-"
