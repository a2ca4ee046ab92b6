"""Where this broker's persistent sessions outlive their connection and the broker itself: the backend's
:class:`~ecq.broker.session_state.SessionStore`, the cluster's (``cluster_state.ClusterState``, JetStream KV and
stream, shared by every broker) or the embedded LevelDB store's (:class:`~ecq.broker.stored_sessions.StoredSessions`,
restored lazily after a restart). The plugin's session calls from ``amqtt_hooks`` (a session stored, claimed at a
CONNECT, discarded, expired, its offline queue) land here, one method each; the cluster's hand-over between brokers is
:mod:`ecq.broker.bus` and amqtt's side of it ``ecq.broker.amqtt_hooks.cluster``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from amqtt.broker import BrokerContext

from ecq.broker import amqtt_hooks as hooks
from ecq.broker.amqtt_hooks import PersistentSession
from ecq.broker.cluster_node import ClusterNode
from ecq.broker.stored_sessions import StoredSessions
from ecq.config import EcqSettings
from ecq.queue.engine import QueueEngine


class SessionKeeper:
    """The persistent sessions of one broker (``context``) in its backend's session store; the store is there from
    :meth:`start` on (the cluster's once ``cluster`` joined)."""

    def __init__(self, settings: EcqSettings, context: BrokerContext, cluster: ClusterNode) -> None:
        self._settings, self._context, self._cluster = settings, context, cluster
        self.stored: StoredSessions | None = None  # backend: leveldb
        self.record_written: Callable[[], None] = lambda: None  # called for each record store_session writes

    def start(self, engine: QueueEngine) -> None:
        """On LevelDB, read the stored sessions' records into their index (StoredSessions.load), their deadlines on the
        broker's one heap of offline sessions' deadlines, each ended by :meth:`expired` when due; in a cluster
        nothing: the cluster's KV is read at each claim."""
        if self._settings.backend != "jetstream":
            self.stored = StoredSessions.load(self._settings, engine.store, hooks.session_deadlines(self._context),
                                              self.expired)

    @property
    def store(self) -> Any:
        """The backend's SessionStore, None before :meth:`start` (and before the cluster joined)."""
        return self._cluster.state if self._cluster.state is not None else self.stored

    def save_at_shutdown(self) -> None:
        """Store every persistent session once more, offline from now on (their expiry runs from the shutdown); the
        cluster's copies are kept by the other brokers' claims, so only LevelDB needs this."""
        if self.stored is not None:
            self.stored.save_at_shutdown(hooks.persistent_sessions(self._context))

    def store_session(self, clientid: str) -> None:
        """Write ``clientid``'s persistent session (owner, subscriptions, expiry) to the store (in a cluster: while
        this broker answers for it), then call :attr:`record_written`; nothing for a clean session, nor on LevelDB
        for a record stored already (StoredSessions.save_session)."""
        bus = self._cluster.bus
        if self.store is None or (bus is not None and not bus.holds(clientid)):
            return
        held = hooks.persistent_session(self._context, clientid)
        if held is not None and self.store.save_session(clientid, held):
            self.record_written()

    async def claim(self, clientid: str, clean: bool) -> Any:
        """At a CONNECT: the persistent session (a SessionState, with its owner) another broker handed over or, when
        none answered and none is here, the one in the cluster's store; on one broker the one stored before a restart
        (StoredSessions.claim); None for a clean session, which is then discarded everywhere (MQTT 3.1.1 section
        3.1.2.4)."""
        bus = self._cluster.bus
        if bus is None:
            return self.stored.claim(clientid, clean) if self.stored is not None else None
        state = await bus.claim(clientid, clean)
        if clean:
            self.store.forget_session(clientid)
            return None
        if state is None and bus.connected and hooks.persistent_session(self._context, clientid) is None:
            state = await bus.link.submit(self.store.load_session(clientid))
        return state

    def discarded(self, clientid: str) -> None:
        """A CONNECT of another username did not resume ``clientid``'s session (``amqtt_hooks.session_owners``): the
        store forgets it, so that no broker resumes it later."""
        if self.store is not None:
            self.store.forget_session(clientid)

    async def expired(self, clientid: str) -> None:
        """A persistent session ended by its MQTT 5 Session Expiry Interval (MQTT 5.0 section 3.1.2.11.2): its stored
        subscriptions and queue are deleted and, in a cluster, this broker stops answering for ``clientid``, so that
        no broker resumes it, also after this one died."""
        if self.store is not None:
            self.store.forget_session(clientid)
        if self._cluster.bus is not None:
            await self._cluster.bus.disown(clientid)

    def evicted(self, clientid: str, session: PersistentSession, messages: list[tuple[str, int, bytes]]) -> bool:
        """On LevelDB, keep ``clientid``'s offline ``session`` and the ``messages`` it has not received in the store
        only (StoredSessions.evict); False when it could not, and always in a cluster, which keeps offline sessions in
        amqtt's memory to hand them over to another broker."""
        return self.stored is not None and self.stored.evict(clientid, session, messages)

    def stored_only(self) -> int:
        """How many offline persistent sessions the store holds and memory does not (LevelDB; 0 on a cluster)."""
        return len(self.stored) if self.stored is not None else 0

    def message_queued(self, clientid: str, topic: str, qos: int, data: bytes) -> None:
        """Store a message queued for an offline persistent session."""
        if self.store is not None:
            self.store.queue_message(clientid, topic, qos, data)

    def queue_for_stored(self, topic: str, data: bytes, qos: int) -> list[tuple[str, str]]:
        """Queue a message for the stored sessions no CONNECT claimed (LevelDB only): ``[(clientid, topic)]`` of
        the messages that dropped from full queues."""
        return self.stored.queue_for_stored(topic, data, qos) if self.stored is not None else []

    async def queue_taken(self, clientid: str, messages: list[tuple[str, int, bytes]],
                          kept: frozenset[Any]) -> list[Any]:
        """A persistent session's queued ``messages`` are being sent: its stored queue becomes the sends of ``kept``
        keys and these, whose keys are returned, to :meth:`settled` each at its acknowledgement (on LevelDB
        StoredSessions.take_queue, in a cluster ClusterState.take_queue; Nones for messages not stored)."""
        if self.stored is not None:
            return self.stored.take_queue(clientid, messages, kept)
        if self._cluster.state is not None:
            return await self._cluster.state.take_queue(clientid, messages, kept)
        return [None] * len(messages)

    async def sent(self, sends: list[tuple[str, str, int, bytes]]) -> list[Any]:
        """``(clientid, topic, QoS, payload)`` messages about to be sent to connected persistent sessions, stored
        before the publisher's PUBACK (StoredSessions.store_sends, or in a cluster ClusterState.store_sends on the
        link's loop, awaited): their keys (None: not stored)."""
        if self.stored is not None:
            return self.stored.store_sends(sends)
        if self._cluster.state is not None and self._cluster.bus is not None:
            return await self._cluster.bus.link.submit(self._cluster.state.store_sends(sends))
        return [None] * len(sends)

    def settled(self, keys: list[Any]) -> None:
        """Delete the stored copies of messages sent (keys from :meth:`sent` or :meth:`queue_taken`)."""
        if self.store is not None:
            self.store.settle_sends(keys)
