"""Prometheus metrics of one ECQ broker, in a registry of their own so brokers in one process
do not mix. Served as Prometheus text at the admin API's ``/metrics``.

Counters grow from broker start, most of them through :class:`MetricsObserver` (a queue engine observer);
gauges are read at scrape time, on the event loop, through callbacks. Latencies are histograms in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ecq.queue.lag import LagIndex
from ecq.store.protocol import Append, Appended, ExpiredRow, Message
from ecq.queue.topics import RewindPoint, is_position_id

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

_PENDING_BUCKETS = (0, 1, 10, 100, 1000, 10000)  # per-queue pending entries; +Inf follows
_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EcqMetrics:
    """The metric objects; ``gauges`` maps a gauge name to a callable returning its current value."""

    def __init__(self, gauges: dict[str, Callable[[], float]], cluster: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.writes_accepted = Counter("ecq_writes_accepted", "ECQ writes committed to the store", registry=r)
        self.writes_refused = Counter("ecq_writes_refused", "ECQ PUBLISHes refused, by reason", ["reason"], registry=r)
        self.compactions = Counter("ecq_compactions", "stored values deleted because their key was rewritten",
                                   registry=r)
        self.deliveries = Counter("ecq_deliveries", "QoS 1 PUBLISHes sent to consumers (first sends)", registry=r)
        self.redeliveries = Counter("ecq_redeliveries", "QoS 1 PUBLISHes sent again after the consumer reconnected",
                                    registry=r)
        self.acks = Counter("ecq_acks", "PUBACKs received from consumers", registry=r)
        self.deliveries_skipped = Counter("ecq_deliveries_skipped", "queue entries not sent to a consumer's "
                                          "connection, by reason (packet_too_large: above its MQTT 5 Maximum "
                                          "Packet Size, left pending; packet_too_large_dropped: such an entry "
                                          "given up once 1024 later entries were acked)", ["reason"], registry=r)
        self.session_dropped = Counter(
            "ecq_session_dropped", "messages of ordinary topics dropped from a persistent session: queue_full "
            "(session_max_queued), inflight_full (session_max_inflight)", ["reason"], registry=r)
        self.messages_dropped = Counter(
            "ecq_messages_dropped", "messages of ordinary topics not sent to a connected client: queue_full (its "
            "connection at max_queued_messages or max_queued_bytes)", ["reason"], registry=r)
        self.stuck_subscribers_closed = Counter(
            "ecq_stuck_subscribers_closed", "connections closed after stuck_subscriber_timeout at their outgoing "
            "bound (max_queued_messages, max_queued_bytes)", registry=r)
        fast_path = Counter("ecq_fast_path_packets", "packets read on the fast path (fast_path: true), by type: publish "
                            "(under $ECQ/), puback (of an ECQ delivery), pingreq (answered at once)", ["packet"],
                            registry=r)
        self.fast_path_publishes, self.fast_path_pubacks = fast_path.labels("publish"), fast_path.labels("puback")
        self.fast_path_pings = fast_path.labels("pingreq")
        self.protocol_violations = Counter("ecq_protocol_violations", "connections closed for a malformed packet or "
                                           "a protocol violation (MQTT 3.1.1 section 4.8)", registry=r)
        self.connections_refused = Counter("ecq_connections_refused", "CONNECTs refused with CONNACK 0x03 (MQTT 5 "
                                           "0x97): the node served max_connections client ids", registry=r)
        self.session_records_written = Counter(
            "ecq_session_records_written", "persistent session records written to the store at a CONNACK, SUBACK, "
            "UNSUBACK or disconnect (not when the store holds that record already)", registry=r)
        self.gc_runs = Counter("ecq_gc_runs", "garbage collection passes", registry=r)
        self.store_errors = Counter("ecq_store_errors", "LevelDB operations that failed, by op (read: a damaged "
                                    "block stopped a queue's delivery; write: a commit failed)", ["op"], registry=r)
        self.rewinds = Counter("ecq_rewinds", "queues rewound (ctl topic, ecq rewind, admin API)", registry=r)
        self.tombstones_written = Counter("ecq_tombstones_written", "tombstones (empty-payload writes) committed",
                                          registry=r)
        self.tombstones_removed = Counter("ecq_tombstones_removed", "tombstones deleted, by reason (tombstone_acked: "
                                          "their PUBACK; tombstone_retention, retention: GC)", ["reason"], registry=r)
        self.purged = Counter("ecq_purged_rows", "entries deleted by ecq purge", registry=r)
        self.quota_evictions = Counter("ecq_quota_evictions", "oldest entries deleted to keep a queue within "
                                       "max_queue_messages / max_queue_bytes (quota_policy drop_oldest)", registry=r)
        self.queues_forgotten = Counter("ecq_queues_forgotten", "empty idle queues whose seqno and ack state GC "
                                        "deleted (state_retention)", registry=r)
        self.scq_positions_forgotten = Counter("ecq_scq_positions_forgotten", "SCQ readers' positions GC deleted, "
                                               "their reader offline and without an ack for state_retention",
                                               registry=r)
        self.gc_deleted = Counter("ecq_gc_deleted_rows", "entries deleted by garbage collection", registry=r)
        self.append_latency = Histogram("ecq_append_latency_seconds", "PUBLISH received to write committed",
                                        buckets=_LATENCY_BUCKETS_S, registry=r)
        self.delivery_latency = Histogram("ecq_delivery_latency_seconds", "PUBLISH sent to consumer to its PUBACK",
                                          buckets=_LATENCY_BUCKETS_S, registry=r)
        if cluster:  # backend: jetstream
            self.jetstream_publish_latency = Histogram(
                "ecq_jetstream_publish_seconds", "JetStream publish to its ack (stored on a quorum of replicas)",
                buckets=_LATENCY_BUCKETS_S, registry=r)
        for name, (help_text, read) in _gauge_help(gauges).items():
            Gauge(name, help_text, registry=r).set_function(read)

    def watch_lag(self, lag: LagIndex, queues: Callable[[], int]) -> None:
        """Serve the lag metrics from ``lag`` (read at each scrape); ``queues()`` is how many queues there are,
        lagging or not (the histogram's count)."""
        self.registry.register(LagCollector(lag, queues))

    def watch_streams(self, report: Callable[[], dict[str, Any] | None], ready: Callable[[], bool]) -> None:
        """Serve the cluster metrics (read at each scrape): ``report()`` is the stream health report
        (ecq.store.jetstream_health.StreamHealth.report, None before it runs), ``ready()`` the node's readiness."""
        self.registry.register(StreamCollector(report, ready))

    def exposition(self) -> bytes:
        """The Prometheus text exposition format (version 0.0.4) of every metric."""
        return generate_latest(self.registry)


_GAUGE_HELP = {
    "ecq_nats_connected": "1 while this broker's links to NATS (queue store and cluster bus) are up, else 0",
    "ecq_queues": "queues that ever had a write (clientids in the seqno table); in a cluster, queues holding entries",
    "ecq_stored_messages": "entries stored across all queues",
    "ecq_stored_bytes": "payload bytes stored across all queues (exact: the index total at start-up, kept by each write and GC)",
    "ecq_inflight": "PUBLISHes sent to consumers and not yet acknowledged",
    "ecq_consumers_online": "ECQ consumers and SCQ readers connected and subscribed to their queue",
    "ecq_connections": "client ids connected to this node, as max_connections counts them",
    "ecq_sessions_stored": "offline persistent sessions held in the store only, not in memory (0 on a cluster)",
    "ecq_events_dropped": "queue events dropped by the event buffer's overload protection",
}


def _gauge_help(gauges: dict[str, Callable[[], float]]) -> dict[str, tuple[str, Callable[[], float]]]:
    return {name: (_GAUGE_HELP[name], read) for name, read in gauges.items()}


class LagCollector:
    """A prometheus_client collector over the lag index: ``ecq_pending_messages`` (pending entries, all queues, an
    SCQ's once per reader), ``ecq_oldest_pending_age_seconds`` (the oldest pending entry's age, 0 when none), the
    histogram ``ecq_queue_pending_messages`` of pending entries per ECQ queue (buckets 0, 1, 10, ..., 10000, +Inf;
    its count is ``queues()``, every queue of the broker), and for SCQs ``ecq_scq_readers`` (reader positions the
    index follows) and ``ecq_scq_pending_messages`` (pending entries over them). No per-clientid labels: a fleet has
    100,000+ queues."""

    def __init__(self, lag: LagIndex, queues: Callable[[], int]) -> None:
        self._lag, self._queues = lag, queues

    def collect(self):
        """The metric families, computed now (on the event loop, from the index in memory)."""
        pending, age_s = self._lag.totals()
        yield GaugeMetricFamily("ecq_pending_messages", "entries stored and not yet acked, over every queue",
                                value=pending)
        yield GaugeMetricFamily("ecq_oldest_pending_age_seconds", "age of the oldest entry not yet acked, over "
                                "every queue (0 when none)", value=age_s)
        counts = [0] * len(_PENDING_BUCKETS)
        lagging = 0
        for count in self._lag.pending_counts():
            lagging += 1
            for index, bound in enumerate(_PENDING_BUCKETS):
                counts[index] += count <= bound
        total = max(self._queues(), lagging)
        cumulative = [(str(float(bound)), n + total - lagging) for bound, n in zip(_PENDING_BUCKETS, counts)]
        readers, scq_pending = self._lag.scq_totals()
        yield HistogramMetricFamily("ecq_queue_pending_messages", "queues by their count of entries not yet acked",
                                    buckets=[*cumulative, ("+Inf", total)], sum_value=pending - scq_pending)
        yield GaugeMetricFamily("ecq_scq_readers", "SCQ readers' positions (stored or in memory) the lag index "
                                "follows", value=readers)
        yield GaugeMetricFamily("ecq_scq_pending_messages", "SCQ entries not yet acked, counted once per reader",
                                value=scq_pending)


class StreamCollector:
    """A prometheus_client collector of the ECQ streams' health: ``ecq_stream_leader{stream,server}`` (1 on the
    stream's leader, 0 on its other replicas), ``ecq_stream_replicas_current{stream}`` (replicas holding a current
    copy, the leader included; 0 without a leader), ``ecq_stream_replicas{stream}`` (configured) and
    ``ecq_cluster_ready`` (1 when this node would store a write now and is not draining)."""

    def __init__(self, report: Callable[[], dict[str, Any] | None], ready: Callable[[], bool]) -> None:
        self._report, self._ready = report, ready

    def collect(self):
        """The four metric families, from the last poll of the streams."""
        streams = (self._report() or {}).get("streams", {})
        leader = GaugeMetricFamily("ecq_stream_leader", "1 on the NATS server leading the ECQ stream, 0 on its "
                                   "other replicas", labels=["stream", "server"])
        current = GaugeMetricFamily("ecq_stream_replicas_current", "replicas of the ECQ stream holding a current "
                                    "copy (the leader included; 0 without a leader)", labels=["stream"])
        configured = GaugeMetricFamily("ecq_stream_replicas", "configured replicas of the ECQ stream",
                                       labels=["stream"])
        for name, stream in sorted(streams.items()):
            for server in stream["current"] + stream["lagging"]:
                leader.add_metric([name, server], float(server == stream["leader"]))
            current.add_metric([name], stream["replicas_current"])
            configured.add_metric([name], stream["replicas"])
        yield from (leader, current, configured)
        yield GaugeMetricFamily("ecq_cluster_ready", "1 when this node would store a write now (NATS connected, "
                                "every ECQ stream with a leader and a quorum) and is not draining",
                                value=float(self._ready()))


class MetricsObserver:
    """A queue engine observer (ecq.queue.observer.QueueObserver) that counts into ``metrics``."""

    def __init__(self, metrics: EcqMetrics, tombstones: bool = False) -> None:
        self._m = metrics
        self._tombstones = tombstones  # an empty payload is a tombstone (option tombstones)

    def appended(self, op: Append, result: Appended) -> None:
        """Count an accepted write and the values its compaction deleted."""
        self._m.writes_accepted.inc()
        if self._tombstones and not op.payload:
            self._m.tombstones_written.inc()
        if result.replaced:
            self._m.compactions.inc(len(result.replaced))

    def expired(self, clientid: str, rows: tuple[ExpiredRow, ...], reason: str = "retention") -> None:
        """Count the rows GC, a purge or a tombstone's PUBACK deleted, and the tombstones among them."""
        if reason in ("purge", "quota"):
            (self._m.purged if reason == "purge" else self._m.quota_evictions).inc(len(rows))
            return
        if reason != "tombstone_acked":
            self._m.gc_deleted.inc(len(rows))
        if self._tombstones and (removed := sum(1 for row in rows if row.size == 0)):
            self._m.tombstones_removed.labels(reason).inc(removed)

    def delivered(self, clientid: str, message: Message, attempt: int) -> None:
        """Count a first send or a send again."""
        (self._m.deliveries if attempt == 1 else self._m.redeliveries).inc()

    def acked(self, clientid: str, message: Message, sent_monotonic: float) -> None:
        """Count a PUBACK and observe its round trip."""
        self._m.acks.inc()
        self._m.delivery_latency.observe(time.monotonic() - sent_monotonic)

    def skipped(self, clientid: str, message: Message, reason: str) -> None:
        """Count an entry skipped for a consumer's connection."""
        self._m.deliveries_skipped.labels(reason).inc()

    def store_error(self, op: str, exc: Exception) -> None:
        """Count a failed store read or write."""
        self._m.store_errors.labels(op).inc()

    def gc_started(self) -> None:
        """Count a GC pass."""
        self._m.gc_runs.inc()

    def forgotten(self, clientid: str) -> None:
        """Count a queue whose seqno and ack state state GC deleted, or an SCQ reader's position."""
        (self._m.scq_positions_forgotten if is_position_id(clientid) else self._m.queues_forgotten).inc()

    def rewound(self, clientid: str, point: RewindPoint, acked: int) -> None:
        """Count a rewind."""
        self._m.rewinds.inc()
