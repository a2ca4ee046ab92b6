"""The ``failover`` scenario (issue 24 point 5): time from kill -9 of one NATS server to the first PUBACK.

One ECQ node on a 3-server LocalNatsCluster of its own; a paced QoS 1 producer (ecq.testing.failover.PacedWriter)
writes one queue throughout. KILLS times, rotating the role of the victim (the written shard stream's leader, a
follower (the one the node is connected to when it can), the JetStream meta leader only; see
ecq.testing.failover.victim): kill -9, time to the first PUBACK of
a write sent after the kill, restart the server, wait until it is current again (its /healthz, every
replica of the written stream current) and the node's /api/v1/health says ok. Prints each time
and the max; the rows give the max per role.
"""

from __future__ import annotations

import sys
import time
import zlib
from typing import TYPE_CHECKING

from benchlib.cluster import skipped_without_nats
from benchlib.report import Row, ScenarioResult
from ecq.testing import wait_until
from ecq.testing.failover import ROLES, PacedWriter, all_current, holds_connection, time_to_first_puback, victim
from ecq.testing.nats import LocalNatsCluster

if TYPE_CHECKING:  # benchlib.scenarios registers this scenario: no import of it at run time
    from benchlib.scenarios import Bench

KILLS = 12              # 4 per role
SHARDS = 16             # the product default
HEALTHY_TIMEOUT_S = 60.0
TARGET_S = 5.0


def failover(bench: Bench, out: ScenarioResult) -> None:
    """Run the kills into ``out`` (details: every kill; rows: the max per role and overall)."""
    if skipped_without_nats(bench, out, "needs a NATS cluster of its own to kill servers of"):
        return
    nats = LocalNatsCluster(bench.workdir / "nats-failover").start()
    namespace, node_name, clientid = f"BENCH{bench.tag}_failover", "bench-failover", f"{bench.tag}failover"
    stream = f"{namespace}_Q_{zlib.crc32(clientid.encode()) % SHARDS}"
    kills: list[dict] = []
    out.details["kills"] = kills
    try:
        node = bench.new_ecq(bench.workdir / "failover", backend="jetstream", nats_servers=nats.urls,
                             jetstream_namespace=namespace, jetstream_shards=SHARDS, node_name=node_name)
        with bench.serving(node, "failover"):
            writer = PacedWriter(node.endpoint.port, clientid, rate=100).start()
            try:
                for i in range(KILLS):
                    kills.append(_one_kill(nats, node, writer, stream, ROLES[i % len(ROLES)], node_name))
                    print(f"[bench]   failover kill {i + 1}/{KILLS}: {kills[-1]}", file=sys.stderr, flush=True)
            finally:
                writer.close()
    finally:
        nats.stop()
        _rows(out, kills)


def _one_kill(nats: LocalNatsCluster, node, writer: PacedWriter, stream: str, role: str, node_name: str) -> dict:
    server, kind = victim(nats, stream, role, node_name)
    connected = holds_connection(server, f"ecq {node_name}")
    resumed = time_to_first_puback(writer, server)
    server.start()
    started = time.monotonic()
    # the restarted server must be current again (its /healthz) before the next kill: killing another replica
    # while it catches up leaves the stream without a quorum, a stall that is not the kill's
    healthy = wait_until(lambda: server.healthy() and all_current(nats, stream) and _healthy(node),
                         HEALTHY_TIMEOUT_S, 0.1)
    return {"role": role, "killed": kind, "server": server.name, "node_connected": connected, "first_puback_s": None if resumed is None else round(resumed, 3),
            "healthy_after_restart_s": round(time.monotonic() - started, 1) if healthy else None}


def _healthy(node) -> bool:
    try:
        return node.admin("GET", "/api/v1/health", timeout_s=2)["status"] == "ok"
    except Exception:  # 503 while degraded, or no answer
        return False


def _rows(out: ScenarioResult, kills: list[dict]) -> None:
    times = [k["first_puback_s"] for k in kills]
    print("failover: time from kill -9 to the first PUBACK, s: "
          + ", ".join(f"{k['server']} ({k['killed']}) {k['first_puback_s']}" for k in kills))
    for role in ROLES:
        own = [k["first_puback_s"] for k in kills if k["killed"] == role]
        if own:
            worst = None if None in own else max(own)
            out.rows.append(Row("failover", f"first PUBACK after kill -9, {role} (max of {len(own)})", "s", None,
                                worst, None, f"<={TARGET_S:g} s", worst is not None and worst <= TARGET_S,
                                note=", ".join(str(t) for t in own)))
    if times:
        worst = None if None in times else max(times)
        out.rows.append(Row("failover", f"first PUBACK after kill -9, any server (max of {len(times)})", "s", None,
                            worst, None, f"<={TARGET_S:g} s", worst is not None and worst <= TARGET_S))
