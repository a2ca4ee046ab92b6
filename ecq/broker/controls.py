"""Operating a running node: :class:`NodeControls` serves the admin HTTP API (:mod:`ecq.ops.admin`) and is what it and
SIGHUP ask of the broker beyond its queues (:class:`ecq.ops.admin.BrokerControls`): its options, health and readiness,
the ACL reloaded, the node drained, the cluster's streams reported and their leaders spread."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from amqtt.broker import BrokerContext

from ecq.broker.access import AccessControl
from ecq.broker.cluster_node import ClusterNode
from ecq.broker.drain import drain_node
from ecq.broker.observers import QueueEvents
from ecq.broker.writes import EcqWrites
from ecq.config import EcqSettings, split_host_port
from ecq.ops import admin
from ecq.ops.metrics import EcqMetrics
from ecq.queue.engine import QueueEngine

log = logging.getLogger(__name__)

# never shown by options(); pydantic's SecretStr hides them in inuse
SECRET_OPTIONS = frozenset({"admin_token", "nats_password", "nats_token"})
REDACTED = "**********"  # what pydantic's SecretStr shows


class NodeControls:
    """:class:`ecq.ops.admin.BrokerControls` for the node of ``context``; ``origin`` is the plugin's mapping as given
    in the config, ``events`` the node's event recorder now (None when events are off or failed to start)."""

    def __init__(self, settings: EcqSettings, origin: dict[str, Any], context: BrokerContext, engine: QueueEngine,
                 access: AccessControl, writes: EcqWrites, cluster: ClusterNode,
                 events: Callable[[], QueueEvents | None]) -> None:
        self._settings, self._origin, self._context, self._engine = settings, origin, context, engine
        self._access, self._writes, self._cluster, self._events = access, writes, cluster, events
        self.draining = False  # set by drain(): the node takes no clients any more (readiness false)
        self._drain: asyncio.Future | None = None
        self._admin: Any = None  # the admin API's aiohttp runner

    async def serve_admin_api(self, metrics: EcqMetrics) -> None:
        """Serve the admin HTTP API with ``metrics`` at ``admin_bind`` (nothing when it is None). Raises OSError naming
        the address when it cannot listen there."""
        if not self._settings.admin_bind:
            return
        host, port = split_host_port(self._settings.admin_bind)
        try:
            self._admin = await admin.serve(self._engine, self, metrics, host, port, self._settings.admin_token_value())
        except OSError as exc:  # another broker's API there would answer `ecq status` for this one
            raise OSError(f"cannot serve the admin API on {self._settings.admin_bind}: {exc.strerror or exc}") from None
        log.info("ECQ admin API on http://%s/ (metrics at /metrics)", self._settings.admin_bind)

    async def close(self) -> None:
        """Stop the admin API."""
        if self._admin:
            await self._admin.cleanup()

    def options(self, which: str) -> dict[str, Any]:
        """Plugin options: ``origin`` as given in the config; ``inuse`` as in effect (EcqSettings.in_effect:
        durations in seconds, computed values such as ``writer_pool_size`` and ``node_name`` resolved).

        Secrets (``admin_token``) are replaced by ``**********`` in both.
        """
        if which == "origin":
            return {k: REDACTED if k in SECRET_OPTIONS else v for k, v in self._origin.items()}
        return self._settings.in_effect()

    async def drain(self) -> dict[str, Any]:
        """Drain this node before it is stopped (``ecq drain``; see ecq.broker.drain): stop accepting, close the
        clients, settle the writes in flight (within ``write_timeout``), save the consumers' acks. Returns the
        report (ecq.broker.drain.DrainReport as a dict); a second call waits for the first drain's report."""
        if self._drain is None:
            self.draining = True
            self._drain = asyncio.ensure_future(drain_node(self._context, self._writes, self._engine,
                                                           self._settings.write_timeout))
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
        if self._engine.store.write_error:
            return False, f"store writes fail: {self._engine.store.write_error}"
        if (streams := self._cluster.stream_report()) is not None and not streams["writable"]:
            return False, "; ".join(streams["problems"]) or "streams not checked yet"
        return True, None

    def _problems(self) -> list[str]:
        engine = self._engine.health()
        problems = [engine["reason"]] if engine["status"] != "ok" else []
        if (streams := self._cluster.stream_report()) is not None:
            problems += streams["problems"]
        return problems

    def cluster_status(self) -> dict[str, Any] | None:
        """Leaders per server and each stream's leader and replicas current/configured (StreamHealth.report);
        None without a cluster."""
        return self._cluster.stream_report()

    async def rebalance(self) -> dict[str, Any] | None:
        """Spread the stream leaders over the NATS servers (see ClusterNode.rebalance); None without a cluster."""
        return await self._cluster.rebalance()

    def reload_acl(self) -> int:
        """Read the ACL file again; returns its rule count. Raises AclError and keeps the old rules."""
        return self._access.reload()

    def event_stats(self) -> dict[str, Any]:
        """The event recorder's counters (empty when events are off)."""
        return events.stats() if (events := self._events()) else {}
