"""The ``cluster`` scenario (issue 12): ECQ on NATS JetStream next to the single-node LevelDB broker.

One 3-server LocalNatsCluster (ecq/testing/nats.py) runs under the scratch dir for the whole scenario; three
configurations are measured one after the other with the same load, each on fresh brokers:

- ``leveldb``: one ECQ broker on LevelDB (the baseline of every ratio),
- ``jetstream-1``: one ECQ node with ``backend: jetstream`` (product defaults: 16 shards, 3 replicas),
- ``jetstream-2``: two such nodes on the same streams; every load process deals its producers and consumers
  over both (loadgen.endpoint_at), so half of the realtime deliveries cross nodes (see Flow.producer_for).

Each configuration: --cluster-clientids x --cluster-keys QoS 1 writes of --cluster-size bytes (acked writes/s),
then consumers drain those stored queues (deliveries/s, the reads scenario's reactive drain), then ONE consumer
drains one queue of --cluster-queue-entries stored entries (deliveries/s of a single queue), then a paced flow
of --cluster-rate writes/s to --cluster-consumers online consumers for --cluster-seconds (write-to-delivery
p50/p99 of the steady state, after its first second, and of the first second apart); on one JetStream node, the
same pace of bare JetStream publishes (benchlib.cluster_floor: the quorum round trip every cluster write makes,
the floor of its latency). CPU per write comes from
the sampler over the write phase, per process kind: ECQ node(s), NATS servers (summed) and load processes
(summed). Last, the 2 JetStream nodes are given --cluster-idle-entries stored entries (published to the
streams from here, benchlib.cluster_idle) and left idle for --cluster-idle-seconds: CPU per node and of the
NATS servers; the baseline is a LevelDB broker started on as many entries written straight into its store.
The rows, with the issue-24 targets, come from benchlib.cluster_rows.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from benchlib.brokers import EcqBroker
from benchlib.cluster_floor import publish_floor
from benchlib.cluster_idle import idle_cpu, preload_jetstream
from benchlib.cluster_rows import cluster_rows
from benchlib.loadgen import ConsumeTask, Endpoints
from benchlib.report import ScenarioResult
from benchlib.scenarios import (ECQ_QUEUE, ECQ_WRITE, Bench, consume, flow_summary, flow_tasks, keys,
                                phase_deadline_s, preload_store, progress, publish)
from ecq.testing.nats import LocalNatsCluster, nats_server_binary

CONFIGS = ("leveldb", "jetstream-1", "jetstream-2")
NODES = {"leveldb": 1, "jetstream-1": 1, "jetstream-2": 2}
IDLE_KEYS = 10                              # keys per queue of the idle phase's entries
FIRST_SECOND_S = 1.0                        # the flow's start (consumers attaching), reported apart


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


def skipped_without_nats(bench: Bench, out: ScenarioResult, needs: str) -> bool:
    """True, with ``out`` marked skipped, against --host/--port (``needs`` says what the scenario starts) or
    without nats-server (the cluster extra)."""
    if bench.args.port:
        out.status, out.message = "skipped", needs
        return True
    try:
        nats_server_binary()
    except RuntimeError as exc:
        out.status, out.message = "skipped", str(exc)
        return True
    return False


def cluster(bench: Bench, out: ScenarioResult) -> None:
    """Start the NATS cluster, measure every configuration of CONFIGS, fill ``out`` with a row per figure
    (JetStream against LevelDB); skipped against --host/--port or without nats-server (the cluster extra)."""
    if skipped_without_nats(bench, out, "needs brokers this run starts (and a NATS cluster beside them)"):
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
    """Start the nodes, run the phases into ``result`` (filled as they finish), stop the nodes."""
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
        result["one_queue"] = drain_one_queue(bench, nodes, f"{label}-one-queue", name)
        result["flow"] = paced_flow(bench, nodes, f"{label}-flow", bench.ids(f"cf-{name}-", args.cluster_consumers))
        if name == "jetstream-1":
            result["publish_floor"] = publish_floor(options[0]["nats_servers"], options[0]["jetstream_namespace"],
                                                    args.cluster_rate, args.cluster_seconds, args.cluster_size)
        if name == "jetstream-2":
            result["idle"] = idle_jetstream(bench, nodes, f"{label}-idle", name, options[0])
    if name == "leveldb":
        result["idle"] = idle_leveldb(bench, f"{label}-idle")


def drain_one_queue(bench: Bench, nodes: Nodes, phase: str, name: str) -> dict[str, Any]:
    """--cluster-queue-entries entries written to one queue, then drained by its one consumer: deliveries/s
    of a single queue (the figure a device with a backlog sees)."""
    args = bench.args
    cid, key_names = bench.ids(f"q-{name}-", 1), keys(args.cluster_queue_entries)
    publish(bench, nodes, f"{phase}-writes", ECQ_WRITE, cid, key_names, args.cluster_size)
    deadline = phase_deadline_s(len(key_names))
    return consume(bench, nodes, phase, lambda part: ConsumeTask(
        nodes.endpoint, part, key_names, ECQ_QUEUE, subscribe_after_start=True, deadline_s=deadline), cid)


def paced_flow(bench: Bench, nodes: Nodes, phase: str, cids: tuple[str, ...]) -> dict[str, Any]:
    """The paced flow of --cluster-rate writes/s for --cluster-seconds: latency over the whole flow, over its
    first second (consumers attaching, streams warming up) and over the steady state after it."""
    args = bench.args
    tasks = flow_tasks(bench, nodes, phase, cids, ECQ_QUEUE, ECQ_WRITE, args.cluster_seconds, args.cluster_rate)
    results = bench.run_phase(tasks, args.cluster_seconds + tasks[0].grace_s)
    whole = flow_summary(bench, nodes, phase, results)
    start = min(r["start_ns"] for r in results) / 1e9
    send_end = max(r["send_end_ns"] for r in results) / 1e9
    first = flow_summary(bench, nodes, f"{phase}-first-second", results, (start, start + FIRST_SECOND_S))
    steady = flow_summary(bench, nodes, f"{phase}-steady", results, (start + FIRST_SECOND_S, send_end))
    return {**whole, "first_second": {k: first[k] for k in ("measured", "p50_ms", "p99_ms", "max_ms")},
            "steady": {k: steady[k] for k in ("measured", "p50_ms", "p99_ms", "max_ms")}}


def idle_entries(bench: Bench, name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(clientids, keys) of the idle phase's --cluster-idle-entries entries."""
    return bench.ids(f"i-{name}-", max(1, bench.args.cluster_idle_entries // IDLE_KEYS)), keys(IDLE_KEYS)


def idle_jetstream(bench: Bench, nodes: Nodes, phase: str, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Publish --cluster-idle-entries entries to the nodes' streams from here, then CPU of the idle nodes and
    NATS servers over --cluster-idle-seconds."""
    cids, key_names = idle_entries(bench, name)
    preload = preload_jetstream(options["nats_servers"], options["jetstream_namespace"], cids, key_names,
                                bench.args.cluster_size)
    return {"preload": preload, **idle_cpu(bench, nodes, phase, bench.args.cluster_idle_seconds)}


def idle_leveldb(bench: Bench, phase: str) -> dict[str, Any]:
    """A LevelDB broker started on --cluster-idle-entries entries written straight into its store, idle for
    --cluster-idle-seconds: the baseline of the idle CPU."""
    cids, key_names = idle_entries(bench, "leveldb")
    broker = bench.new_ecq(bench.workdir / phase)
    preload = preload_store(broker.queues_dir, cids, key_names, bench.args.cluster_size)
    with bench.serving(broker, phase) as node:
        return {"preload": preload, **idle_cpu(bench, Nodes([node]), phase, bench.args.cluster_idle_seconds)}
