"""The ECQ amqtt broker plugin: enable it by listing ``ecq.broker.plugin.EcqPlugin`` under ``plugins:``. The amqtt
lifecycle only: it builds the node's parts, and each amqtt event or call of the amqtt corrections (``EcqHooksTarget``)
becomes one call to the part that owns it: the queues (:class:`ecq.queue.engine.QueueEngine`), takeover
(:mod:`.sessions`), persistent sessions kept (:mod:`.session_keeper`), writes (:mod:`.writes`), the ACL
(:mod:`.access`), the cluster (:mod:`.cluster_node`), metrics (:mod:`.node_metrics`), the admin API
(:mod:`.controls`), queue events (:mod:`.observers`). Options: :class:`ecq.config.EcqSettings`."""

from __future__ import annotations

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
from ecq.broker.cluster_node import ClusterNode
from ecq.broker.controls import NodeControls
from ecq.broker.node_metrics import NodeMetrics
from ecq.broker.observers import QueueEvents
from ecq.broker.session_keeper import SessionKeeper
from ecq.broker.sessions import QueueSessions
from ecq.broker.writes import EcqWrites
from ecq.config import EcqSettings
from ecq.queue.engine import QueueEngine
from ecq.store.backends import open_store

log = logging.getLogger(__name__)


class EcqPlugin(BaseTopicPlugin):
    """amqtt broker plugin for exclusive compacted queues. Raises (through amqtt's PluginInitError)
    pydantic.ValidationError for a bad option, ecq.store.protocol.StoreError when the data directory cannot be opened
    or its old layout moved (ecq.store.layout.LayoutError), ecq.broker.acl.AclError for a bad ACL file, and
    ecq.broker.amqtt_hooks.AmqttSeamError when the installed amqtt is not the one ECQ corrects."""

    # amqtt fills this dataclass from the YAML mapping (and refuses unknown keys); EcqSettings validates it.
    Config = dataclasses.make_dataclass(
        "Config", [(name, Any, dataclasses.field(default=None)) for name in EcqSettings.model_fields])

    def __init__(self, context: BrokerContext) -> None:
        super().__init__(context)
        hooks.install(EcqPlugin)  # first: refuses another amqtt before the store is opened
        origin = {k: v for k, v in dataclasses.asdict(self.config).items() if v is not None}
        self.settings = EcqSettings(**origin)
        self.access = AccessControl(self.settings)
        self.events = QueueEvents(self.settings) if self.settings.events else None
        self.engine = QueueEngine(self.settings, open_store(self.settings), hooks.publish_qos1,
                                  gc_lagging=lambda: self.events is not None and self.events.lagging())
        self.start_error: Exception | None = None  # raised by ecq.broker.amqtt_hooks from Broker.start
        self.sessions = QueueSessions(context, self.engine)
        self.cluster = ClusterNode(self.settings, context, self.engine, self.sessions)
        self.kept_sessions = self.session_sends = SessionKeeper(self.settings, context, self.cluster)
        self.metrics = NodeMetrics(self.settings, context, self.engine, self.cluster, self.kept_sessions,
                                   lambda: self.controls.event_stats(), lambda: self.controls.ready()[0])
        self.writes = EcqWrites(self.settings, self.engine, self.access, self.metrics.ecq, lambda: self.events)
        self.controls = NodeControls(self.settings, origin, context, self.engine, self.access, self.writes,
                                     self.cluster, lambda: self.events)
        hooks.set_session_expiry(context, self.settings.session_expiry)
        hooks.shorten_subscriptions_repr(context)
        hooks.count_routed_publishes(context)
        settings = self.settings
        log.info("ECQ plugin: data_dir=%s, %d writer agents", settings.data_dir, settings.effective_pool_size())

    async def on_broker_pre_start(self) -> None:
        """Start event recording, the queue engine, the cluster, the stored sessions and the admin API, before amqtt
        opens its listeners (once the MQTT port accepts, ECQ is ready). amqtt 0.12.1 ignores this task's exception, so
        a failure (store unreadable, admin address taken) is kept in ``start_error``, raised from Broker.start."""
        try:
            if self.events and await self.events.start():
                self.engine.observers.append(self.events)
            else:
                self.events = None
            await self.engine.start()
            if self.settings.backend == "jetstream":
                await self.cluster.join()
            self.kept_sessions.start(self.engine)
            await self.controls.serve_admin_api(self.metrics.ecq)
        except Exception as exc:
            self.start_error = exc

    async def on_broker_post_start(self) -> None:
        """Widen the listeners' accept queue to ``listen_backlog``, then log in one line where everything is."""
        hooks.set_listen_backlog(self.context, self.settings.listen_backlog)
        log.info("ECQ ready: %s", self.settings.describe(hooks.listener_addresses(self.context)))

    async def on_broker_pre_shutdown(self) -> None:
        """Stop delivering (unacked messages and persistent sessions stay stored), hand a cluster its SCQ groups."""
        self.engine.stop_delivering()
        self.kept_sessions.save_at_shutdown()
        await self.cluster.leave_groups()

    async def close(self) -> None:
        """Stop the admin API, leave the cluster, close the engine (writes committed), flush events (amqtt's last)."""
        await self.controls.close()
        self.cluster.close()
        await self.engine.close()
        if self.events:
            await self.events.close()
        log.info("ECQ plugin: store closed")

    async def topic_filtering(self, *, session: Session | None = None, topic: str | None = None,
                              action: Action | None = None) -> bool:
        """amqtt's topic filter: the ACL judges PUBLISH (denied: dropped) and SUBSCRIBE (denied: SUBACK 0x80)."""
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
        """Detach a consumer whose connection closed (QueueSessions.disconnected); keep a persistent session."""
        await self.sessions.disconnected(client_id, client_session.clean_session is False)
        if client_session.clean_session is False:
            self.kept_sessions.store_session(client_id)

    # --- what the amqtt corrections call (ecq.broker.amqtt_hooks.EcqHooksTarget, documented there) ----------

    def take_ecq_write(self, handler: BrokerProtocolHandler, topic: str, qos: int, packet_id: int | None,
                       payload: bytes, expiry_s: int = 0) -> None:
        self.writes.take(handler, topic, qos, packet_id, payload, expiry_s)

    def hold_acknowledgement(self, handler: BrokerProtocolHandler) -> Callable[[Callable[[], None] | None], None]:
        return self.writes.hold_acknowledgement(handler)

    def grant_subscription(self, clientid: str, topic_filter: str, qos: int) -> int | None:
        return self.access.grant_subscription(clientid, topic_filter, qos)

    def subscription_refusal(self, clientid: str, topic_filter: str, qos: int) -> str | None:
        return self.access.subscription_refusal(clientid, topic_filter, qos)

    def will_refusal(self, session: Session) -> str | None:
        return self.access.will_refusal(session)

    def forward_to_cluster(self, topic: str, data: bytes, qos: int) -> None:
        self.cluster.forward(topic, data, qos)

    def retained_changed(self, topic: str, data: bytes, qos: int | None) -> None:
        self.cluster.retained_changed(topic, data, qos)

    async def claim_session(self, clientid: str, clean: bool) -> Any:
        return await self.kept_sessions.claim(clientid, clean)

    def store_session(self, clientid: str) -> None:
        self.kept_sessions.store_session(clientid)

    def session_discarded(self, clientid: str) -> None:
        self.kept_sessions.discarded(clientid)

    def session_message_queued(self, clientid: str, topic: str, qos: int, data: bytes) -> None:
        self.kept_sessions.message_queued(clientid, topic, qos, data)

    def queue_for_stored_sessions(self, topic: str, data: bytes, qos: int) -> list[tuple[str, str]]:
        return self.kept_sessions.queue_for_stored(topic, data, qos)

    async def session_queue_taken(self, clientid: str, messages: list[tuple[str, int, bytes]], kept: frozenset) -> list:
        return await self.kept_sessions.queue_taken(clientid, messages, kept)

    async def session_expired(self, clientid: str) -> None:
        await self.kept_sessions.expired(clientid)

    def session_evicted(self, clientid: str, session: Any, messages: list[tuple[str, int, bytes]]) -> bool:
        return self.kept_sessions.evicted(clientid, session, messages)

    def count_fast_path(self, publishes: int, pubacks: int, pings: int = 0) -> None:
        self.metrics.count_fast_path(publishes, pubacks, pings)

    def count_protocol_violation(self) -> None:
        self.metrics.count_protocol_violation()

    def connection_refused_at_cap(self) -> None:
        self.metrics.connection_refused_at_cap()

    def session_message_dropped(self, clientid: str, topic: str, reason: str) -> None:
        self.metrics.session_message_dropped(clientid, topic, reason)

    def outgoing_message_dropped(self, clientid: str | None, topic: str) -> None:
        self.metrics.outgoing_message_dropped(clientid, topic)

    def stuck_subscriber_closed(self, clientid: str | None, messages: int, queued_bytes: int) -> None:
        self.metrics.stuck_subscriber_closed(clientid, messages, queued_bytes)
