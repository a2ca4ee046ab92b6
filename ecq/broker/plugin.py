"""The ECQ amqtt broker plugin: enable it by listing ``ecq.broker.plugin.EcqPlugin`` under ``plugins:``.

A thin adapter: each amqtt event becomes one call to the :class:`ecq.queue.engine.QueueEngine` (which
stores ``$ECQ/w/<clientid>/<key>`` writes with compaction by key, delivers each queue at QoS 1 to the
one client ``<clientid>`` subscribed to ``$ECQ/<clientid>/#`` and garbage-collects old entries), plus
takeover, the ACL (:mod:`ecq.broker.access`), the admin HTTP API with Prometheus metrics and the queue
event stream (:mod:`ecq.broker.observers`). Options: :class:`ecq.config.EcqSettings`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from amqtt.broker import BrokerContext
from amqtt.contexts import Action
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.plugins.base import BaseTopicPlugin
from amqtt.session import Session

from ecq.broker import amqtt_hooks as hooks
from ecq.broker.access import AccessControl
from ecq.broker.drain import drain_node
from ecq.broker.observers import QueueEvents
from ecq.broker.sessions import QueueSessions
from ecq.broker.stored_sessions import StoredSessions
from ecq.broker.writes import EcqWrites
from ecq.config import EcqSettings, split_host_port
from ecq.ops import admin
from ecq.ops.metrics import EcqMetrics, MetricsObserver
from ecq.queue.engine import QueueEngine
from ecq.queue.throttle import LogThrottle
from ecq.store.backends import open_store

log = logging.getLogger(__name__)

SECRET_OPTIONS = frozenset({"admin_token", "nats_password", "nats_token"})  # never shown by options(); pydantic's SecretStr hides them in inuse
DROP_LOG_INTERVAL_S = 10.0  # at most one line per this for outgoing drops, and one for stuck subscribers closed
REDACTED = "**********"                      # what pydantic's SecretStr shows


class EcqPlugin(BaseTopicPlugin):
    """amqtt broker plugin for exclusive compacted queues.

    Raises (through amqtt's PluginInitError) pydantic.ValidationError for a bad option,
    ecq.store.protocol.StoreError when the data directory cannot be opened or its old layout cannot be moved
    (ecq.store.layout.LayoutError), ecq.broker.acl.AclError for a bad ACL file.
    """

    # amqtt fills this dataclass from the YAML mapping (and refuses unknown keys); EcqSettings validates it.
    Config = dataclasses.make_dataclass(
        "Config", [(name, Any, dataclasses.field(default=None)) for name in EcqSettings.model_fields])

    def __init__(self, context: BrokerContext) -> None:
        super().__init__(context)
        self._origin = {k: v for k, v in dataclasses.asdict(self.config).items() if v is not None}
        self.settings = EcqSettings(**self._origin)
        self.access = AccessControl(self.settings)
        self.events = QueueEvents(self.settings) if self.settings.events else None
        self.engine = QueueEngine(self.settings, open_store(self.settings), hooks.publish_qos1,
                                  gc_lagging=lambda: self.events is not None and self.events.lagging())
        self.start_error: Exception | None = None  # raised by ecq.broker.amqtt_hooks from Broker.start
        totals = self.engine.totals
        self.bus: Any = None  # ecq.broker.bus.ClusterBus with backend: jetstream
        self.stream_health: Any = None  # ecq.store.jetstream_health.StreamHealth with backend: jetstream
        self._spreading: asyncio.Future | None = None  # the leader spread at start
        self.cluster_state: Any = None  # ecq.broker.cluster_state.ClusterState with backend: jetstream
        self.stored_sessions: Any = None  # ecq.broker.stored_sessions.StoredSessions with backend: leveldb
        cluster = self.settings.backend == "jetstream"
        self.metrics = EcqMetrics({
            **({"ecq_nats_connected": self._nats_connected} if cluster else {}),
            "ecq_queues": lambda: totals().queues,
            "ecq_stored_messages": lambda: totals().stored_entries,
            "ecq_stored_bytes": lambda: totals().stored_bytes,
            "ecq_inflight": lambda: totals().inflight,
            "ecq_consumers_online": lambda: totals().online,
            "ecq_events_dropped": lambda: self.event_stats().get("dropped_items", 0),
        }, cluster=cluster)
        if cluster:
            self.engine.store.observe_publish = self.metrics.jetstream_publish_latency.observe
        self.engine.observers.append(MetricsObserver(self.metrics, self.settings.tombstones))
        self.metrics.watch_lag(self.engine.lag, lambda: totals().queues)
        if cluster:
            self.metrics.watch_streams(lambda: self.stream_health.report() if self.stream_health else None,
                                       lambda: self.ready()[0])
        self.sessions = QueueSessions(context, self.engine)
        self.writes = EcqWrites(self.settings, self.engine, self.access, self.metrics, lambda: self.events)
        self._admin: Any = None
        self._session_dropped = 0
        self._drop_log, self._stuck_log = LogThrottle(DROP_LOG_INTERVAL_S), LogThrottle(DROP_LOG_INTERVAL_S)
        self.draining = False  # set by drain(): the node takes no clients any more (readiness false)
        self._drain: asyncio.Future | None = None
        hooks.install(EcqPlugin)
        hooks.set_session_expiry(context, self.settings.session_expiry)
        hooks.shorten_subscriptions_repr(context)
        hooks.count_routed_publishes(context)
        log.info("ECQ plugin: data_dir=%s, %d writer agents", self.settings.data_dir, self.settings.effective_pool_size())

    # --- lifecycle ----------------------------------------------------------------------------------

    async def on_broker_pre_start(self) -> None:
        """Start event recording, the queue engine and the admin API.

        amqtt awaits this before it opens its listeners, so once the MQTT port accepts, ECQ is ready.
        amqtt 0.12.1 runs it in a task and ignores its exception, so a failure (the store cannot be read,
        the admin address is taken) is kept in ``start_error``; ecq.broker.amqtt_hooks raises it from Broker.start.
        """
        try:
            await self._start()
        except Exception as exc:
            self.start_error = exc

    async def _start(self) -> None:
        if self.events and await self.events.start():
            self.engine.observers.append(self.events)
        else:
            self.events = None
        await self.engine.start()
        if self.settings.backend == "jetstream":
            await self._join_cluster()
        else:
            self.stored_sessions = StoredSessions.load(self.settings, self.engine.store)
        if self.settings.admin_bind:
            host, port = split_host_port(self.settings.admin_bind)
            try:
                self._admin = await admin.serve(self.engine, self, self.metrics, host, port,
                                                self.settings.admin_token_value())
            except OSError as exc:  # another broker's API there would answer `ecq status` for this one
                raise OSError(f"cannot serve the admin API on {self.settings.admin_bind}: {exc.strerror or exc}") from None
            log.info("ECQ admin API on http://%s/ (metrics at /metrics)", self.settings.admin_bind)

    async def _join_cluster(self) -> None:
        from ecq.broker.bus import ClusterBus  # needs the [cluster] extra
        from ecq.broker.cluster_state import ClusterState
        loop = asyncio.get_running_loop()
        self.bus = ClusterBus(self.settings, loop, deliver=self._deliver_from_cluster,
                              release=self._release_to_cluster)
        await loop.run_in_executor(None, self.bus.start)
        self.cluster_state = ClusterState(self.settings, self.bus.link, loop, self._retained_from_cluster)
        await loop.run_in_executor(None, self.cluster_state.start)  # before the listeners open: retained loaded
        self.sessions.bus = self.bus
        self.stream_health = self.engine.store.stream_health()
        self.stream_health.start()
        self._spreading = asyncio.ensure_future(self._spread_leaders())
        log.info("ECQ node %s joined the cluster (NATS %s)", self.settings.effective_node_name(),
                 ", ".join(self.settings.nats_servers))

    async def _deliver_from_cluster(self, topic: str, data: bytes, qos: int) -> None:
        await hooks.broadcast_from_cluster(self.context, topic, data, qos)

    def _retained_from_cluster(self, topic: str, data: bytes | None, qos: int | None) -> None:
        hooks.set_retained_from_cluster(self.context, topic, data, qos)

    def retained_changed(self, topic: str, data: bytes, qos: int | None) -> None:
        """Store a retained message of an ordinary topic for the cluster (empty ``data``: cleared)."""
        if self.cluster_state is not None:
            self.cluster_state.retain(topic, data, qos)

    def session_message_queued(self, clientid: str, topic: str, qos: int, data: bytes) -> None:
        """Store a message queued for an offline persistent session in the session store."""
        if self.session_store is not None:
            self.session_store.queue_message(clientid, topic, qos, data)

    def queue_for_stored_sessions(self, topic: str, data: bytes, qos: int) -> None:
        """Queue a message for the stored sessions no CONNECT claimed since the start (LevelDB only)."""
        if self.stored_sessions is not None:
            self.stored_sessions.queue_for_stored(topic, data, qos)

    @property
    def session_store(self) -> Any:
        """Where persistent sessions outlive the broker (ecq.broker.session_state.SessionStore), None before start."""
        return self.cluster_state if self.cluster_state is not None else self.stored_sessions

    def session_queue_taken(self, clientid: str) -> None:
        """Drop the session store's copy of a persistent session's queue, which is being sent."""
        if self.session_store is not None:
            self.session_store.drop_queue(clientid)

    async def session_expired(self, clientid: str) -> None:
        """A persistent session ended by its MQTT 5 Session Expiry Interval (MQTT 5.0 section 3.1.2.11.2): in a
        cluster its stored subscriptions and queue are deleted and this broker stops answering for ``clientid``, so
        that no broker resumes it, also after this one died."""
        if self.session_store is not None:
            self.session_store.forget_session(clientid)
        if self.bus is not None:
            await self.bus.disown(clientid)

    async def claim_session(self, clientid: str, clean: bool) -> Any:
        """At a CONNECT, take ``clientid`` over from the cluster (see ClusterBus.claim): returns the persistent
        session (a SessionState, with its owner) another broker handed over or, when no broker answered and none is
        here, the one stored in the cluster; on one broker the one stored before a restart (StoredSessions.claim);
        None for a clean session (which is then discarded everywhere, MQTT 3.1.1 section 3.1.2.4)."""
        if self.bus is None:
            return self.stored_sessions.claim(clientid, clean) if self.stored_sessions is not None else None
        state = await self.bus.claim(clientid, clean)
        if clean:
            self.cluster_state.forget_session(clientid)
            return None
        if state is None and self.bus.connected and hooks.persistent_session(self.context, clientid) is None:
            state = await self.bus.link.submit(self.cluster_state.load_session(clientid))
        return state

    def session_discarded(self, clientid: str) -> None:
        """A CONNECT of another username did not resume ``clientid``'s session (``amqtt_hooks.session_owners``): the
        cluster forgets its copy, so that no broker resumes it later."""
        if self.session_store is not None:
            self.session_store.forget_session(clientid)

    async def _release_to_cluster(self, clientid: str, clean: bool) -> Any:
        from ecq.broker.cluster_state import SessionState
        await self.sessions.release(clientid)
        if clean:
            await hooks.discard_session(self.context, clientid)
            return SessionState(False)
        handed = await hooks.hand_over_session(self.context, clientid)
        await self.bus.link.submit(self.cluster_state.settle())
        if handed is None:
            return SessionState(False)
        held, messages = handed
        return SessionState(True, held.subscriptions, messages, held.username)

    def store_session(self, clientid: str) -> None:
        """Write ``clientid``'s persistent session (owner, subscriptions, expiry) to the session store (in a cluster:
        while this broker answers for it)."""
        if self.session_store is None or (self.bus is not None and not self.bus.holds(clientid)):
            return
        held = hooks.persistent_session(self.context, clientid)
        if held is not None:
            self.session_store.save_session(clientid, held)

    def forward_to_cluster(self, topic: str, data: bytes, qos: int) -> None:
        """Send a message of an ordinary topic broadcast here to the cluster's other brokers."""
        if self.bus is not None:
            self.bus.forward(topic, data, qos)

    def _nats_connected(self) -> float:
        store_link = getattr(self.engine.store, "connected", False)
        return float(bool(store_link) and self.bus is not None and self.bus.connected)

    async def on_broker_post_start(self) -> None:
        """Widen the MQTT listeners' accept queue to ``listen_backlog`` once amqtt opened them, then log in one
        line where everything is: MQTT listeners, admin API, data and lake directories, writer agents."""
        hooks.set_listen_backlog(self.context, self.settings.listen_backlog)
        log.info("ECQ ready: %s", self.settings.describe(hooks.listener_addresses(self.context)))

    async def on_broker_pre_shutdown(self) -> None:
        """Stop delivering and end a running GC pass; unacked messages stay stored for the next run, and so do the
        persistent sessions, offline from now on (their expiry runs from the shutdown)."""
        self.engine.stop_delivering()
        if self.stored_sessions is not None:
            self.stored_sessions.save_at_shutdown(hooks.persistent_sessions(self.context))

    async def close(self) -> None:
        """Stop the admin API, close the engine (queued writes committed), then flush events (amqtt calls this last)."""
        if self._admin:
            await self._admin.cleanup()
        if self.stream_health is not None:
            self.stream_health.stop()
        if self.cluster_state is not None:
            self.cluster_state.close()
        if self.bus is not None:
            self.bus.close()
        await self.engine.close()
        if self.events:
            await self.events.close()
        log.info("ECQ plugin: store closed")

    # --- operations (admin API, SIGHUP): ecq.ops.admin.BrokerControls -------------------------------

    def options(self, which: str) -> dict[str, Any]:
        """Plugin options: ``origin`` as given in the config; ``inuse`` as in effect (EcqSettings.in_effect:
        durations in seconds, computed values such as ``writer_pool_size`` and ``node_name`` resolved).

        Secrets (``admin_token``) are replaced by ``**********`` in both.
        """
        if which == "origin":
            return {k: REDACTED if k in SECRET_OPTIONS else v for k, v in self._origin.items()}
        return self.settings.in_effect()

    async def drain(self) -> dict[str, Any]:
        """Drain this node before it is stopped (``ecq drain``; see ecq.broker.drain): stop accepting, close the
        clients, settle the writes in flight (within ``write_timeout``), save the consumers' acks. Returns the
        report (ecq.broker.drain.DrainReport as a dict); a second call waits for the first drain's report."""
        if self._drain is None:
            self.draining = True
            self._drain = asyncio.ensure_future(drain_node(self.context, self.writes, self.engine,
                                                           self.settings.write_timeout))
        return (await asyncio.shield(self._drain)).as_dict()

    def health(self) -> dict[str, Any]:
        """``{"status": "ok"}`` when the store takes writes and, in a cluster, every ECQ stream has its leader and
        all its replicas current; else ``{"status": "degraded", "reason": "<problems joined>", "problems": [...]}``
        (the node lost NATS, a stream has no leader or runs below its replica count: names and servers given)."""
        problems = self._problems()
        if not problems:
            return {"status": "ok"}
        return {"status": "degraded", "reason": "; ".join(problems), "problems": problems}

    def ready(self) -> tuple[bool, str | None]:
        """(True, None) when a write would be stored now and the node is not draining; else (False, why). A
        write would be stored: the store is writable (LevelDB: not after a failed write, e.g. disk full) and,
        in a cluster, NATS is connected and every stream has a leader and a quorum of current replicas."""
        if self.draining:
            return False, "draining"
        if self.engine.store.write_error:
            return False, f"store writes fail: {self.engine.store.write_error}"
        if self.stream_health is not None and not self.stream_health.report()["writable"]:
            return False, "; ".join(self.stream_health.report()["problems"]) or "streams not checked yet"
        return True, None

    def _problems(self) -> list[str]:
        engine = self.engine.health()
        problems = [engine["reason"]] if engine["status"] != "ok" else []
        if self.stream_health is not None:
            problems += self.stream_health.report()["problems"]
        return problems

    def cluster_status(self) -> dict[str, Any] | None:
        """Leaders per server and each stream's leader and replicas current/configured (StreamHealth.report);
        None without a cluster."""
        return self.stream_health.report() if self.stream_health is not None else None

    async def rebalance(self) -> dict[str, Any] | None:
        """Spread the stream leaders over the NATS servers (ecq.store.jetstream_leaders.rebalance); None without
        a cluster. Raises what the NATS requests raised (TimeoutError, ConnectionError)."""
        if self.stream_health is None:
            return None
        from ecq.store.jetstream_leaders import rebalance
        return await self.stream_health.link.submit(rebalance(self.stream_health))

    async def _spread_leaders(self) -> None:
        try:
            await self.rebalance()
        except Exception as exc:  # the node serves as well with leaders where they are
            log.warning("ECQ could not spread the stream leaders at start: %s", exc or type(exc).__name__)

    def reload_acl(self) -> int:
        """Read the ACL file again; returns its rule count. Raises AclError and keeps the old rules."""
        return self.access.reload()

    def event_stats(self) -> dict[str, Any]:
        """The event recorder's counters (empty when events are off)."""
        return self.events.stats() if self.events else {}

    # --- writes and access control (called by ecq.broker.amqtt_hooks) -------------------------------

    def take_ecq_write(self, handler: BrokerProtocolHandler, topic: str, qos: int, packet_id: int | None,
                       payload: bytes, expiry_s: int = 0) -> None:
        """Take a PUBLISH under ``$ECQ/`` as the packet reader reads it (see EcqWrites.take)."""
        self.writes.take(handler, topic, qos, packet_id, payload, expiry_s)

    def hold_acknowledgement(self, handler: BrokerProtocolHandler) -> Callable[[Callable[[], None] | None], None]:
        """A place in the connection's PUBACK/PUBREC order for a plain QoS 1 or 2 PUBLISH (see
        EcqWrites.hold_acknowledgement)."""
        return self.writes.hold_acknowledgement(handler)

    def count_fast_path(self, publishes: int, pubacks: int) -> None:
        """Count packets the framer took without amqtt's packet objects (``ecq_fast_path_packets_total``)."""
        if publishes:
            self.metrics.fast_path_publishes.inc(publishes)
        if pubacks:
            self.metrics.fast_path_pubacks.inc(pubacks)

    def count_protocol_violation(self) -> None:
        """Count a connection closed for a malformed packet (``ecq_protocol_violations_total``)."""
        self.metrics.protocol_violations.inc()

    def session_message_dropped(self, clientid: str, topic: str, reason: str) -> None:
        """Count a message of an ordinary topic dropped from ``clientid``'s persistent session because a bound
        was reached (``reason``: ``queue_full`` or ``inflight_full``); logs the 1st, 2nd, 4th, 8th... drop."""
        self.metrics.session_dropped.labels(reason).inc()
        self._session_dropped += 1
        if self._session_dropped & (self._session_dropped - 1) == 0:
            log.warning("ECQ dropped a message to %r for session %s (%s; %d dropped since start)",
                        topic, clientid, reason, self._session_dropped)

    def outgoing_message_dropped(self, clientid: str | None, topic: str) -> None:
        """Count a message to a client whose connection is at ``max_queued_messages`` or ``max_queued_bytes``
        (``ecq_messages_dropped_total{reason="queue_full"}``); logs at most one line per 10 s."""
        self.metrics.messages_dropped.labels("queue_full").inc()
        if (held_back := self._drop_log.due()) is not None:
            log.warning("ECQ dropped a message to %r for %s: its connection is at max_queued_messages or "
                        "max_queued_bytes (%d more such drops since the last report, reported at most every %g s)",
                        topic, clientid, held_back, self._drop_log.interval_s)

    def stuck_subscriber_closed(self, clientid: str | None, messages: int, queued_bytes: int) -> None:
        """Count (``ecq_stuck_subscribers_closed_total``) and log (at most one line per 10 s) a connection closed
        after ``stuck_subscriber_timeout`` at its outgoing bound."""
        self.metrics.stuck_subscribers_closed.inc()
        if (held_back := self._stuck_log.due()) is not None:
            log.warning("ECQ closed the connection of %s: it read nothing for %g s with %d messages (%d bytes) queued "
                        "(%d more such closes since the last report, reported at most every %g s)", clientid,
                        self.settings.stuck_subscriber_timeout, messages, queued_bytes, held_back,
                        self._stuck_log.interval_s)

    def grant_subscription(self, clientid: str, topic_filter: str, qos: int) -> int | None:
        """QoS to grant for a SUBSCRIBE to an ``$ECQ/`` filter, or None to refuse it (see AccessControl)."""
        return self.access.grant_subscription(clientid, topic_filter, qos)

    def subscription_refusal(self, clientid: str, topic_filter: str, qos: int) -> str | None:
        """Why a SUBSCRIBE to an ``$ECQ/`` filter is refused, None when granted (see AccessControl)."""
        return self.access.subscription_refusal(clientid, topic_filter, qos)

    def will_refusal(self, session: Session) -> str | None:
        """Why a CONNECT carrying a Will must be refused (CONNACK 0x05), or None (see AccessControl)."""
        return self.access.will_refusal(session)

    async def topic_filtering(self, *, session: Session | None = None, topic: str | None = None,
                              action: Action | None = None) -> bool:
        """amqtt's topic filter hook: apply the ACL file to PUBLISH and SUBSCRIBE (RECEIVE is not filtered).

        A denied PUBLISH is dropped by amqtt with the publisher kept; a denied SUBSCRIBE gets SUBACK 0x80.
        """
        if session is None or topic is None or action not in (Action.PUBLISH, Action.SUBSCRIBE):
            return True
        return self.access.allows(session, action.value, topic)

    # --- connections and subscriptions -> engine (takeover in ecq.broker.sessions) -------------------

    async def on_broker_client_connected(self, client_id: str, client_session: Session) -> None:
        """Takeover, and a persistent session's queue resumed (see QueueSessions.connected)."""
        await self.sessions.connected(client_id)

    async def on_broker_client_subscribed(self, client_id: str, topic: str, qos: int) -> None:
        """Start delivering once the SUBACK for ``$ECQ/<clientid>/#`` went out."""
        await self.sessions.subscribed(client_id, topic)

    async def on_broker_client_unsubscribed(self, client_id: str, topic: str) -> None:
        """Stop delivering when the consumer unsubscribes from its queue."""
        await self.sessions.unsubscribed(client_id, topic)

    async def on_broker_client_disconnected(self, client_id: str, client_session: Session) -> None:
        """Detach a consumer whose connection closed (see QueueSessions.disconnected); store a persistent session
        once more, now offline (its expiry counts from here)."""
        await self.sessions.disconnected(client_id, client_session.clean_session is False)
        if client_session.clean_session is False:
            self.store_session(client_id)
