"""MQTT 3.1.1 for ordinary topics: where amqtt 0.12.1 departs from the specification, corrected.

Persistent sessions are kept, what a client sent before it disconnected is routed, retained messages go only to
new subscriptions, a fan-out sends one copy
per client at the right QoS, unacknowledged messages are resent on reconnect and a silent client is closed
after 1.5 x its keepalive, with per-session bounds (``session_max_queued``, ``session_max_inflight``).
Each function below corrects one amqtt behaviour on a broker that runs the ECQ plugin and is installed
by one line in ``install``; a broker without the plugin keeps stock amqtt. ``$ECQ/`` topics are ECQ's own
and never reach these paths except where said.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from typing import Any

from amqtt.broker import Broker, BrokerContext
from amqtt.contexts import Action
from amqtt.events import BrokerEvents
from amqtt.mqtt.constants import QOS_0, QOS_1
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.puback import PubackPacket
from amqtt.session import OUTGOING

from ecq.broker.amqtt_hooks import flow, stored_sends
from ecq.broker.amqtt_hooks.ecq_paths import SUBACK_FAILURE, client_id, close_connection, no_op
from ecq.broker.amqtt_hooks.fleet_scale import retained_matching
from ecq.broker.amqtt_hooks.mqtt5_routing import sends_retained
from ecq.broker.amqtt_hooks.seam import Result, replace, step
from ecq.broker.amqtt_hooks.shared_subscriptions import receivers
from ecq.broker.amqtt_hooks.target import EcqHooksTarget, find_target
from ecq.queue.topics import is_ecq_topic

log = logging.getLogger(__name__)

_PUBLISH_QOS: contextvars.ContextVar[int | None] = contextvars.ContextVar("ecq_publish_qos", default=None)
_closing: set[asyncio.Task] = set()  # keepalive closes in progress (a reference keeps each task alive)
# id of a reconnected persistent session whose offline queue is not yet sent (amqtt's Session is unhashable) ->
# the handler of that connection
_resuming: dict[int, BrokerProtocolHandler] = {}


def keep_persistent_sessions() -> None:
    """amqtt 0.12.1's AnonymousAuthPlugin marks every session ``is_anonymous``, and ``Broker._session_monitor``
    deletes such a session about 1 s after it disconnects, while ``_run_broadcast`` queues no message for it:
    a CleanSession=0 client lost its subscriptions and offline messages and got CONNACK session-present 0.
    MQTT 3.1.1 section 3.1.2.4 keeps the session whatever the authentication, so a persistent session is
    not marked anonymous (amqtt uses the mark only for those two decisions and its contrib persistence).
    How long it is kept is ``session_expiry`` (:func:`set_session_expiry`)."""

    def keep_it_when_persistent(authenticated: bool, broker: Broker, session: Any, listener: Any) -> None:
        if find_target(broker.plugins_manager) is not None and session.clean_session is False:
            session.is_anonymous = False

    step(Broker, "_authenticate", after=keep_it_when_persistent)


def release_handlers_of_offline_sessions() -> None:
    """amqtt 0.12.1 keeps ``(session, handler)`` in ``Broker._sessions`` after a persistent session's connection
    ends, so every offline session held its dead connection's protocol handler until the session expired: its
    queues, events and lock, the stream reader and writer, the transport and socket objects, the reader task and
    the keepalive timer. 1,000 offline persistent sessions held 48 MB of the broker's heap (about 48 KB each;
    a broker with 100,000 offline consumers would need gigabytes). amqtt reads an offline session's handler
    nowhere (each use is guarded by ``if handler`` or comes after a connected check), so once the connection's
    handling ends the entry keeps only the session: subscriptions and queued messages stay with it (MQTT 3.1.1
    section 3.1.2.4), and its next connection brings a new handler. An entry a takeover already gave to a new
    connection is left alone."""

    def release_the_handler(broker: Broker, reader: Any, writer: Any, session: Any, handler: BrokerProtocolHandler,
                            *args: Any) -> None:
        entry = broker._sessions.get(session.client_id)
        if (find_target(broker.plugins_manager) is not None and entry is not None and entry[1] is handler
                and session.transitions.state == "disconnected"):
            broker._sessions[session.client_id] = (session, None)

    step(Broker, "_handle_client_session", always=release_the_handler)


def set_session_expiry(context: BrokerContext, seconds: float) -> None:
    """Forget a disconnected persistent session after ``seconds`` (amqtt's ``session_expiry_interval``,
    checked by its session monitor every second; EMQX calls it session expiry, default 2 h there). An MQTT 5
    session ends after its own Session Expiry Interval, capped at ``seconds`` (``mqtt5_sessions``)."""
    config = context._broker_instance.config
    if config.session_expiry_interval is not None and config.session_expiry_interval != math.ceil(seconds):
        log.warning(
            "amqtt's session_expiry_interval %s is replaced by ECQ's session_expiry %s s",
            config.session_expiry_interval, math.ceil(seconds))
    config.session_expiry_interval = math.ceil(seconds)


def retained_only_for_new_subscriptions() -> None:
    """amqtt 0.12.1's ``Broker._handle_client_session`` sends a connecting client every retained message that
    matches *any* client's subscription filter, at QoS 0; and ``_publish_retained_messages_for_subscription``
    sends a QoS 0 retained message at the subscription's QoS. MQTT 3.1.1 section 3.3.1.3: a retained message
    goes to a new subscription that matches it, RETAIN=1, at min(granted QoS, message QoS); a reconnect is
    no new subscription. So the SUBSCRIBE handling is taken over, and the connect-time loop is gone
    (``fleet_scale.connect_without_walking_every_filter``)."""
    original_handle = Broker._handle_subscription

    async def handle_subscription(broker: Broker, session: Any, handler: BrokerProtocolHandler,
                                  waiter: asyncio.Future) -> None:
        if find_target(broker.plugins_manager) is None:
            return await original_handle(broker, session, handler, waiter)
        return await _handle_subscribe(broker, session, handler, waiter.result())

    replace(Broker, "_handle_subscription", handle_subscription)


async def _handle_subscribe(broker: Broker, session: Any, handler: BrokerProtocolHandler, subscribe: Any) -> None:
    """amqtt's SUBSCRIBE handling (grant each filter, SUBACK, CLIENT_SUBSCRIBED) with conformant retained sends; a
    persistent session is stored before its SUBACK (:func:`_store`), so a broker killed after it still has the
    subscription."""
    granted = [await broker.add_subscription(subscription, session) for subscription in subscribe.topics]
    _store(handler)
    await handler.mqtt_acknowledge_subscription(subscribe.packet_id, granted)
    for (topic_filter, requested_qos), qos in zip(subscribe.topics, granted, strict=True):
        if qos == SUBACK_FAILURE:
            continue
        await broker.plugins_manager.fire_event(BrokerEvents.CLIENT_SUBSCRIBED, client_id=session.client_id,
                                                topic=topic_filter, qos=requested_qos)
        if not sends_retained(handler, topic_filter):
            continue
        sends = [handler.mqtt_publish(message.topic, message.data, qos if message.qos is None else min(qos, message.qos),
                                      retain=True)
                 for message in retained_matching(broker, topic_filter)]
        await asyncio.gather(*sends, return_exceptions=True)


def store_persistent_sessions_before_their_acknowledgements() -> None:
    """amqtt 0.12.1 keeps sessions in its process only. ECQ stores a persistent session (``store_session``: the
    plugin's session store) before its SUBACK (:func:`_handle_subscribe`) and, here, before its CONNACK
    (``BrokerProtocolHandler.mqtt_connack_authorize``, an accepted CONNECT) and its UNSUBACK
    (``mqtt_acknowledge_unsubscription``, after amqtt deleted the filters): a broker killed just after an
    acknowledgement has the session as the client was told it is (MQTT 3.1.1 sections 3.1.2.4, 3.2.2.2, 3.10.4)."""
    original_connack = BrokerProtocolHandler.mqtt_connack_authorize
    original_unsuback = BrokerProtocolHandler.mqtt_acknowledge_unsubscription

    async def mqtt_connack_authorize(handler: BrokerProtocolHandler, authorize: bool) -> None:
        if authorize:
            _store(handler)
        await original_connack(handler, authorize)

    async def mqtt_acknowledge_unsubscription(handler: BrokerProtocolHandler, packet_id: int) -> None:
        _store(handler)
        await original_unsuback(handler, packet_id)

    replace(BrokerProtocolHandler, "mqtt_connack_authorize", mqtt_connack_authorize)
    replace(BrokerProtocolHandler, "mqtt_acknowledge_unsubscription", mqtt_acknowledge_unsubscription)


def _store(handler: BrokerProtocolHandler) -> None:
    """Have the plugin store the persistent session of ``handler``'s connection (:meth:`EcqHooksTarget.store_session`)
    before an acknowledgement tells the client it is so: the one way the SUBACK, CONNACK and UNSUBACK paths store it;
    nothing for a clean session or a broker without the plugin."""
    plugin = find_target(handler.plugins_manager)
    if plugin is not None and handler.session is not None and handler.session.clean_session is False:
        plugin.store_session(handler.session.client_id)


def offline_messages_not_retained() -> None:
    """amqtt 0.12.1's ``Broker._publish_session_retained_messages`` sends the messages queued for a
    disconnected session with RETAIN=1. They were not published retained, and MQTT 3.1.1 section 3.3.1.3
    sets RETAIN only on a retained message sent for a new subscription: they go out with RETAIN=0. Each keeps its
    copy in the session store until acknowledged (``stored_sends``: the keys its take returned)."""
    original = Broker._publish_session_retained_messages

    async def publish_queued(broker: Broker, session: Any) -> None:  # the body of the method's one wrapper
        if find_target(broker.plugins_manager) is None:
            return await original(broker, session)
        handler = broker._get_handler(session)
        sends = []
        while handler is not None and not session.retained_messages.empty():
            message = session.retained_messages.get_nowait()
            send = handler.mqtt_publish(message.topic, message.data, message.qos, retain=False)
            key = stored_sends.next_taken(session)
            sends.append(send if key is None else stored_sends.send_stored(handler, key, send))
        await asyncio.gather(*sends, return_exceptions=True)

    step(Broker, "_publish_session_retained_messages", body=publish_queued)


def offline_queue_first_on_reconnect() -> None:
    """amqtt 0.12.1's ``Broker._handle_client_session`` marks a reconnecting persistent session connected before it
    resends the unacknowledged messages (``_retry_deliveries``, which waits for their acknowledgements) and only
    then sends the messages queued while the session was offline (``_publish_session_retained_messages``). A
    message published in between went out at once: ahead of the older queued ones (MQTT 3.1.1 section 4.6,
    ordered topics) and outside ``session_max_queued``. So from the CONNECT of a CleanSession=0 client until its
    queue is taken for sending, its QoS 1 and 2 messages join that queue (see :func:`_fan_out`), within the bound;
    later ones are sent after the queue's."""

    def mark_resuming(broker: Broker, reader: Any, writer: Any, session: Any, handler: BrokerProtocolHandler,
                      *args: Any) -> None:
        if find_target(broker.plugins_manager) is not None and session.clean_session is False:
            _resuming[id(session)] = handler

    def unmark_resuming(broker: Broker, reader: Any, writer: Any, session: Any, handler: BrokerProtocolHandler,
                        *args: Any) -> None:
        if _resuming.get(id(session)) is handler:  # not a newer connection's (a takeover) mark
            del _resuming[id(session)]

    def unmark_as_the_queue_is_taken(broker: Broker, session: Any) -> None:
        _resuming.pop(id(session), None)  # the queue is taken before the call first yields: nothing comes between

    step(Broker, "_handle_client_session", before=mark_resuming, always=unmark_resuming)
    step(Broker, "_publish_session_retained_messages", before=unmark_as_the_queue_is_taken)


def route_what_was_read_before_the_disconnect() -> None:
    """amqtt 0.12.1's ``Broker._client_message_loop`` ends at the client's disconnect, and with it go the messages it
    had read and already PUBACKed (its reader acknowledges a QoS 1 PUBLISH once the message is queued in
    ``session.delivered_message_queue``, which the loop routes one at a time) and the SUBSCRIBEs and UNSUBSCRIBEs
    still in the handler's pending queues: 100 pipelined QoS 1 PUBLISHes, each PUBACKed, then DISCONNECT reached
    a subscriber 35 times; a persistent session's SUBSCRIBE sent with its DISCONNECT was never recorded.
    MQTT 3.1.1 sections 4.3.2 and 3.14.4: a PUBACKed message is the server's to deliver, and what was read
    before DISCONNECT is processed. So ``Broker._handle_disconnect`` first handles what is queued, as the loop
    would have: subscriptions, unsubscriptions, then messages in arrival order (a Will, if due, comes after)."""

    async def handle_what_was_read(broker: Broker, session: Any, handler: BrokerProtocolHandler,
                                   disconnect_waiter: asyncio.Future) -> None:
        if find_target(broker.plugins_manager) is not None:
            for queue, handle in ((handler._pending_subscriptions, broker._handle_subscription),
                                  (handler._pending_unsubscriptions, broker._handle_unsubscription),
                                  (session.delivered_message_queue, broker._handle_message_delivery)):
                while not queue.empty():
                    await handle(session, handler, _resolved(queue.get_nowait()))

    step(Broker, "_handle_disconnect", before=handle_what_was_read)


def end_clean_sessions_with_their_connection() -> None:
    """amqtt 0.12.1 removes a clean session (CleanSession=1) only in its session monitor, once a second: a
    CleanSession=0 CONNECT of the same clientid within that second was given the clean session (session present
    1, its subscriptions, which then persisted). MQTT 3.1.1 section 3.1.2.4: a clean session lasts as long as
    its network connection. So ``Broker._handle_disconnect`` ends it at once."""

    async def end_a_clean_session(_: None, broker: Broker, session: Any, handler: BrokerProtocolHandler,
                                  disconnect_waiter: asyncio.Future) -> None:
        stored, _ = broker._sessions.get(session.client_id, (None, None))
        if (find_target(broker.plugins_manager) is not None and session.clean_session and stored is session
                and session.transitions.state == "disconnected"):
            await broker._cleanup_session(session.client_id)

    step(Broker, "_handle_disconnect", after=end_a_clean_session)


def _resolved(value: Any) -> asyncio.Future:
    """A future already holding ``value``: what amqtt's handlers take from the message loop's waiters."""
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


def conformant_fan_out() -> None:
    """amqtt 0.12.1's ``Broker._run_broadcast`` sends a message once per matching filter of a client (twice
    to a client subscribed to ``a/#`` and ``a/+``), at the subscription's QoS whatever the PUBLISH's QoS, and
    keeps nothing for an anonymous session. MQTT 3.1.1 sections 3.3.5 and 3.8.4: one delivery per client at
    min(PUBLISH QoS, highest granted QoS of its matching subscriptions); a disconnected CleanSession=0 session
    gets its QoS 1 and 2 messages queued (section 3.1.2.4), within ``session_max_queued``, and so does a
    reconnecting one until that queue is sent (:func:`offline_queue_first_on_reconnect`). A connected client's
    sends are ECQ's tasks, within its outgoing bounds (``flow.send_or_drop``), not amqtt's broadcast tasks. The QoS 1
    and 2 messages of a connected persistent session are stored first, in one write batch per fan-out, until their
    acknowledgement (``stored_sends``), as the queued ones of an offline session are.

    amqtt does not put the PUBLISH's QoS in its broadcast, so ``_handle_message_delivery`` records it for
    ``_broadcast_message`` (same task) in a context variable. A broadcast with a QoS (the Will, a plugin's)
    is capped at that QoS; without one at QoS 2, i.e. by the subscription only.
    """
    original_run = Broker._run_broadcast

    def note_the_publish(broker: Broker, session: Any, handler: Any, waiter: asyncio.Future) -> None:
        message = waiter.result()
        _PUBLISH_QOS.set(message.qos if message is not None else None)
        flow.delivering(flow.routing_of(message))

    def forget_the_publish(broker: Broker, session: Any, handler: Any, waiter: asyncio.Future) -> None:
        flow.delivered()
        _PUBLISH_QOS.set(None)

    def cap_at_the_publish_qos(broker: Broker, session: Any, topic: str | None, data: Any,
                               force_qos: int | None) -> tuple[Any, ...] | None:
        if force_qos is None and find_target(broker.plugins_manager) is not None:
            return broker, session, topic, data, _PUBLISH_QOS.get()
        return None

    async def run_broadcast(broker: Broker, running_tasks: Any) -> None:
        plugin = find_target(broker.plugins_manager)
        if plugin is None:
            return await original_run(broker, running_tasks)
        broadcast = await broker._broadcast_queue.get()
        try:
            await _fan_out(broker, plugin, broadcast)
        finally:
            flow.fanned_out(broadcast)

    step(Broker, "_handle_message_delivery", before=note_the_publish, always=forget_the_publish)
    step(Broker, "_broadcast_message", before=cap_at_the_publish_qos)
    replace(Broker, "_run_broadcast", run_broadcast)


def _subscribers(broker: Broker, topic: str) -> dict[str, tuple[Any, int]]:
    """client id -> (session, highest granted QoS among its subscriptions taking ``topic``, shared ones included)."""
    found: dict[str, tuple[Any, int]] = {}
    for session, qos in receivers(broker, topic):
        if session.client_id not in found or qos > found[session.client_id][1]:
            found[session.client_id] = (session, qos)
    return found


async def _fan_out(broker: Broker, plugin: EcqHooksTarget, broadcast: dict[str, Any]) -> None:
    topic, publish_qos = broadcast["topic"], broadcast.get("qos", 2)
    if publish_qos is None:
        publish_qos = 2
    subscribers = _subscribers(broker, topic)
    for clientid, dropped in plugin.queue_for_stored_sessions(topic, broadcast["data"], publish_qos):
        plugin.session_message_dropped(clientid, dropped, "queue_full")  # the sessions amqtt does not hold
    persistent: list[tuple[Any, Any, int]] = []  # (handler, session, QoS): sends to store before they start
    for session, granted in subscribers.values():
        qos = min(publish_qos, granted)
        if not await broker._topic_filtering(session, topic=topic, action=Action.RECEIVE):
            continue
        if session.transitions.state != "connected" or (qos > QOS_0 and id(session) in _resuming):
            if not session.clean_session and qos > QOS_0:
                await _queue_for_offline(broker, plugin, broadcast, qos, session)
            continue
        if (handler := broker._get_handler(session)) is None:
            continue
        if qos > QOS_0 and session.clean_session is False and not is_ecq_topic(topic):
            persistent.append((handler, session, qos))
        else:
            flow.send_or_drop(handler, plugin, topic, broadcast["data"], qos)
    if persistent:
        keys = await plugin.session_sends.sent([(session.client_id, topic, qos, broadcast["data"])
                                                for _handler, session, qos in persistent])
        for (handler, session, qos), key in zip(persistent, keys, strict=True):
            if _still_connected(broker, handler, session):
                flow.send_or_drop(handler, plugin, topic, broadcast["data"], qos, key)
                continue
            if key is not None:  # its connection ended or was replaced while the store was awaited: queued instead
                plugin.session_sends.settled([key])
            await _queue_for_offline(broker, plugin, broadcast, qos, session)


def _still_connected(broker: Broker, handler: BrokerProtocolHandler, session: Any) -> bool:
    """True while ``handler`` is still the connection of ``session``, connected and not resuming its queue."""
    return (handler is broker._get_handler(session) and session.transitions.state == "connected"
            and id(session) not in _resuming)


async def _queue_for_offline(broker: Broker, plugin: EcqHooksTarget, broadcast: dict[str, Any], qos: int,
                             session: Any) -> None:
    """Queue ``broadcast`` at ``qos`` for ``session``, a persistent session not connected (or resuming), within
    ``session_max_queued`` (amqtt's ``_retain_broadcast_message``)."""
    _make_room(session.retained_messages, plugin, session.client_id)
    await broker._retain_broadcast_message(broadcast, qos, session)


def _make_room(queue: asyncio.Queue, plugin: EcqHooksTarget, clientid: str) -> None:
    """Drop the oldest messages of a disconnected session's queue until one more fits ``session_max_queued``."""
    while queue.qsize() >= plugin.settings.session_max_queued:
        dropped = queue.get_nowait()
        plugin.session_message_dropped(clientid, dropped.topic, "queue_full")


def resend_unacked_on_reconnect() -> None:
    """amqtt 0.12.1 takes an outgoing QoS 1/2 message out of ``session.inflight_out`` when its flow ends
    without the acknowledgement (the connection closed, or 5 s passed), so ``_retry_deliveries`` never
    resends it (amqtt issue #401). MQTT 3.1.1 section 4.4: on reconnect with CleanSession=0 the server
    resends unacknowledged PUBLISHes (DUP=1, same packet id) and PUBRELs. So such a message is put back
    for a persistent session, at most ``session_max_inflight`` per session (the oldest is dropped).
    ``$ECQ/`` deliveries are excluded: ECQ redelivers its queues itself (``ecq_paths.publish_qos1``).
    A PUBACK that comes after amqtt's 5 s gave up now settles the kept message. A message's copy in the session
    store is noted under its packet id as its flow starts, and deleted when it is dropped here (``stored_sends``)."""
    original_flow = BrokerProtocolHandler._handle_message_flow
    original_retry = BrokerProtocolHandler._retry_deliveries

    async def handle_message_flow(handler: BrokerProtocolHandler, message: Any) -> None:
        stored_sends.note(handler, message)
        try:
            await original_flow(handler, message)
        except (asyncio.CancelledError, Exception):
            _keep_for_resend(handler, message)
            raise

    async def retry_deliveries(handler: BrokerProtocolHandler) -> None:
        if find_target(handler.plugins_manager) is None:
            return await original_retry(handler)
        session = handler.session
        messages = [*session.inflight_in.values(),
                    *(m for m in session.inflight_out.values() if not is_ecq_topic(m.topic))]
        await asyncio.gather(*(asyncio.wait_for(handler._handle_message_flow(m), _RESEND_TIMEOUT_S) for m in messages),
                             return_exceptions=True)

    def settle_a_late_puback(handler: BrokerProtocolHandler, puback: PubackPacket) -> Result | None:
        # plain: like acks.handle_puback_at_once, it acts while the reader loop decodes the PUBACK
        packet_id = puback.variable_header.packet_id if puback.variable_header else None
        late = handler.session.inflight_out.get(packet_id) if handler.session else None
        if (packet_id in handler._puback_waiters or late is None or late.qos != QOS_1 or is_ecq_topic(late.topic)
                or find_target(handler.plugins_manager) is None):
            return None
        late.puback_packet = puback
        del handler.session.inflight_out[packet_id]
        return Result(no_op())  # what amqtt's reader schedules: a finished no-op

    replace(BrokerProtocolHandler, "_handle_message_flow", handle_message_flow)
    replace(BrokerProtocolHandler, "_retry_deliveries", retry_deliveries)
    step(BrokerProtocolHandler, "handle_puback", before=settle_a_late_puback)


_RESEND_TIMEOUT_S = 10  # amqtt's own bound on one resend at connect (its _retry_deliveries)


def _keep_for_resend(handler: BrokerProtocolHandler, message: Any) -> None:
    session = handler.session
    plugin = find_target(handler.plugins_manager)
    if (plugin is None or session is None or session.clean_session is not False or message.direction != OUTGOING
            or message.qos not in (QOS_1, 2) or is_ecq_topic(message.topic)
            or (message.puback_packet if message.qos == QOS_1 else message.pubcomp_packet) is not None):
        return
    session.inflight_out.setdefault(message.packet_id, message)
    waited = handler._puback_waiters.keys() | handler._pubrec_waiters.keys() | handler._pubcomp_waiters.keys()
    kept = [pid for pid, m in session.inflight_out.items() if pid not in waited and not is_ecq_topic(m.topic)]
    for packet_id in kept[:max(0, len(kept) - plugin.settings.session_max_inflight)]:
        plugin.session_message_dropped(session.client_id, session.inflight_out.pop(packet_id).topic, "inflight_full")
        stored_sends.acknowledged(handler, packet_id)


def enforce_keepalive() -> None:
    """amqtt 0.12.1 reads with a timeout of the keepalive but its ``BrokerProtocolHandler.handle_read_timeout``
    does nothing: a silent client stays connected forever and its Will is never published. MQTT 3.1.1
    section 3.1.2.10: after 1.5 x keepalive without a packet the server closes the connection (and, as
    for any close without DISCONNECT, publishes the Will, section 3.1.2.5). The reader's timeout is
    ``session.keep_alive`` (amqtt adds its ``timeout-disconnect-delay`` to it), so that becomes 1.5 x the
    CONNECT's keepalive, and the timeout closes the connection."""
    original_timeout = BrokerProtocolHandler.handle_read_timeout

    def stretch_the_keepalive(connected: tuple[BrokerProtocolHandler, Any], cls: type, reader: Any, writer: Any,
                              plugins_manager: Any, loop: Any) -> None:
        _, session = connected
        if find_target(plugins_manager) is not None:
            session.keep_alive = session.keep_alive * 1.5

    def handle_read_timeout(handler: BrokerProtocolHandler) -> None:  # the body of the method's one wrapper
        if find_target(handler.plugins_manager) is None:
            return original_timeout(handler)
        log.info("closing %s: no packet within 1.5 x its keepalive", client_id(handler))
        task = asyncio.get_running_loop().create_task(close_connection(handler))
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    step(BrokerProtocolHandler, "init_from_connect", after=stretch_the_keepalive)
    step(BrokerProtocolHandler, "handle_read_timeout", body=handle_read_timeout)
