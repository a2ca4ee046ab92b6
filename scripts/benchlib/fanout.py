"""The fanout scenario (issue 33 point 8): one value for N connected devices, written once into an SCQ they all read,
against the same value written into N ECQ queues, one per device, as a backend does it with ECQ alone. Same run, 256 B
payloads, at each of --fanout-sizes devices, inside a private network namespace (benchlib.netns) with raw-socket
devices (benchlib.fleetload), as the fleet scenario (benchlib.fleet, whose connect phase and helpers it reuses).

For each size, two fresh `ecq broker`s on LevelDB, both with the shipped ACL (acl/acl.conf, which lets nobody read an
SCQ) and one rule above it letting the devices (username ``bench``) read ``$SCQ/fleet-config/#``:

* SCQ: N devices connect with clean session 0 and SUBSCRIBE ``$SCQ/fleet-config/#`` at QoS 1; once the broker is
  idle, one QoS 1 PUBLISH to ``$SCQ/w/fleet-config/k``: seconds from that PUBLISH until the last device had it and
  sent its PUBACK; deliveries/s = devices reached / those seconds;
* ECQ: N devices connect with clean session 0 and SUBSCRIBE ``$ECQ/<cid>/#``; once the broker is idle, the same value
  written into each device's queue (``$ECQ/w/<cid>/k``, one producer per load process, 100 PUBLISHes in flight, as
  the fleet scenario's fan-out): from the first PUBLISH until the last device had its copy and sent its PUBACK.

Then, with the broker idle again, the payload bytes it stores (``ecq_stored_bytes`` of its /metrics: the engine's
exact count of stored payload bytes); the devices disconnect and the broker stops; its LevelDB is then read (plyvel):
each ack state row (table ``a`` of ecq.store.leveldb_tables, key ``a`` S(id), value U64 acked seqno, U64 last-ack ms,
U64 per entry acked out of order) of an SCQ reader's position (id ``$SCQ/fleet-config/<clientid>``) or of an ECQ
consumer, key + value bytes; and the size of the LevelDB directory.

Then the drain (issue 33 point 3), two more fresh brokers: --fanout-drain-entries writes of distinct keys (default
100,000, 256 B) into the SCQ ``fleet-jobs``, read by a shared group of GROUP_MEMBERS devices
(``$share/bench/$SCQ/fleet-jobs/#``, all in one load process), against the same number of writes into one ECQ queue
drained by its one consumer; each from the first SUBSCRIBE until the last entry was delivered and PUBACKed, entries/s.

Every phase is bounded by --fleet-phase-seconds; a broker that does not keep up is reported with what it reached and
the run goes on.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import plyvel

from benchlib.fleet import (ANSWER_SLACK_S, capped_sizes, checked, connect, errors_of,
                            skipped_without_own_brokers_in_a_netns, target_of)
from benchlib.fleetload import FleetLoad, FleetLoadTimeout, Target
from benchlib.loadgen import split
from benchlib.netns import private_netns, remove_stale
from benchlib.report import Row, ScenarioResult
from benchlib.scenarios import ECQ_QUEUE, REPO, Bench, dir_bytes, progress
from ecq.queue.topics import is_position_id, is_scq_topic, scq_filter, scq_write_topic, write_topic
from ecq.store.leveldb_tables import STATE, decode_state, read_s

NETNS_PREFIX = "ecq-fanout-"     # + the pid of the run
QUEUE = "fleet-config"           # the SCQ every device reads (the name of acl/acl-fleet.example.conf)
KEY = "k"
PAYLOAD_BYTES = 256
SHIPPED_ACL = REPO / "acl" / "acl.conf"
KINDS = ("SCQ", "ECQ")

TARGET_FROM_SIZE = 10_000        # issue 33's time and rate targets are set at N = 10,000
SPEEDUP_TARGET = 2.0             # SCQ's time to all readers at most ECQ's / 2
RATE_TARGET_PER_S = 5_000.0
STATE_TARGET_BYTES = 64
DRAIN_QUEUE = "fleet-jobs"       # the SCQ the group drains
GROUP_MEMBERS = 4
DRAIN_TARGET = 0.8               # the group's entries/s at least 0.8x one ECQ consumer's


def fanout(bench: Bench, out: ScenarioResult) -> None:
    """The scenario: every size, SCQ then ECQ (so both figures of a row share the machine's state)."""
    args = bench.args
    if skipped_without_own_brokers_in_a_netns(bench, out):
        return
    sizes, cut = capped_sizes(args.fanout_sizes)
    if cut:
        progress(cut)
    out.details.update(sizes=sizes, size_cut=cut, payload_bytes=PAYLOAD_BYTES, queue=QUEUE, runs={})
    for stale in remove_stale(NETNS_PREFIX):
        progress(f"deleted network namespace {stale}, left by a run that was killed")
    with private_netns(f"{NETNS_PREFIX}{os.getpid()}"):
        load = FleetLoad(args.fleet_procs).start()
        try:
            for size in sizes:
                for kind in KINDS:
                    if not load.pids:   # killed after a load process hung
                        load.start()
                    bench.sampler.watch(*load.pids)
                    out.details["runs"][f"{kind} @{size}"] = measure(bench, load, kind, size)
            for kind in KINDS:
                if not load.pids:
                    load.start()
                out.details.setdefault("drain", {})[kind] = measure_drain(bench, load, kind)
        finally:
            load.close()
            fanout_rows(out)
    if cut:
        out.message = cut


def readers_acl(workdir: Path, queue: str = QUEUE) -> Path:
    """The shipped ACL with one rule above it letting username ``bench`` read the SCQ ``queue``; its path."""
    path = workdir / "acl.conf"
    grant = f'{{allow, {{username, "bench"}}, subscribe, ["eq {scq_filter(queue)}"]}}.\n'
    path.write_text(grant + SHIPPED_ACL.read_text())
    return path


def measure(bench: Bench, load: FleetLoad, kind: str, size: int) -> dict[str, Any]:
    """One broker run of ``kind`` (SCQ or ECQ) at ``size`` devices; a phase that fails ends it, recorded as
    ``error``, what was measured before stays."""
    result: dict[str, Any] = {}
    cids = tuple(f"car-{i:06d}" for i in range(size))
    label = f"fanout-{size}-{kind.lower()}"
    workdir = bench.workdir / label
    workdir.mkdir(parents=True, exist_ok=True)
    broker = bench.new_ecq(workdir, acl_file=str(readers_acl(workdir)))
    try:
        with bench.serving(broker, label):
            target = target_of(broker)
            subscribe = scq_filter(QUEUE) if kind == "SCQ" else ECQ_QUEUE
            result["readers"] = connect(bench, load, broker, target, f"{label}-readers", cids, False, subscribe)
            bench.wait_idle(broker)
            result["delivery"] = deliver(bench, load, broker, target, f"{label}-delivery",
                                         write_topics(kind, cids, load.size), result["readers"]["per_process"])
            bench.wait_idle(broker)
            result["stored"] = {"payload_bytes": int(broker.metric("ecq_stored_bytes")),
                                "entries": int(broker.metric("ecq_stored_messages"))}
            load.run("disconnect", [{}] * load.size, ANSWER_SLACK_S)
        result["state"] = stored_state(broker.queues_dir)
    except (FleetLoadTimeout, RuntimeError, OSError, plyvel.Error) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        progress(f"{label}: {result['error']}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def measure_drain(bench: Bench, load: FleetLoad, kind: str) -> dict[str, Any]:
    """The drain of ``kind``: an SCQ by a group of GROUP_MEMBERS, or one ECQ queue by its consumer (see the module's
    docstring); a phase that fails ends it, recorded as ``error``."""
    entries, deadline = bench.args.fanout_drain_entries, bench.args.fleet_phase_seconds
    label = f"fanout-drain-{kind.lower()}"
    workdir = bench.workdir / label
    workdir.mkdir(parents=True, exist_ok=True)
    broker = bench.new_ecq(workdir, acl_file=str(readers_acl(workdir, DRAIN_QUEUE)))
    cids = [f"worker-{n}" for n in range(1, GROUP_MEMBERS + 1)] if kind == "SCQ" else ["drainer"]
    topics = [scq_write_topic(DRAIN_QUEUE, f"k{n}") if kind == "SCQ" else write_topic(cids[0], f"k{n}")
              for n in range(entries)]
    only_first = [True] + [False] * (load.size - 1)  # the readers sit in the first load process
    try:
        with bench.serving(broker, label):
            target = target_of(broker)
            payload = os.urandom(PAYLOAD_BYTES)
            checked(load.run("publish", [{"target": target, "topics": part, "wait_deliveries": 0, "deadline_s": deadline,
                                          "producer_id": f"drain-producer-{n}", "payload": payload}
                                         for n, part in enumerate(split(topics, load.size))], deadline + ANSWER_SLACK_S))
            checked(load.run("connect", [{"target": target, "clientids": cids if first else [], "clean_session": False,
                                          "topic_format": None, "deadline_s": deadline, "concurrency": len(cids)}
                                         for first in only_first], deadline + ANSWER_SLACK_S))
            bench.wait_idle(broker)
            subscribe = f"$share/bench/{scq_filter(DRAIN_QUEUE)}" if kind == "SCQ" else ECQ_QUEUE
            [drained, *_] = checked(load.run("drain", [
                {"topic_format": subscribe, "wait_deliveries": entries if first else 0, "deadline_s": deadline}
                for first in only_first], deadline + ANSWER_SLACK_S))
            seconds = (drained["delivered_end_ns"] - drained["start_ns"]) / 1e9 if drained["delivered"] else None
            check = bench.load_check(label, broker, drained["start_ns"] / 1e9, drained["delivered_end_ns"] / 1e9,
                                     load_pids=load.pids) if seconds else None
            load.run("disconnect", [{}] * load.size, ANSWER_SLACK_S)
        return {"entries": entries, "readers": len(cids), "delivered": drained["delivered"],
                "seconds": seconds and round(seconds, 3), "per_s": seconds and round(drained["delivered"] / seconds, 1),
                "timed_out": drained["timed_out"], "broker_cpu_pct": check and check["broker_cpu_pct"]}
    except (FleetLoadTimeout, RuntimeError, OSError) as exc:
        progress(f"{label}: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def write_topics(kind: str, cids: tuple[str, ...], procs: int) -> list[list[str]]:
    """What each load process publishes: for SCQ the first process the one write, the others nothing; for ECQ each
    process one write into the queue of each of its devices (the devices ``split`` gave it when they connected)."""
    if kind == "SCQ":
        return [[scq_write_topic(QUEUE, KEY)]] + [[] for _ in range(procs - 1)]
    return [[write_topic(cid, KEY) for cid in part] for part in split(cids, procs)]


def deliver(bench: Bench, load: FleetLoad, broker, target: Target, phase: str, topics: list[list[str]],
            online: list[int]) -> dict[str, Any]:
    """Publish ``topics[i]`` from load process i (QoS 1, PAYLOAD_BYTES random bytes) and wait until its ``online[i]``
    devices had a message each and PUBACKed it; seconds from the first PUBLISH to the last device's PUBACK."""
    deadline = bench.args.fleet_phase_seconds
    payload = os.urandom(PAYLOAD_BYTES)
    results = checked(load.run("publish", [
        {"target": target, "topics": part, "wait_deliveries": count, "deadline_s": deadline,
         "producer_id": f"fanout-producer-{n}", "payload": payload}
        for n, (part, count) in enumerate(zip(topics, online))], deadline + ANSWER_SLACK_S))
    start = min(r["start_ns"] for r in results if r["published"]) / 1e9
    end = max(r["delivered_end_ns"] for r in results) / 1e9
    delivered = sum(r["delivered"] for r in results)
    seconds = end - start if delivered and end > start else None
    check = bench.load_check(phase, broker, start, end, load_pids=load.pids) if seconds else None
    return {"published": sum(r["published"] for r in results), "acked": sum(r["acked"] for r in results),
            "delivered": delivered, "online": sum(online), "seconds": seconds and round(seconds, 4),
            "per_s": seconds and round(delivered / seconds, 1), "timed_out": any(r["timed_out"] for r in results),
            "errors": errors_of(results), "broker_cpu_pct": check and check["broker_cpu_pct"]}


def stored_state(queues_dir: Path) -> dict[str, Any]:
    """The ack state rows in the stopped broker's LevelDB at ``queues_dir``, SCQ readers' positions and ECQ consumers'
    states apart (see :func:`row_sizes`); and the directory's size in bytes. Raises plyvel.Error when LevelDB cannot
    be opened."""
    positions, consumers = [], []
    db = plyvel.DB(str(queues_dir))
    try:
        for key, value in db.iterator(prefix=STATE):
            stored_id = read_s(key, len(STATE))[0]
            if is_position_id(stored_id):
                positions.append((key, value))
            elif not is_scq_topic(stored_id):
                consumers.append((key, value))
    finally:
        db.close()
    return {"positions": row_sizes(positions), "consumer_states": row_sizes(consumers),
            "leveldb_dir_bytes": dir_bytes(queues_dir)}


def row_sizes(rows: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    """How many ack state rows, how many of them acked the first write (seqno 1: the broker recorded that PUBACK),
    and their mean and largest key + value size in bytes (None without rows)."""
    sizes = [len(key) + len(value) for key, value in rows]
    return {"rows": len(rows), "acked": sum(1 for _, value in rows if decode_state(value).acked >= 1),
            "mean_bytes": round(sum(sizes) / len(sizes), 1) if sizes else None, "max_bytes": max(sizes, default=None)}


# --- rows -----------------------------------------------------------------------------------------------------
# The ECQ column of the results table holds SCQ's figure, the baseline column ECQ's (one copy per device).


def figure(run: dict[str, Any] | None, *path: str) -> Any:
    """``run[path[0]][path[1]]...``, None where a level is missing (a run that stopped early)."""
    value: Any = run
    for step in path:
        value = (value or {}).get(step)
    return value


def fanout_rows(out: ScenarioResult) -> None:
    """Per size: time to all devices, deliveries/s, stored payload bytes and stored state per reader, SCQ against ECQ,
    with issue 33's targets; the group's drain against one ECQ consumer's; SCQ's stored bytes at the largest size over
    the smallest."""
    runs, sizes = out.details.get("runs", {}), out.details.get("sizes", [])
    for size in sizes:
        scq, ecq = runs.get(f"SCQ @{size}"), runs.get(f"ECQ @{size}")
        delivery_rows(out, size, scq, ecq)
        store_rows(out, size, scq, ecq)
        for kind, run in (("SCQ", scq), ("ECQ", ecq)):
            if run and "error" in run:
                out.rows.append(Row("fanout", f"{kind} @{size:,} stopped early", "", None, None,
                                    note=run["error"][:200]))
    drain_row(out, out.details.get("drain", {}))
    flatness_row(out, runs, sizes)


def drain_row(out: ScenarioResult, drain: dict[str, Any]) -> None:
    """Entries/s of the group's drain (ECQ column) against one ECQ consumer's (baseline), target DRAIN_TARGET."""
    group, single = drain.get("SCQ"), drain.get("ECQ")
    mine, theirs = figure(group, "per_s"), figure(single, "per_s")
    ratio = mine / theirs if mine and theirs else None
    parts = [f"{kind} {run['error'][:120]}" if run and "error" in run else
             f"{kind} {number(figure(run, 'delivered'))} of {number(figure(run, 'entries'))} in "
             f"{figure(run, 'seconds')} s, CPU {figure(run, 'broker_cpu_pct')}%"
             for kind, run in (("group", group), ("ECQ", single))]
    entries = figure(group, "entries") or figure(single, "entries") or 0
    out.rows.append(Row("fanout", f"drain of {entries:,} entries: a group of {GROUP_MEMBERS} against 1 ECQ consumer",
                        "/s", PAYLOAD_BYTES, mine, theirs, f">= {DRAIN_TARGET:g}x",
                        None if ratio is None else ratio >= DRAIN_TARGET, note="; ".join(parts)))


def delivery_rows(out: ScenarioResult, size: int, scq, ecq) -> None:
    """Seconds until every device had the value and PUBACKed it, and deliveries/s; targets from TARGET_FROM_SIZE."""
    applies = size >= TARGET_FROM_SIZE
    scq_s, ecq_s = figure(scq, "delivery", "seconds"), figure(ecq, "delivery", "seconds")
    speedup = ecq_s / scq_s if scq_s and ecq_s else None
    note = "; ".join(part for part in (f"SCQ {speedup:.3g}x faster" if speedup else "", delivery_note(scq, ecq))
                     if part)
    out.rows.append(Row("fanout", f"1 value to all, until the last PUBACK @{size:,}", "s", PAYLOAD_BYTES, scq_s, ecq_s,
                        f">= {SPEEDUP_TARGET:g}x faster" if applies else "",
                        speedup is not None and speedup >= SPEEDUP_TARGET if applies else None, note=note))
    scq_rate = figure(scq, "delivery", "per_s")
    out.rows.append(Row("fanout", f"deliveries/s @{size:,}", "/s", PAYLOAD_BYTES, scq_rate,
                        figure(ecq, "delivery", "per_s"), f">= {RATE_TARGET_PER_S:,.0f}/s" if applies else "",
                        scq_rate is not None and scq_rate >= RATE_TARGET_PER_S if applies else None,
                        note=f"SCQ: 1 PUBLISH; ECQ: {figure(ecq, 'delivery', 'published') or '-'} PUBLISHes"))


def delivery_note(scq, ecq) -> str:
    """Who did not reach every device (connected, or delivered to), and the broker's CPU over the delivery."""
    parts = []
    for kind, run in (("SCQ", scq), ("ECQ", ecq)):
        readers, delivery = figure(run, "readers") or {}, figure(run, "delivery") or {}
        if readers.get("connected") is not None and readers["connected"] < readers["clients"]:
            parts.append(f"{kind} connected {readers['connected']:,} of {readers['clients']:,}")
        if delivery.get("delivered") is not None and delivery["delivered"] < delivery["online"]:
            parts.append(f"{kind} reached {delivery['delivered']:,} of {delivery['online']:,}")
        if delivery.get("broker_cpu_pct") is not None:
            parts.append(f"{kind} CPU {delivery['broker_cpu_pct']:.0f}%")
    return "; ".join(parts)


def store_rows(out: ScenarioResult, size: int, scq, ecq) -> None:
    """Stored payload bytes (``ecq_stored_bytes``), and the stored state per reader (LevelDB ack state rows)."""
    scq_bytes, ecq_bytes = figure(scq, "stored", "payload_bytes"), figure(ecq, "stored", "payload_bytes")
    copies = f"ECQ {ecq_bytes / PAYLOAD_BYTES:,.0f} copies" if ecq_bytes is not None else "ECQ -"
    out.rows.append(Row("fanout", f"stored payload bytes @{size:,}", "B", PAYLOAD_BYTES, scq_bytes, ecq_bytes,
                        "1 copy, independent of N", None if scq_bytes is None else scq_bytes == PAYLOAD_BYTES,
                        note=f"ecq_stored_bytes; {copies}; LevelDB dir after stop: SCQ "
                             f"{number(figure(scq, 'state', 'leveldb_dir_bytes'))} B, ECQ "
                             f"{number(figure(ecq, 'state', 'leveldb_dir_bytes'))} B (each with N sessions and "
                             "N ack states)"))
    positions = figure(scq, "state", "positions") or {}
    largest = positions.get("max_bytes")
    out.rows.append(Row("fanout", f"stored state per reader @{size:,}", "B", None, positions.get("mean_bytes"),
                        figure(ecq, "state", "consumer_states", "mean_bytes"), f"<= {STATE_TARGET_BYTES} B",
                        None if largest is None else largest <= STATE_TARGET_BYTES,
                        note=f"key + value of a reader's position row (LevelDB table a), mean of "
                             f"{positions.get('rows', 0):,} ({number(positions.get('acked'))} acked), largest "
                             f"{largest}; queue {QUEUE!r}, client ids car-NNNNNN; baseline: an ECQ consumer's ack "
                             f"state ({number(figure(ecq, 'state', 'consumer_states', 'acked'))} acked)"))


def number(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def flatness_row(out: ScenarioResult, runs: dict[str, Any], sizes: list[int]) -> None:
    """SCQ's stored payload bytes at the largest size over the smallest (1.0: independent of N), ECQ's in the note."""
    if len(sizes) < 2:
        return

    def ratio(kind: str) -> float | None:
        first = figure(runs.get(f"{kind} @{sizes[0]}"), "stored", "payload_bytes")
        last = figure(runs.get(f"{kind} @{sizes[-1]}"), "stored", "payload_bytes")
        return round(last / first, 3) if first and last is not None else None

    mine = ratio("SCQ")
    out.rows.append(Row("fanout", f"SCQ stored payload bytes @{sizes[-1]:,} / @{sizes[0]:,}", "ratio", PAYLOAD_BYTES,
                        mine, None, "1.0 (independent of N)", None if mine is None else mine == 1.0,
                        note=f"the same ratio for ECQ: {ratio('ECQ') if ratio('ECQ') is not None else '-'} "
                             f"(N copies: {sizes[-1] / sizes[0]:.3g} expected)"))
