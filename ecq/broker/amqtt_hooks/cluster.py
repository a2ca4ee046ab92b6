"""Ordinary MQTT messages and state across the brokers of a cluster (``backend: jetstream``).

amqtt 0.12.1 broadcasts a PUBLISH only to the subscribers of its own process. In a cluster, each broadcast of
an ordinary topic is also handed to the plugin (:meth:`EcqHooksTarget.forward_to_cluster`), which sends it to
the other brokers; what they send arrives through :func:`broadcast_from_cluster`, which broadcasts locally
and marks the broadcast so that it is not forwarded again (no loop, no duplicate).

amqtt keeps retained messages and sessions in its own process too: retained messages of ordinary topics are
handed to the plugin for the cluster and the cluster's are written into amqtt's table
(:func:`set_retained_from_cluster`); a CONNECT first claims its clientid from the cluster, so a persistent
session held by another broker is moved here before amqtt looks it up (:func:`adopt_sessions_from_the_cluster`,
:func:`hand_over_session`). On one broker the same path restores a session stored before a restart
(``ecq.broker.stored_sessions``), and the offline queues go to that store (:func:`store_offline_queues_in_the_cluster`).
"""

from __future__ import annotations

import contextvars
from typing import Any, NamedTuple

from amqtt.broker import Broker, BrokerContext, RetainedApplicationMessage
from amqtt.mqtt.constants import QOS_1, QOS_2
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.pubrel import PubrelPacket
from amqtt.session import OutgoingApplicationMessage

from ecq.broker.amqtt_hooks import stored_sends
from ecq.broker.amqtt_hooks.connection_cap import connections_of
from ecq.broker.amqtt_hooks.ecq_paths import holds_packet_ids
from ecq.broker.amqtt_hooks.fleet_scale import filters_of, granted_of, note_subscription
from ecq.broker.amqtt_hooks.mqtt5_messages import Subscription, subscriptions_of
from ecq.broker.amqtt_hooks.mqtt5_sessions import expiry_of, will_pending
from ecq.broker.amqtt_hooks.seam import replace, step
from ecq.broker.amqtt_hooks.session_owners import mark_owner_unknown
from ecq.broker.amqtt_hooks.shared_subscriptions import is_shared
from ecq.broker.amqtt_hooks.target import HandedOverSession, find_target
from ecq.queue.topics import is_ecq_topic


class HeldSession(NamedTuple):
    """A persistent session this broker holds, as another broker or the store takes it (:func:`hand_over_session`,
    :func:`persistent_sessions`): the ``session`` (:class:`PersistentSession`), the ``messages`` ``[(topic, QoS,
    payload)]`` its client has not received, oldest first (:func:`_unreceived`), and the ``releases``, packet ids of
    QoS 2 messages it received (PUBREC came) without completing them (no PUBCOMP, :func:`_releases`)."""

    session: PersistentSession
    messages: list[tuple[str, int, bytes]]
    releases: list[int]


class PersistentSession(NamedTuple):
    """What a session store keeps of a persistent session beside its queued messages: ``username``, its owner's (the
    username of the CONNECT that made it; None for none), ``subscriptions`` ``[(filter, granted QoS, MQTT 5
    options or None)]``, ``expiry_s`` its MQTT 5 Session Expiry Interval in seconds (None for a 3.1.1 session: the
    broker's ``session_expiry``) and ``offline`` True once its connection ended."""

    username: str | None
    subscriptions: list[tuple[str, int, Subscription | None]]
    expiry_s: int | None = None
    offline: bool = False


_FROM_CLUSTER: contextvars.ContextVar[bool] = contextvars.ContextVar("ecq_from_cluster", default=False)


def forward_broadcasts_to_the_cluster() -> None:
    """After amqtt's ``Broker._broadcast_message`` (client PUBLISHes, Wills, plugins' broadcasts) of a topic
    not starting with ``$``, hand the message to the plugin for the other brokers, unless it came from one."""

    def forward(_: None, broker: Broker, session: Any, topic: str | None, data: Any, force_qos: int | None) -> None:
        plugin = find_target(broker.plugins_manager)
        if plugin is not None and topic and not topic.startswith("$") and not _FROM_CLUSTER.get():
            plugin.forward_to_cluster(topic, bytes(data or b""), 2 if force_qos is None else force_qos)

    step(Broker, "_broadcast_message", after=forward)


async def broadcast_from_cluster(context: BrokerContext, topic: str, data: bytes, qos: int) -> None:
    """Broadcast a message another broker of the cluster took to this broker's subscribers, at most at ``qos``
    (MQTT 3.1.1 section 3.3.5: min of the PUBLISH's and the subscription's QoS), not forwarded again."""
    token = _FROM_CLUSTER.set(True)
    try:
        await context._broker_instance._broadcast_message(None, topic, data, force_qos=qos)
    finally:
        _FROM_CLUSTER.reset(token)


def replicate_retained_messages() -> None:
    """After amqtt's ``Broker.retain_message`` (a PUBLISH with RETAIN, a Will with Will Retain, a plugin) of a topic
    not starting with ``$``, hand the message to the plugin for the cluster (an empty payload clears it, MQTT 3.1.1
    section 3.3.1.3). amqtt 0.12.1 keeps it only in its own ``_retained_messages``, so a SUBSCRIBE on another broker
    did not get it."""

    def replicate(_: None, broker: Broker, source_session: Any, topic_name: str | None, data: Any,
                  qos: int | None) -> None:
        plugin = find_target(broker.plugins_manager)
        if plugin is not None and topic_name and not topic_name.startswith("$"):
            plugin.retained_changed(topic_name, bytes(data or b""), qos)

    step(Broker, "retain_message", after=replicate)


def set_retained_from_cluster(context: BrokerContext, topic: str, data: bytes | None, qos: int | None) -> None:
    """Make ``topic``'s retained message in amqtt's table the cluster's: ``data``, or none when ``data`` is None."""
    retained = context._broker_instance._retained_messages
    if data is None:
        retained.pop(topic, None)
    else:
        retained[topic] = RetainedApplicationMessage(None, topic, data, qos)


def adopt_sessions_from_the_cluster() -> None:
    """Before amqtt 0.12.1's ``Broker._initialize_client_session`` looks the CONNECT's clientid up in its own
    ``_sessions`` (session present, MQTT 3.1.1 section 3.2.2.2), the plugin claims the clientid from the cluster
    (:meth:`EcqHooksTarget.claim_session`): another broker's connection is closed and a persistent session it
    held, with its owner's username, its subscriptions (an MQTT 5 one's options and identifiers with them) and
    its queued messages, is installed here as an offline session, which amqtt then resumes when its owner
    connects (``session_owners``). A CleanSession=1 CONNECT has the other broker discard it (section 3.1.2.4).
    amqtt alone found only sessions of its own process: a client reconnecting to another broker lost its
    session, and on one broker every restart lost them all (the claim now restores the one the embedded store
    kept)."""

    async def claim_the_session(connected: tuple[BrokerProtocolHandler, Any], cls: type, reader: Any, writer: Any,
                                plugins_manager: Any, loop: Any) -> None:
        _, session = connected
        plugin = find_target(plugins_manager)
        if plugin is not None and session.client_id:
            state = await plugin.claim_session(session.client_id, bool(session.clean_session))
            if state is not None and state.present and not session.clean_session:
                _install_session(plugin.context._broker_instance, session.client_id, state)

    step(BrokerProtocolHandler, "init_from_connect", after=claim_the_session)


def _install_session(broker: Broker, clientid: str, state: HandedOverSession) -> None:
    """An offline persistent session of ``clientid`` in ``broker`` as the cluster's ``state`` describes it, unless it
    holds one already."""
    if clientid in broker._sessions:
        return
    _handler, session = broker.create_offline_session(clientid)
    session.clean_session = False
    session.username = state.username
    if not state.owner_known:
        mark_owner_unknown(session)
    options = subscriptions_of(session)
    for topic_filter, qos, subscription in state.subscriptions:
        holders = broker._subscriptions.setdefault(topic_filter, [])
        holders[:] = [(s, q) for s, q in holders if s.client_id != clientid]
        holders.append((session, qos))
        note_subscription(broker, clientid, topic_filter, qos)
        if subscription is not None:
            options[topic_filter] = subscription
    for topic, qos, data in state.messages:
        session.retained_messages.put_nowait(RetainedApplicationMessage(None, topic, data, qos))
    for packet_id in state.releases:
        session.inflight_out[packet_id] = _release(packet_id)
    broker._sessions[clientid] = (session, None)


def _release(packet_id: int) -> OutgoingApplicationMessage:
    """An outgoing QoS 2 message whose PUBREC came and whose PUBREL is due: amqtt's resend at reconnect
    (``_handle_message_flow``) sends the PUBREL again for it, never the PUBLISH (MQTT 3.1.1 sections 4.3.3, 4.4)."""
    message = OutgoingApplicationMessage(packet_id, "", QOS_2, b"", False)
    message.pubrel_packet = PubrelPacket.build(packet_id)
    return message


def persistent_session(context: BrokerContext, clientid: str) -> PersistentSession | None:
    """``clientid``'s persistent session on this broker as a session store keeps it (its owner's username, its
    subscriptions with their MQTT 5 options, its expiry, whether it is offline); None when it has none."""
    session, _handler = context._broker_instance._sessions.get(clientid, (None, None))
    if session is None or session.clean_session is not False:
        return None
    options, held = subscriptions_of(session), granted_of(context._broker_instance, clientid)
    return PersistentSession(session.username, [(topic_filter, qos, options.get(topic_filter))
                                                for topic_filter, qos in held.items()],
                             expiry_of(session), session.transitions.state != "connected")


def persistent_sessions(context: BrokerContext) -> dict[str, HeldSession]:
    """Every persistent session on this broker by client id, with what its client has not received and the releases
    it owes (:class:`HeldSession`), left in place."""
    return {clientid: _held(context, clientid) for clientid, (session, _handler) in
            context._broker_instance._sessions.items() if session.clean_session is False}


def _held(context: BrokerContext, clientid: str) -> HeldSession:
    session, handler = context._broker_instance._sessions[clientid]
    return HeldSession(persistent_session(context, clientid), _unreceived(session), _releases(session, handler))


async def hand_over_session(context: BrokerContext, clientid: str) -> HeldSession | None:
    """Remove ``clientid``'s persistent session from this broker (its connection closed already) and return it
    (:func:`persistent_session`) with the messages it has not received (:func:`_unreceived`) and the QoS 2 releases
    it owes (:func:`_releases`). None, and nothing removed, when it has none here."""
    broker = context._broker_instance
    if persistent_session(context, clientid) is None:
        if clientid in broker._sessions:
            await broker._cleanup_session(clientid)
        return None
    handed = _held(context, clientid)
    await broker._cleanup_session(clientid)
    return handed


def _unreceived(session: Any) -> list[tuple[str, int, bytes]]:
    """The messages amqtt's ``session`` holds that its client has not received, oldest first, left in place: those
    sent but not acknowledged (MQTT 3.1.1 section 4.4; they go out again as new messages; a QoS 2 one whose PUBREC
    came is received, :func:`_releases`) then those queued while it was offline (QoS 1 and 2 only, ``$ECQ/``
    excluded: ECQ redelivers its queues itself)."""
    messages = [(m.topic, m.qos, bytes(m.data)) for m in session.inflight_out.values()
                if m.qos in (QOS_1, QOS_2) and not is_ecq_topic(m.topic)
                and (m.puback_packet if m.qos == QOS_1 else m.pubrec_packet) is None]
    return messages + [(m.topic, m.qos, bytes(m.data)) for m in session.retained_messages.items()]


def _releases(session: Any, handler: BrokerProtocolHandler | None) -> list[int]:
    """The packet ids of the QoS 2 messages amqtt's ``session`` sent that its client received (PUBREC came) and has
    not completed (no PUBCOMP): the broker owes a PUBREL for each (MQTT 3.1.1 section 4.3.3). amqtt takes such a
    message out of ``inflight_out`` at its PUBREC, so while its connection ``handler`` waits for the PUBCOMP only
    the waiter has its packet id; once the connection closed, ``conformance._keep_for_resend`` put it back."""
    released = [packet_id for packet_id, m in session.inflight_out.items()
                if m.qos == QOS_2 and m.pubrec_packet is not None and m.pubcomp_packet is None]
    waiting = handler._pubcomp_waiters if handler is not None else ()
    return released + [packet_id for packet_id in waiting if packet_id not in released]


def hand_offline_sessions_to_the_store() -> None:
    """amqtt 0.12.1 keeps every offline persistent session in memory, as a ``Session`` with its subscriptions in the
    broker's map, until it expires: about 4.9 KB traced (30-44 KB of RSS) per offline device, where a fleet is
    mostly offline devices (issue 32). So the end of a persistent session's connection (``Broker._handle_disconnect``,
    outermost: its Will and expiry settled) hands the session, with the messages queued for it
    (:func:`_unreceived`), to the session store (:meth:`EcqHooksTarget.session_evicted`; the embedded LevelDB store
    takes it, a cluster's keeps it in amqtt's memory to hand it over) and, once the store took it, amqtt forgets it
    (``_cleanup_session``: its filters through ``fleet_scale``'s index). Its next CONNECT restores it through
    :func:`adopt_sessions_from_the_cluster`, as a session stored before a restart. Kept in memory instead: a
    session taken over or with another CONNECT of its client id under way, an MQTT 5 session whose Will waits for its
    delay, one holding packet ids (``ecq_paths.holds_packet_ids``: a send not acknowledged, ordinary or ECQ, a QoS 2
    PUBLISH of the client not yet released), which its reconnect to this broker gets again with DUP=1 and the same
    packet id (MQTT 3.1.1 section 4.4; docs/guarantees.md), as the store, like a restart, could not, and a member of a
    shared subscription group (``$share/``), which gets the group's messages while no member is connected
    (``shared_subscriptions``; the stored sessions' index queues nothing for a group).
    """

    async def hand_the_session_to_the_store(_: None, broker: Broker, session: Any, handler: BrokerProtocolHandler,
                                            disconnect_waiter: Any) -> None:
        plugin = find_target(broker.plugins_manager)
        if plugin is None or not _evictable(broker, session):
            return
        held = persistent_session(plugin.context, session.client_id)
        if held is not None and plugin.session_evicted(session.client_id, held, _unreceived(session)):
            await broker._cleanup_session(session.client_id)

    step(Broker, "_handle_disconnect", after=hand_the_session_to_the_store)


def _evictable(broker: Broker, session: Any) -> bool:
    """True when amqtt's ``session`` is offline, still its client id's session, and nothing but the store's copy would
    be needed to resume it (see :func:`hand_offline_sessions_to_the_store`)."""
    return (session.transitions.state == "disconnected"
            and broker._sessions.get(session.client_id, (None, None))[0] is session
            and connections_of(broker, session.client_id) <= 1 and not will_pending(session)
            and not holds_packet_ids(session) and not any(map(is_shared, filters_of(broker, session.client_id))))


async def discard_session(context: BrokerContext, clientid: str) -> None:
    """Remove ``clientid``'s session from this broker, if it has one (a CleanSession=1 CONNECT elsewhere)."""
    if clientid in context._broker_instance._sessions:
        await context._broker_instance._cleanup_session(clientid)


def store_offline_queues_in_the_cluster() -> None:
    """amqtt 0.12.1 queues the QoS 1/2 messages of an offline persistent session in its own process only
    (``Broker._retain_broadcast_message``) and sends them on reconnect (``_publish_session_retained_messages``): when
    that broker died or restarted, they were lost with it. MQTT 3.1.1 section 3.1.2.4 keeps them with the session,
    so each one queued is also handed to the plugin for its session store, the cluster's or the embedded one
    (:meth:`EcqHooksTarget.session_message_queued`). When the queue is taken for sending
    (:meth:`EcqHooksTarget.session_queue_taken`) the store keeps it, with the session's sends not yet acknowledged,
    each message until its acknowledgement (``stored_sends``: after a broker killed meanwhile, the client's next
    CONNECT, to its restart or in a cluster to another broker, gets them again). A message queued while that store
    is awaited (a cluster's) goes out with the queue, unstored as a send but kept in the session's stored queue."""
    original_queue = Broker._retain_broadcast_message

    async def retain_broadcast_message(broker: Broker, broadcast: dict[str, Any], qos: int,
                                       target_session: Any) -> None:
        await original_queue(broker, broadcast, qos, target_session)
        plugin = find_target(broker.plugins_manager)
        if plugin is not None and not is_ecq_topic(broadcast["topic"]):
            plugin.session_message_queued(target_session.client_id, broadcast["topic"], qos,
                                          bytes(broadcast["data"] or b""))

    async def keep_the_taken_queue_until_acknowledged(broker: Broker, session: Any) -> None:
        plugin = find_target(broker.plugins_manager)
        if plugin is not None and not session.retained_messages.empty():
            messages = [(m.topic, m.qos, bytes(m.data)) for m in session.retained_messages.items()]
            stored_sends.queue_taken(session, await plugin.session_queue_taken(session.client_id, messages,
                                                                                stored_sends.held_keys(session)))

    replace(Broker, "_retain_broadcast_message", retain_broadcast_message)
    step(Broker, "_publish_session_retained_messages", before=keep_the_taken_queue_until_acknowledged)
