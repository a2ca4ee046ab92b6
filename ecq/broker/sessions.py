"""Which MQTT connection gets a queue: session takeover (MQTT 3.1.1 section 3.1.4), persistent sessions
resuming their queue, and the attach/detach calls to the queue engine that follow from amqtt's
connect, subscribe, unsubscribe and disconnect events."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from amqtt.broker import BrokerContext
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

from ecq.broker import amqtt_hooks as hooks
from ecq.queue.engine import QueueEngine
from ecq.queue.topics import queue_filter

if TYPE_CHECKING:
    from ecq.broker.bus import ClusterBus

log = logging.getLogger(__name__)

RELEASE_READ_S = 0.5  # a takeover from another node: at most this long to read what the client sent before


class QueueSessions:
    """Tracks the live connection of each clientid of ``context`` and attaches it to ``engine`` while it
    holds its ``$ECQ/<clientid>/#`` subscription."""

    def __init__(self, context: BrokerContext, engine: QueueEngine) -> None:
        self._context, self._engine = context, engine
        self._connections: dict[str, BrokerProtocolHandler] = {}
        self.bus: ClusterBus | None = None  # in a cluster: takeover across brokers
        self._claims: dict[str, asyncio.Future] = {}

    async def connected(self, client_id: str) -> None:
        """Enforce takeover (MQTT 3.1.1 section 3.1.4) and resume a persistent session's queue.

        A persistent session keeps its ``$ECQ/<clientid>/#`` subscription across disconnects (until
        ``session_expiry``; see ``amqtt_hooks.conformance.keep_persistent_sessions``), so its reconnect resumes delivery
        (MQTT 3.1.1 section 3.1.2.4). A clean session has none. In a cluster, another broker's connection of
        ``client_id`` is closed first (:meth:`ecq.broker.bus.ClusterBus.claim`).
        """
        if self.bus is not None:
            claim = self._claims[client_id] = asyncio.ensure_future(self.bus.claim(client_id))
            await claim
        live = hooks.live_connection(self._context, client_id)
        previous = self._connections.get(client_id)
        if previous is not None and previous is not live and hooks.connection_is_open(previous):
            log.info("ECQ takeover: closing the older connection of %s", client_id)
            await hooks.close_connection(previous)
        if live is not None:
            self._connections[client_id] = live
        if self._holds_queue_subscription(client_id):
            await self._attach(client_id, live)
        elif self._engine.connection_of(client_id) is not live:
            self._engine.detach(client_id)

    async def subscribed(self, client_id: str, topic: str) -> None:
        """Start delivering once the SUBACK for ``$ECQ/<clientid>/#`` went out."""
        if topic == queue_filter(client_id):
            await self._attach(client_id, hooks.live_connection(self._context, client_id))

    async def unsubscribed(self, client_id: str, topic: str) -> None:
        """Start no new delivery once the consumer unsubscribed from its queue; the deliveries in flight are
        completed: their PUBACKs, until the connection closes, count (MQTT 3.1.1 section 3.10.4)."""
        if topic == queue_filter(client_id):
            self._engine.stop_sending(client_id)

    async def disconnected(self, client_id: str, persistent: bool) -> None:
        """Detach a consumer whose connection closed, and forget it if nothing of it must stay in memory
        (QueueEngine.forget_if_idle); a newer connection (takeover) keeps or gets it. In a cluster,
        this broker keeps answering for a ``persistent`` session (CleanSession=0) so that it can hand it over."""
        if self._connections.get(client_id) is not None and not hooks.connection_is_open(self._connections[client_id]):
            del self._connections[client_id]
        if self.bus is not None and not hooks.connection_is_open(hooks.live_connection(self._context, client_id)):
            # the broker where it connects next may find nobody to ask and read the saved acks at once: save them first
            await self._engine.release(client_id)
            if not hooks.connection_is_open(hooks.live_connection(self._context, client_id)):
                self._claims.pop(client_id, None)
                if not persistent:
                    await self.bus.disown(client_id)
        if client_id not in self._engine.consumers or hooks.connection_is_open(self._engine.connection_of(client_id)):
            return
        self._engine.detach(client_id)
        live = hooks.live_connection(self._context, client_id)
        if hooks.connection_is_open(live) and self._holds_queue_subscription(client_id):
            await self._attach(client_id, live)
        else:
            self._engine.forget_if_idle(client_id)  # its ack state is in the store: an offline device costs no Consumer

    async def release(self, client_id: str) -> None:
        """Another broker of the cluster took ``client_id`` over: close its connection here (an MQTT 5 client is
        sent DISCONNECT 0x8E Session taken over first, MQTT 5.0 section 3.14.2.1) and return once its consumer's
        acks are saved."""
        live = hooks.live_connection(self._context, client_id)
        if hooks.connection_is_open(live):
            await self._read_what_was_sent(live)
            hooks.send_disconnect(live, hooks.SESSION_TAKEN_OVER)
            await hooks.close_connection(live)
        await self._engine.release(client_id)

    @staticmethod
    async def _read_what_was_sent(connection: BrokerProtocolHandler) -> None:
        """Let the connection's reader take what the client sent before the takeover (its last PUBACKs), at most
        RELEASE_READ_S: a client that closed here and connected to another node sent them first."""
        deadline = asyncio.get_running_loop().time() + RELEASE_READ_S
        while hooks.received_unread(connection) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0)  # the PUBACKs read resolve their deliveries in this iteration

    def _holds_queue_subscription(self, clientid: str) -> bool:
        holders = self._context.subscriptions.get(queue_filter(clientid), [])
        return any(session.client_id == clientid for session, _qos in holders)

    async def _attach(self, clientid: str, connection: BrokerProtocolHandler | None) -> None:
        if (claim := self._claims.get(clientid)) is not None:  # the takeover from another broker comes first
            await asyncio.shield(claim)
        # checked after the engine loaded the ack state: an UNSUBSCRIBE, disconnect or takeover may have happened
        await self._engine.attach(clientid, connection, lambda: (
            hooks.connection_is_open(connection) and connection is hooks.live_connection(self._context, clientid)
            and self._holds_queue_subscription(clientid)), hooks.receive_maximum(connection),
            hooks.delivery_fits(connection))
