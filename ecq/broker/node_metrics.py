"""The node's Prometheus metrics (:class:`ecq.ops.metrics.EcqMetrics`) wired to what they read: the engine's totals,
the lag index and the engine's events, the cluster's links and streams, amqtt's connections; and the counts (with their
rate-limited log lines) of what the amqtt corrections report: packets of the fast path, protocol violations, CONNECTs
refused at ``max_connections``, messages dropped, stuck subscribers closed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from amqtt.broker import BrokerContext

from ecq.broker import amqtt_hooks as hooks
from ecq.broker.cluster_node import ClusterNode
from ecq.broker.session_keeper import SessionKeeper
from ecq.config import EcqSettings
from ecq.ops.metrics import EcqMetrics, MetricsObserver
from ecq.queue.engine import QueueEngine
from ecq.queue.throttle import LogThrottle

log = logging.getLogger(__name__)

DROP_LOG_INTERVAL_S = 10.0  # at most one line per this for outgoing drops, and one for stuck subscribers closed


class NodeMetrics:
    """``ecq``: the node's EcqMetrics, its gauges reading ``engine``, ``cluster``, ``context``'s connections and the
    sessions ``kept_sessions`` holds in the store only, its counters fed by the engine's observer and by the methods
    here; ``event_stats`` and ``ready`` are the node's (``BrokerControls``)."""

    def __init__(self, settings: EcqSettings, context: BrokerContext, engine: QueueEngine, cluster: ClusterNode,
                 kept_sessions: SessionKeeper, event_stats: Callable[[], dict[str, Any]],
                 ready: Callable[[], bool]) -> None:
        totals = engine.totals
        on_cluster = settings.backend == "jetstream"
        self.ecq = EcqMetrics({
            **({"ecq_nats_connected": cluster.nats_connected} if on_cluster else {}),
            "ecq_queues": lambda: totals().queues,
            "ecq_stored_messages": lambda: totals().stored_entries,
            "ecq_stored_bytes": lambda: totals().stored_bytes,
            "ecq_inflight": lambda: totals().inflight,
            "ecq_consumers_online": lambda: totals().online,
            "ecq_connections": lambda: hooks.connections(context),
            "ecq_sessions_stored": kept_sessions.stored_only,
            "ecq_events_dropped": lambda: event_stats().get("dropped_items", 0),
        }, cluster=on_cluster)
        if on_cluster:
            engine.store.observe_publish = self.ecq.jetstream_publish_latency.observe
        kept_sessions.record_written = self.ecq.session_records_written.inc
        engine.observers.append(MetricsObserver(self.ecq, settings.tombstones))
        self.ecq.watch_lag(engine.lag, lambda: totals().queues)
        if on_cluster:
            self.ecq.watch_streams(cluster.stream_report, ready)
        self._stuck_subscriber_timeout = settings.stuck_subscriber_timeout
        self._session_dropped = 0
        self._drop_log, self._stuck_log = LogThrottle(DROP_LOG_INTERVAL_S), LogThrottle(DROP_LOG_INTERVAL_S)

    def count_fast_path(self, publishes: int, pubacks: int, pings: int = 0) -> None:
        """Count packets the framer took without amqtt's packet objects (``ecq_fast_path_packets_total``)."""
        if publishes:
            self.ecq.fast_path_publishes.inc(publishes)
        if pubacks:
            self.ecq.fast_path_pubacks.inc(pubacks)
        if pings:
            self.ecq.fast_path_pings.inc(pings)

    def count_protocol_violation(self) -> None:
        """Count a connection closed for a malformed packet (``ecq_protocol_violations_total``)."""
        self.ecq.protocol_violations.inc()

    def connection_refused_at_cap(self) -> None:
        """Count a CONNECT refused at ``max_connections`` (``ecq_connections_refused_total``)."""
        self.ecq.connections_refused.inc()

    def session_message_dropped(self, clientid: str, topic: str, reason: str) -> None:
        """Count a message of an ordinary topic dropped from ``clientid``'s persistent session because a bound
        was reached (``reason``: ``queue_full`` or ``inflight_full``); logs the 1st, 2nd, 4th, 8th... drop."""
        self.ecq.session_dropped.labels(reason).inc()
        self._session_dropped += 1
        if self._session_dropped & (self._session_dropped - 1) == 0:
            log.warning("ECQ dropped a message to %r for session %s (%s; %d dropped since start)",
                        topic, clientid, reason, self._session_dropped)

    def outgoing_message_dropped(self, clientid: str | None, topic: str) -> None:
        """Count a message to a client whose connection is at ``max_queued_messages`` or ``max_queued_bytes``
        (``ecq_messages_dropped_total{reason="queue_full"}``); logs at most one line per 10 s."""
        self.ecq.messages_dropped.labels("queue_full").inc()
        if (held_back := self._drop_log.due()) is not None:
            log.warning("ECQ dropped a message to %r for %s: its connection is at max_queued_messages or "
                        "max_queued_bytes (%d more such drops since the last report, reported at most every %g s)",
                        topic, clientid, held_back, self._drop_log.interval_s)

    def stuck_subscriber_closed(self, clientid: str | None, messages: int, queued_bytes: int) -> None:
        """Count (``ecq_stuck_subscribers_closed_total``) and log (at most one line per 10 s) a connection closed
        after ``stuck_subscriber_timeout`` at its outgoing bound."""
        self.ecq.stuck_subscribers_closed.inc()
        if (held_back := self._stuck_log.due()) is not None:
            log.warning("ECQ closed the connection of %s: it read nothing for %g s with %d messages (%d bytes) queued "
                        "(%d more such closes since the last report, reported at most every %g s)", clientid,
                        self._stuck_subscriber_timeout, messages, queued_bytes, held_back,
                        self._stuck_log.interval_s)
