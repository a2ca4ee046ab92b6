"""Which MQTT connection gets a queue: session takeover (MQTT 3.1.1 section 3.1.4), persistent sessions
resuming their queue, and the attach/detach calls to the queue engine that follow from amqtt's
connect, subscribe, unsubscribe and disconnect events: for a client's own ``$ECQ/<clientid>/#`` and for each
``$SCQ/<queue>/#`` it reads (its position in that SCQ, ecq.queue.topics.position_id), and its membership of each
shared group ``$share/<group>/$SCQ/<queue>/#`` it holds (the group's position, ecq.queue.groups; in a cluster served
here only while this broker holds the group's lease, ecq.broker.group_leases)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from amqtt.broker import BrokerContext
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

from ecq.broker import amqtt_hooks as hooks
from ecq.queue.engine import QueueEngine
from ecq.queue.groups import GroupDispatch, group_filter, group_position_id, parse_group_filter
from ecq.queue.topics import parse_scq_filter, position_id, queue_filter, queue_of_position

if TYPE_CHECKING:
    from ecq.broker.bus import ClusterBus
    from ecq.broker.group_leases import GroupLeases

log = logging.getLogger(__name__)

RELEASE_READ_S = 0.5  # a takeover from another node: at most this long to read what the client sent before


class QueueSessions:
    """Tracks the live connection of each clientid of ``context`` and attaches it to ``engine`` while it
    holds its ``$ECQ/<clientid>/#`` subscription."""

    def __init__(self, context: BrokerContext, engine: QueueEngine) -> None:
        self._context, self._engine = context, engine
        self._connections: dict[str, BrokerProtocolHandler] = {}
        self.bus: ClusterBus | None = None  # in a cluster: takeover across brokers
        self.leases: GroupLeases | None = None  # in a cluster: which broker serves each shared group
        self._claims: dict[str, asyncio.Future] = {}
        self._reading: dict[str, dict[str, str]] = {}  # clientid -> {position id: SCQ queue id} attached for it
        self._groups: dict[str, GroupDispatch] = {}  # a shared group's position id -> its connected members
        self._memberships: dict[str, set[str]] = {}  # clientid -> the position ids of the groups it is a member of
        self._forgetting: dict[str, asyncio.Task] = {}  # a group's position id -> forgetting it once it settles

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
        await self._attach_readers(client_id, live)

    async def subscribed(self, client_id: str, topic: str) -> None:
        """Start delivering once the SUBACK for ``$ECQ/<clientid>/#`` or an ``$SCQ/<queue>/#`` went out."""
        if topic == queue_filter(client_id):
            await self._attach(client_id, hooks.live_connection(self._context, client_id))
        elif (queue := parse_scq_filter(topic)) is not None:
            await self._attach_reader(client_id, queue, hooks.live_connection(self._context, client_id))
        elif (group := parse_group_filter(topic)) is not None:
            await self._join_group(client_id, *group, hooks.live_connection(self._context, client_id))

    async def unsubscribed(self, client_id: str, topic: str) -> None:
        """Start no new delivery once the consumer unsubscribed from its queue (or a reader from an SCQ); the
        deliveries in flight are completed: their PUBACKs, until the connection closes, count (MQTT 3.1.1 section
        3.10.4)."""
        if topic == queue_filter(client_id):
            self._engine.stop_sending(client_id)
        elif (queue := parse_scq_filter(topic)) is not None:
            self._engine.stop_sending(position_id(queue, client_id))
        elif (group := parse_group_filter(topic)) is not None:
            position = group_position_id(group[1], group[0])
            self._memberships.get(client_id, set()).discard(position)
            if (dispatch := self._groups.get(position)) is not None:
                dispatch.leave(client_id)
                if not dispatch.members:
                    self._engine.stop_sending(position)
                    self._forget_when_settled(position)

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
        await self._detach_readers(client_id)
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
        for position in self._reading.get(client_id, ()):
            await self._engine.release(position)

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

    async def _attach_readers(self, clientid: str, connection: BrokerProtocolHandler | None) -> None:
        """Attach ``connection`` as the reader of every SCQ whose ``$SCQ/<queue>/#`` the client holds (a resumed
        persistent session holds them without subscribing again)."""
        for topic_filter in hooks.filters_held(self._context, clientid):
            if (queue := parse_scq_filter(topic_filter)) is not None:
                await self._attach_reader(clientid, queue, connection)
            elif (group := parse_group_filter(topic_filter)) is not None:
                await self._join_group(clientid, *group, connection)

    async def _attach_reader(self, clientid: str, queue: str, connection: BrokerProtocolHandler | None) -> None:
        if (claim := self._claims.get(clientid)) is not None:
            await asyncio.shield(claim)
        position = position_id(queue, clientid)
        self._reading.setdefault(clientid, {})[position] = queue
        await self._engine.attach(position, connection, lambda: (
            hooks.connection_is_open(connection) and connection is hooks.live_connection(self._context, clientid)
            and f"{queue}/#" in hooks.filters_held(self._context, clientid)), hooks.receive_maximum(connection),
            hooks.delivery_fits(connection), queue=queue)

    async def _join_group(self, clientid: str, group: str, queue: str,
                          connection: BrokerProtocolHandler | None) -> None:
        """Make ``connection`` a member of the shared group ``group`` of the SCQ ``queue``; the group's consumer is
        attached to its members (ecq.queue.groups.GroupDispatch), a window each and each's Maximum Packet Size and
        Subscription Identifier, or sends again when the last member had unsubscribed."""
        if (claim := self._claims.get(clientid)) is not None:
            await asyncio.shield(claim)
        if not hooks.connection_is_open(connection) or connection is not hooks.live_connection(self._context, clientid):
            return
        position, topic_filter = group_position_id(queue, group), group_filter(queue, group)
        settings = self._engine.settings
        dispatch = self._groups.setdefault(position, GroupDispatch(settings.scq_dispatch, settings.reader_batch_size,
                                                                   topic_filter))
        dispatch.join(clientid, connection, hooks.receive_maximum(connection),
                      hooks.delivery_fits(connection, topic_filter))
        self._memberships.setdefault(clientid, set()).add(position)
        if self.leases is not None and not self.leases.holds(position):
            self.leases.members_changed(position)  # a standby until this broker holds the lease
            return
        await self.serve_group(position)

    async def serve_group(self, position: str) -> None:
        """Attach the consumer of the shared group whose position id is ``position`` to its members here, if any
        (in a cluster: this broker holds the group's lease)."""
        if (dispatch := self._groups.get(position)) is None or not dispatch.members:
            return
        await self._engine.attach(position, dispatch, lambda: (
            bool(dispatch.members) and self._groups.get(position) is dispatch
            and (self.leases is None or self.leases.holds(position))), queue=queue_of_position(position))

    async def stop_group(self, position: str) -> None:
        """Stop serving the shared group ``position`` here (its lease is lost or handed back): its members here get
        nothing more, and this returns once the acks they sent are saved."""
        await self._engine.release(position)
        self._engine.forget_if_idle(position)

    def wants_group(self, position: str) -> bool:
        """True while the shared group ``position`` has a member here, or deliveries in flight to one that left."""
        dispatch = self._groups.get(position)
        return dispatch is not None and (bool(dispatch.members) or self._engine.connection_of(position) is dispatch)

    def _leave_groups(self, clientid: str) -> None:
        """The connection of ``clientid`` closed: it leaves its groups (a newer connection stays or joins again);
        a group left with no member detaches, keeps its position and is forgotten once settled."""
        for position in list(self._memberships.get(clientid, ())):
            if (dispatch := self._groups.get(position)) is None:
                continue
            if hooks.connection_is_open((member := dispatch.members.get(clientid)) and member.connection):
                continue
            dispatch.leave(clientid)
            if not dispatch.members:
                self._engine.detach(position)
                self._forget_when_settled(position)
        if (live := hooks.live_connection(self._context, clientid)) is None or not hooks.connection_is_open(live):
            self._memberships.pop(clientid, None)

    def _forget_when_settled(self, position: str) -> None:
        """The shared group ``position`` has no member left here: forget it once its deliveries in flight ended and
        the acks its members sent are saved, unless a member joins first. Its position is stored: a member joining
        later starts from it, as one joining a group kept in memory would."""
        if position not in self._forgetting:
            self._forgetting[position] = asyncio.ensure_future(self._forget_group(position, self._groups[position]))

    async def _forget_group(self, position: str, dispatch: GroupDispatch) -> None:
        """Drop ``dispatch``, the group's consumer (QueueEngine.forget_if_idle) and, in a cluster, hand its lease back
        (ecq.broker.group_leases), once settled: a fleet whose groups come and go keeps none of those that went."""
        try:
            while await dispatch.settled():
                await self._engine.release(position)
                if dispatch.members or dispatch.sending:  # a member joined meanwhile (and may have left again)
                    continue
                del self._groups[position]
                self._engine.forget_if_idle(position)
                if self.leases is not None:
                    self.leases.members_changed(position)  # no member here: the lease is handed back
                return
        finally:
            del self._forgetting[position]

    async def _detach_readers(self, clientid: str) -> None:
        """The connection of ``clientid`` closed: detach its SCQ readers (a newer connection keeps them or gets them
        again) and forget those with nothing left to keep in memory."""
        self._leave_groups(clientid)
        detached = False
        for position in list(self._reading.get(clientid, ())):
            if hooks.connection_is_open(self._engine.connection_of(position)):
                continue
            detached = True
            self._engine.detach(position)
            self._engine.forget_if_idle(position)
            if position not in self._engine.consumers:
                self._reading[clientid].pop(position, None)
        if not self._reading.get(clientid, True):
            del self._reading[clientid]
        live = hooks.live_connection(self._context, clientid)
        if detached and hooks.connection_is_open(live):  # a takeover whose new connection attached nothing yet
            await self._attach_readers(clientid, live)

    async def _attach(self, clientid: str, connection: BrokerProtocolHandler | None) -> None:
        if (claim := self._claims.get(clientid)) is not None:  # the takeover from another broker comes first
            await asyncio.shield(claim)
        # checked after the engine loaded the ack state: an UNSUBSCRIBE, disconnect or takeover may have happened
        await self._engine.attach(clientid, connection, lambda: (
            hooks.connection_is_open(connection) and connection is hooks.live_connection(self._context, clientid)
            and self._holds_queue_subscription(clientid)), hooks.receive_maximum(connection),
            hooks.delivery_fits(connection))
