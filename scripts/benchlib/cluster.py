"""The ``cluster`` scenario (issue 12): ECQ on NATS JetStream next to the single-node LevelDB broker.

One 3-server LocalNatsCluster (ecq/testing/nats.py) runs under the scratch dir for the whole scenario; three
configurations are measured one after the other with the same load, each on fresh brokers:

- ``leveldb``: one ECQ broker on LevelDB (the baseline of every ratio),
- ``jetstream-1``: one ECQ node with ``backend: jetstream`` (product defaults: 16 shards, 3 replicas),
- ``jetstream-2``: two such nodes on the same streams; every load process deals its producers and consumers
  over both (loadgen.endpoint_at), so half of the realtime deliveries cross nodes (see Flow.producer_for).

Each configuration: --cluster-clientids x --cluster-keys QoS 1 writes of --cluster-size bytes (acked writes/s),
then consumers drain those stored queues (deliveries/s, the reads scenario's reactive drain), then a paced
flow of --cluster-rate writes/s to --cluster-consumers online consumers for --cluster-seconds (write-to-delivery
p50/p99). CPU per write comes from the sampler over the write phase, per process kind: ECQ node(s), NATS
servers (summed) and load processes (summed).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from benchlib.brokers import EcqBroker
from benchlib.loadgen import ConsumeTask, Endpoints
from benchlib.report import Row, ScenarioResult
from benchlib.scenarios import ECQ_QUEUE, ECQ_WRITE, Bench, consume, flow, keys, phase_deadline_s, progress, publish
from ecq.testing.nats import LocalNatsCluster, nats_server_binary

CONFIGS = ("leveldb", "jetstream-1", "jetstream-2")
TITLES = {"leveldb": "LevelDB, 1 node", "jetstream-1": "JetStream, 1 node", "jetstream-2": "JetStream, 2 nodes"}
NODES = {"leveldb": 1, "jetstream-1": 1, "jetstream-2": 2}


class Nodes:
    """The ECQ node(s) of one configuration, measured as one broker by the scenario helpers: ``endpoint``
    deals the load processes' clients over the nodes, ``pids`` sums their CPU (Bench.load_check)."""

    def __init__(self, brokers: list[EcqBroker]) -> None:
        self.brokers = brokers
        self.pid = None

    @property
    def endpoint(self) -> Endpoints:
        """The one node's endpoint, or a tuple of every node's."""
        endpoints = tuple(broker.endpoint for broker in self.brokers)
        return endpoints[0] if len(endpoints) == 1 else endpoints

    @property
    def pids(self) -> list[int]:
        """Process ids of the nodes."""
        return [broker.pid for broker in self.brokers if broker.pid]


def cluster(bench: Bench, out: ScenarioResult) -> None:
    """Start the NATS cluster, measure every configuration of CONFIGS, fill ``out`` with a row per figure
    (JetStream against LevelDB); skipped against --host/--port or without nats-server (the cluster extra)."""
    if bench.args.port:
        out.status, out.message = "skipped", "needs brokers this run starts (and a NATS cluster beside them)"
        return
    try:
        nats_server_binary()
    except RuntimeError as exc:
        out.status, out.message = "skipped", str(exc)
        return
    nats = LocalNatsCluster(bench.workdir / "nats").start()
    bench.nats_pids = [server.pid for server in nats.servers]
    bench.sampler.watch(*bench.nats_pids)
    progress(f"NATS cluster up: {', '.join(nats.urls)} (meta leader {nats.meta_leader()})")
    try:
        for name in CONFIGS:
            out.details[name] = {}
            measure(bench, name, node_options(bench, name, nats.urls), out.details[name])
    finally:
        bench.nats_pids = []
        nats.stop()
        cluster_rows(bench, out)


def node_options(bench: Bench, name: str, nats_urls: list[str]) -> list[dict[str, Any]]:
    """Plugin options of each node of configuration ``name`` (one namespace per configuration, so that the
    second does not find the first's queues)."""
    if name == "leveldb":
        return [{}]
    namespace = f"BENCH{bench.tag}_{name.replace('-', '_')}"
    return [{"backend": "jetstream", "nats_servers": nats_urls, "jetstream_namespace": namespace,
             "node_name": f"bench-{name}-n{i + 1}"} for i in range(NODES[name])]


def measure(bench: Bench, name: str, options: list[dict[str, Any]], result: dict[str, Any]) -> None:
    """Start the nodes, run the three phases into ``result`` (filled as they finish), stop the nodes."""
    args = bench.args
    cids, key_names = bench.ids(f"c-{name}-", args.cluster_clientids), keys(args.cluster_keys)
    label = f"cluster-{name}"
    with ExitStack() as stack:
        nodes = Nodes([stack.enter_context(bench.serving(bench.new_ecq(bench.workdir / f"{label}-n{i + 1}", **opt),
                                                         f"{label}-n{i + 1}"))
                       for i, opt in enumerate(options)])
        result["writes"] = publish(bench, nodes, f"{label}-writes", ECQ_WRITE, cids, key_names, args.cluster_size)
        deadline = phase_deadline_s(len(cids) * len(key_names))
        result["reads"] = consume(bench, nodes, f"{label}-reads", lambda part: ConsumeTask(
            nodes.endpoint, part, key_names, ECQ_QUEUE, subscribe_after_start=True, deadline_s=deadline), cids)
        flow_cids = bench.ids(f"cf-{name}-", args.cluster_consumers)
        result["flow"] = flow(bench, nodes, f"{label}-flow", flow_cids, ECQ_QUEUE, ECQ_WRITE, args.cluster_rate,
                              args.cluster_seconds)


def cpu_ms_per_write(writes: dict[str, Any]) -> dict[str, float | None]:
    """CPU milliseconds per acked write of the write phase, per process kind: ``ecq`` (the node(s)),
    ``nats`` (the servers, summed) and ``load`` (the load processes, summed)."""
    load, acked = writes["load"], writes["acked"]

    def per_write(percent: float | None) -> float | None:
        if percent is None or not acked:
            return None
        return round(percent / 100 * load["seconds"] * 1000 / acked, 3)

    return {"ecq": per_write(load["broker_cpu_pct"]), "nats": per_write(load["nats_cpu_pct"]),
            "load": per_write(sum(v or 0.0 for v in load["load_cpu_pct"]))}


def cluster_rows(bench: Bench, out: ScenarioResult) -> None:
    """A row per figure and JetStream configuration, against LevelDB's figure as the baseline; what a
    configuration did not measure (timeout, error) is left out."""
    args, size = bench.args, bench.args.cluster_size
    for name, run in out.details.items():
        if "writes" in run:
            run["cpu_ms_per_write"] = cpu_ms_per_write(run["writes"])
    base = out.details.get("leveldb", {})
    for name in CONFIGS[1:]:
        run = out.details.get(name, {})
        title = TITLES[name]
        if "writes" in run:
            out.rows.append(Row("cluster", f"acked writes/s, {title}", "/s", size, run["writes"]["per_s"],
                                _get(base, "writes", "per_s"),
                                note=f"{run['writes']['acked']} of {run['writes']['messages']}; baseline LevelDB"))
        if "reads" in run:
            reads = run["reads"]
            out.rows.append(Row("cluster", f"deliveries/s, {title}", "/s", size, reads["per_s"],
                                _get(base, "reads", "per_s"),
                                note=f"reactive drain; missing {reads['missing']}, duplicates {reads['duplicates']}"))
        if "cpu_ms_per_write" in run:
            cpu, base_cpu = run["cpu_ms_per_write"], base.get("cpu_ms_per_write", {})
            for kind, what in (("ecq", "ECQ node(s)"), ("nats", "NATS servers"), ("load", "load procs")):
                out.rows.append(Row("cluster", f"CPU per write, {what}, {title}", "ms", size, cpu[kind],
                                    base_cpu.get(kind) if kind != "nats" else None,
                                    note="summed over processes, over the write phase"))
        if "flow" in run:
            flow_run = run["flow"]
            rate = f"{args.cluster_rate:g}/s"
            out.rows.append(Row("cluster", f"p50 @{rate}, {title}", "ms", size, flow_run["p50_ms"],
                                _get(base, "flow", "p50_ms")))
            out.rows.append(Row("cluster", f"p99 @{rate}, {title}", "ms", size, flow_run["p99_ms"],
                                _get(base, "flow", "p99_ms"),
                                note=f"{flow_run['undelivered']} of {flow_run['sent']} not delivered; duplicates "
                                     f"{flow_run['duplicates']}; {_first_last(flow_run['p99_ms_by_second'])}"))


def _first_last(p99_by_second: list[float | None]) -> str:
    """``p99 of the writes sent in the first / last second: A / B ms``: a backlog left by the consumers'
    attach shows as a first second far above the last."""
    seconds = [p for p in p99_by_second if p is not None]
    if not seconds:
        return "no delivery"
    return f"p99 of the writes sent in the first / last second: {seconds[0]:,.0f} / {seconds[-1]:,.0f} ms"


def _get(run: dict[str, Any], phase: str, figure: str) -> float | None:
    return run.get(phase, {}).get(figure)
