"""The ``netdelay`` scenario (issue 24, point 9): the cluster with the latency of a network between machines of one
zone, made on loopback by a user-space delay proxy (benchlib.delayproxy; `tc netem` is not in this kernel).

Three NATS JetStream servers and two ECQ nodes (product defaults: 16 shards, 3 replicas), measured in three
configurations one after the other, each on a fresh NATS cluster and fresh nodes:

- ``direct``: no proxy;
- ``proxy-0ms``: every link through the proxy, without delay (what the proxy itself costs);
- ``proxy-<D>ms``: every link through the proxy, ``DELAY_MS`` one way (a round trip of twice that).

Every link is proxied: client -> node (the load processes connect to a proxy in front of each node's MQTT
port), node -> NATS (``nats_servers`` are proxies; each server's ``client_advertise`` names its proxy, so the
servers nats-py discovers are proxied too), and server <-> server (each server's routes go to the others'
proxies, and its ``cluster.advertise`` names its own, so the routes the servers gossip are proxied too).

Each configuration: --cluster-clientids x --cluster-keys QoS 1 writes of --cluster-size bytes from pipelined
producers (--connections per load process, --window PUBLISHes in flight each: acked writes/s), then one paho
producer pipelining PUBACK_RATE_PER_S writes/s for PUBACK_SECONDS (PUBLISH-to-PUBACK p50/p99), then a paced
flow of --cluster-rate writes/s to --cluster-consumers online consumers for --cluster-seconds (write-to-delivery
p50/p99). The rows compare the delayed configuration with ``proxy-0ms``, and ``proxy-0ms`` with ``direct``;
the proxy's own CPU per write is printed for both proxied configurations.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

import paho.mqtt.client as paho
import psutil

from benchlib.cluster import Nodes, skipped_without_nats
from benchlib.cluster_rows import cpu_ms_per_write
from benchlib.delayproxy import ProxyProcess
from benchlib.loadgen import Endpoint, Endpoints
from benchlib.report import Row, ScenarioResult
from benchlib.scenarios import ECQ_QUEUE, ECQ_WRITE, Bench, flow, keys, progress, publish, quantile
from ecq.testing import free_port, wait_until
from ecq.testing.nats import LocalNatsCluster

DELAY_MS = 5.0
PUBACK_RATE_PER_S = 500.0   # the PUBACK latency phase: one pipelined paho producer at this rate ...
PUBACK_SECONDS = 10.0       # ... for this long
PUBACK_QUEUES = 100
ACKS_WAIT_S = 30.0
CONFIGS = {"direct": None, "proxy-0ms": 0.0, f"proxy-{DELAY_MS:g}ms": DELAY_MS}
NODES = 2


class ProxiedNodes(Nodes):
    """The ECQ nodes, reached by the load processes at ``ports`` (their proxies, or their own ports)."""

    def __init__(self, brokers: list, ports: list[int]) -> None:
        super().__init__(brokers)
        self.ports = ports

    @property
    def endpoint(self) -> Endpoints:
        return tuple(Endpoint("127.0.0.1", port) for port in self.ports)


def netdelay(bench: Bench, out: ScenarioResult) -> None:
    """Measure every configuration of CONFIGS into ``out.details`` and add the rows; skipped against
    --host/--port or without nats-server."""
    if skipped_without_nats(bench, out, "needs brokers and NATS servers this run starts"):
        return
    try:
        for name, delay_ms in CONFIGS.items():
            out.details[name] = {"delay_ms": delay_ms}
            measure(bench, name, delay_ms, out.details[name])
    finally:
        netdelay_rows(bench, out)


def measure(bench: Bench, name: str, delay_ms: float | None, result: dict[str, Any]) -> None:
    """One configuration: NATS cluster, proxy (unless ``delay_ms`` is None), nodes; the write phase and the
    paced flow into ``result`` (filled as they finish); everything stopped on the way out."""
    args, base = bench.args, bench.workdir / f"netdelay-{name}"
    label = f"netdelay-{name}"
    with ExitStack() as stack:
        nats = LocalNatsCluster(base / "nats")
        links, nats_urls = ([], nats.urls) if delay_ms is None else proxy_nats(nats)
        brokers = [bench.new_ecq(base / f"n{i + 1}", backend="jetstream", nats_servers=nats_urls,
                                 node_name=f"bench-{name}-n{i + 1}", jetstream_namespace=f"BENCH{bench.tag}_ND")
                   for i in range(NODES)]
        node_ports = [broker.endpoint.port for broker in brokers]
        proxy = None
        if delay_ms is not None:
            mqtt_proxies = [free_port() for _ in node_ports]
            links += list(zip(mqtt_proxies, node_ports))
            node_ports = mqtt_proxies
            proxy = ProxyProcess(links, delay_ms).start()
            stack.callback(proxy.stop)
            bench.sampler.watch(proxy.pid)
        stack.callback(nats.stop)
        nats.start()
        bench.nats_pids = [server.pid for server in nats.servers]
        stack.callback(setattr, bench, "nats_pids", [])
        bench.sampler.watch(*bench.nats_pids)
        progress(f"{label}: NATS up (meta leader {nats.meta_leader()}), delay {delay_ms} ms one way")
        nodes = ProxiedNodes([stack.enter_context(bench.serving(broker, f"{label}-n{i + 1}"))
                              for i, broker in enumerate(brokers)], node_ports)
        cids = bench.ids(f"nd-{name}-", args.cluster_clientids)
        cpu_before = _cpu_s(proxy)
        result["writes"] = publish(bench, nodes, f"{label}-writes", ECQ_WRITE, cids, keys(args.cluster_keys),
                                   args.cluster_size)
        result["cpu_ms_per_write"] = cpu_ms_per_write(result["writes"])
        if proxy is not None and result["writes"]["acked"]:
            result["cpu_ms_per_write"]["proxy"] = round(
                (_cpu_s(proxy) - cpu_before) * 1000 / result["writes"]["acked"], 3)
        result["acks"] = puback_latency(nodes.ports[0], bench.ids(f"nda-{name}-", PUBACK_QUEUES), PUBACK_RATE_PER_S,
                                        PUBACK_SECONDS, args.cluster_size)
        progress(f"{label}-acks: PUBACK p50 {result['acks']['p50_ms']} ms, p99 {result['acks']['p99_ms']} ms")
        flow_cids = bench.ids(f"ndf-{name}-", args.cluster_consumers)
        cpu_before = _cpu_s(proxy)
        result["flow"] = flow(bench, nodes, f"{label}-flow", flow_cids, ECQ_QUEUE, ECQ_WRITE, args.cluster_rate,
                              args.cluster_seconds)
        if proxy is not None:
            result["flow"]["proxy_cpu_pct"] = round((_cpu_s(proxy) - cpu_before) * 100 / args.cluster_seconds, 1)


def puback_latency(port: int, queues: tuple[str, ...], rate_per_s: float, seconds: float, size: int) -> dict[str, Any]:
    """One paho client on ``port`` writes ``rate_per_s`` QoS 1 writes per second for ``seconds`` to ``queues``
    (round robin, a new key each), without waiting for PUBACKs (pipelined); PUBLISH-to-PUBACK latency quantiles
    in ms, as the producer sees them. Waits at most ACKS_WAIT_S for the last PUBACKs."""
    sent_at: dict[int, float] = {}
    acked_at: dict[int, float] = {}
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"{queues[0]}-producer", protocol=paho.MQTTv311)
    client.max_inflight_messages_set(0)
    client.max_queued_messages_set(0)
    client.on_publish = lambda _c, _u, mid, _rc, _p: acked_at.setdefault(mid, time.perf_counter())
    client.connect("127.0.0.1", port, keepalive=60)
    client.loop_start()
    try:
        payload, count = b"x" * size, int(rate_per_s * seconds)
        started = time.perf_counter()
        for i in range(count):
            time.sleep(max(0.0, started + i / rate_per_s - time.perf_counter()))
            before = time.perf_counter()  # its PUBACK may come before publish() returns the mid
            sent_at[client.publish(f"$ECQ/w/{queues[i % len(queues)]}/k{i}", payload, qos=1).mid] = before
        wait_until(lambda: len(acked_at) >= count, ACKS_WAIT_S, 0.05)
    finally:
        client.disconnect()
        client.loop_stop()
    latencies = sorted((acked_at[mid] - t) * 1000 for mid, t in sent_at.items() if mid in acked_at)
    return {"sent": len(sent_at), "acked": len(latencies), "rate_per_s": rate_per_s,
            "p50_ms": quantile(latencies, 0.5), "p99_ms": quantile(latencies, 0.99),
            "max_ms": round(latencies[-1], 2) if latencies else None}


def proxy_nats(nats: LocalNatsCluster) -> tuple[list[tuple[int, int]], list[str]]:
    """Put a proxy port in front of every NATS client and route port, and point the servers' routes and
    advertisements at them (before ``nats`` starts). Returns (the proxy's links as (listen, target) ports, the
    NATS URLs for the nodes)."""
    client_proxies = [free_port() for _ in nats.servers]
    route_proxies = [free_port() for _ in nats.servers]
    links = []
    for i, server in enumerate(nats.servers):
        server.route_ports = [port for j, port in enumerate(route_proxies) if j != i]
        server.cluster_advertise = route_proxies[i]
        server.extra_config = f'client_advertise: "127.0.0.1:{client_proxies[i]}"\n'
        links += [(client_proxies[i], server.ports.client), (route_proxies[i], server.ports.cluster)]
    return links, [f"nats://127.0.0.1:{port}" for port in client_proxies]


def _cpu_s(proxy: ProxyProcess | None) -> float:
    """CPU seconds (user + system) the proxy process used so far; 0 without one."""
    if proxy is None or proxy.pid is None:
        return 0.0
    times = psutil.Process(proxy.pid).cpu_times()
    return times.user + times.system


def netdelay_rows(bench: Bench, out: ScenarioResult) -> None:
    """Rows: the delayed configuration against ``proxy-0ms``, and ``proxy-0ms`` against ``direct``."""
    size, rate = bench.args.cluster_size, f"{bench.args.cluster_rate:g}/s"
    names = list(CONFIGS)
    for name, base_name in ((names[2], names[1]), (names[1], names[0])):
        run, base = out.details.get(name, {}), out.details.get(base_name, {})
        what = f"{name} vs {base_name}"
        if "writes" in run:
            out.rows.append(Row("netdelay", f"acked writes/s, {what}", "/s", size, run["writes"]["per_s"],
                                base.get("writes", {}).get("per_s"),
                                note=f"pipelined: {bench.args.connections} connections x {bench.args.window} in "
                                     f"flight per load process; {run['writes']['acked']} of {run['writes']['messages']}"))
        if "acks" in run:
            acks, base_acks = run["acks"], base.get("acks", {})
            for figure in ("p50_ms", "p99_ms"):
                out.rows.append(Row("netdelay", f"write PUBACK {figure[:3]} @{acks['rate_per_s']:g}/s, {what}", "ms",
                                    size, acks[figure], base_acks.get(figure),
                                    note=f"one pipelined paho producer; {acks['acked']} of {acks['sent']} PUBACKed"))
        if "flow" in run:
            for figure in ("p50_ms", "p99_ms"):
                out.rows.append(Row("netdelay", f"{figure[:3]} @{rate}, {what}", "ms", size, run["flow"][figure],
                                    base.get("flow", {}).get(figure),
                                    note=f"write to delivery; {run['flow']['undelivered']} of {run['flow']['sent']} "
                                         f"not delivered" if figure == "p99_ms" else "write to delivery"))
        cpu = run.get("cpu_ms_per_write", {})
        if "proxy" in cpu:
            out.rows.append(Row("netdelay", f"proxy CPU per write, {name}", "ms", size, cpu["proxy"], cpu.get("ecq"),
                                note=f"baseline: the ECQ nodes' CPU per write; proxy during the flow: "
                                     f"{run.get('flow', {}).get('proxy_cpu_pct')}% of a core"))
