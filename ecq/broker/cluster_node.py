"""This broker as one of a cluster's brokers (``backend: jetstream``): it joins the cluster at start (the bus between
brokers, the cluster's KV state, the streams' health, the leaders spread), keeps the cluster told of what follows a
client across brokers (retained messages, messages of ordinary topics), hands a persistent session over to the
broker where its client id connects (:meth:`_release_to_cluster`; the sessions are kept by :mod:`.session_keeper`),
and serves an SCQ shared group only while it holds the group's lease (:mod:`.group_leases`).
Without a cluster every call is a no-op. The bus is :mod:`ecq.broker.bus`, the stored state
:mod:`ecq.broker.cluster_state`; amqtt's side of the hand-over is ``ecq.broker.amqtt_hooks.cluster``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from amqtt.broker import BrokerContext

from ecq.broker import amqtt_hooks as hooks
from ecq.broker.sessions import QueueSessions
from ecq.config import EcqSettings
from ecq.queue.engine import QueueEngine

log = logging.getLogger(__name__)


class ClusterNode:
    """The cluster's side of one broker (``context``), joined by :meth:`join` when ``backend`` is ``jetstream``."""

    def __init__(self, settings: EcqSettings, context: BrokerContext, engine: QueueEngine,
                 sessions: QueueSessions) -> None:
        self._settings, self._context, self._engine, self._sessions = settings, context, engine, sessions
        self.bus: Any = None  # ecq.broker.bus.ClusterBus with backend: jetstream
        self.state: Any = None  # ecq.broker.cluster_state.ClusterState with backend: jetstream
        self.stream_health: Any = None  # ecq.store.jetstream_health.StreamHealth with backend: jetstream
        self.leases: Any = None  # ecq.broker.group_leases.GroupLeases with backend: jetstream
        self._spreading: asyncio.Future | None = None  # the leader spread at start

    async def join(self) -> None:
        """Start the bus, the cluster's state (retained messages loaded, before the listeners open) and the SCQ
        groups' leases, watch the streams' health and spread their leaders in the background. Raises what NATS
        raised."""
        from ecq.broker.bus import ClusterBus  # needs the [cluster] extra
        from ecq.broker.cluster_state import ClusterState
        from ecq.broker.group_leases import GroupLeases
        loop = asyncio.get_running_loop()
        self.bus = ClusterBus(self._settings, loop, deliver=self._deliver_from_cluster,
                              release=self._release_to_cluster)
        await loop.run_in_executor(None, self.bus.start)
        self.state = ClusterState(self._settings, self.bus.link, loop, self._retained_from_cluster)
        await loop.run_in_executor(None, self.state.start)  # before the listeners open: retained loaded
        self.leases = GroupLeases(self._settings, self.bus.link, serve=self._sessions.serve_group,
                                  stop=self._sessions.stop_group, wanted=self._sessions.wants_group)
        await loop.run_in_executor(None, self.leases.start)
        self._sessions.bus, self._sessions.leases = self.bus, self.leases
        self.stream_health = self._engine.store.stream_health()
        self.stream_health.start()
        self._spreading = asyncio.ensure_future(self._spread_leaders())
        log.info("ECQ node %s joined the cluster (NATS %s)", self._settings.effective_node_name(),
                 ", ".join(self._settings.nats_servers))

    async def leave_groups(self) -> None:
        """Stop serving the SCQ groups whose lease this broker holds and hand the leases back once their acks are
        saved (a stopping broker: the other brokers' members take the groups over at once)."""
        if self.leases is not None:
            await self.leases.close()

    def close(self) -> None:
        """Stop watching the streams, close the cluster's state and the bus."""
        if self.stream_health is not None:
            self.stream_health.stop()
        if self.state is not None:
            self.state.close()
        if self.bus is not None:
            self.bus.close()

    def stream_report(self) -> dict[str, Any] | None:
        """Leaders per server and each stream's leader and replicas current/configured (StreamHealth.report); None
        without a cluster."""
        return self.stream_health.report() if self.stream_health is not None else None

    def nats_connected(self) -> float:
        """1.0 while the store's and the bus's links to NATS are up, else 0.0 (the ``ecq_nats_connected`` gauge)."""
        store_link = getattr(self._engine.store, "connected", False)
        return float(bool(store_link) and self.bus is not None and self.bus.connected)

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

    async def _deliver_from_cluster(self, topic: str, data: bytes, qos: int) -> None:
        await hooks.broadcast_from_cluster(self._context, topic, data, qos)

    def _retained_from_cluster(self, topic: str, data: bytes | None, qos: int | None) -> None:
        hooks.set_retained_from_cluster(self._context, topic, data, qos)

    def forward(self, topic: str, data: bytes, qos: int) -> None:
        """Send a message of an ordinary topic broadcast here to the cluster's other brokers."""
        if self.bus is not None:
            self.bus.forward(topic, data, qos)

    def retained_changed(self, topic: str, data: bytes, qos: int | None) -> None:
        """Store a retained message of an ordinary topic for the cluster (empty ``data``: cleared)."""
        if self.state is not None:
            self.state.retain(topic, data, qos)

    async def _release_to_cluster(self, clientid: str, clean: bool) -> Any:
        from ecq.broker.session_state import SessionState
        await self._sessions.release(clientid)
        if clean:
            await hooks.discard_session(self._context, clientid)
            return SessionState(False)
        handed = await hooks.hand_over_session(self._context, clientid)
        await self.bus.link.submit(self.state.settle())
        if handed is None:
            return SessionState(False)
        return SessionState(True, handed.session.subscriptions, handed.messages, handed.session.username,
                            releases=handed.releases)
