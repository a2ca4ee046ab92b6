"""A fleet's connects, disconnects and idle time at a cost per client, not per client times the fleet.

amqtt 0.12.1 keeps its subscriptions in one map, topic filter -> [(session, QoS)], and walks all of it where one
client's part would do: on every CONNECT, on every session's deletion, and once a second over every session. With
thousands of devices connected each connect cost milliseconds more per thousand, a stop with 8,000 offline sessions
took 24-64 s and an idle broker used a share of a core for nothing (issue 32). Here:

- a CONNECT does not walk the subscriptions at all (:func:`connect_without_walking_every_filter`);
- each client id's filters and their granted QoS are kept beside amqtt's map (:func:`filters_of`,
  :func:`granted_of`), so a session's deletion, and the reading of it for the session store, costs its own
  subscriptions (:func:`index_subscriptions_by_client`);
- offline sessions are forgotten from a heap of their deadlines, not from a scan each second
  (:func:`expire_sessions_from_their_deadlines`);
- a SUBSCRIBE reads the retained messages of the topics its filter matches from a tree of the retained topics, not
  from a test of every retained message (:func:`subscribe_without_walking_every_retained_message`);
- a connection holds no write timer that does nothing (:func:`no_write_timer_per_connection`).

Each is installed by one line in ``install`` and leaves a broker without the ECQ plugin as stock amqtt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from math import floor
from typing import Any

from amqtt.broker import Broker, BrokerContext, RetainedApplicationMessage
from amqtt.contexts import Action
from amqtt.errors import BrokerError
from amqtt.events import BrokerEvents
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from transitions import MachineError

from ecq.broker.amqtt_hooks.ecq_paths import SUBACK_FAILURE
from ecq.broker.amqtt_hooks.seam import kept_on, replace, step
from ecq.broker.amqtt_hooks.target import find_target
from ecq.queue.deadlines import DeadlineHeap
from ecq.queue.topic_tree import TopicTree

log = logging.getLogger(__name__)

_FILTERS_OF_CLIENTS = "_ecq_filters_of_clients"  # the Broker attribute holding client id -> {topic filter: QoS}
_EXPIRIES = "_ecq_expiries"  # the Broker attribute holding its _Expiries


def connect_without_walking_every_filter() -> None:
    """amqtt 0.12.1's ``Broker._handle_client_session`` ends every CONNECT by calling
    ``_publish_retained_messages_for_subscription`` once for every topic filter of the whole broker, whatever
    client holds it: CPU per connect grew from 1.2 ms to 6.4 ms between 1,000 and 19,000 subscribed consumers.
    On a broker with ECQ that call sends nothing: MQTT 3.1.1 section 3.3.1.3 sends retained messages to a new
    subscription and a reconnect is none (``conformance._handle_subscribe`` sends them on SUBSCRIBE). So this is
    amqtt's ``_handle_client_session`` without that loop: the body of the method's one wrapper (``seam.step``), so
    the first correction of the method in the table."""
    original = Broker._handle_client_session

    async def handle_client_session(broker: Broker, reader: Any, writer: Any, session: Any,
                                    handler: BrokerProtocolHandler, server: Any, listener_name: str) -> None:
        if find_target(broker.plugins_manager) is None:
            return await original(broker, reader, writer, session, handler, server, listener_name)
        authenticated = await broker._authenticate(session, broker.listeners_config[listener_name])
        if session.client_id is None:
            raise BrokerError("Client ID was not correctly created/set.")
        await _mark_connected(broker, session)
        handler.attach(session, reader, writer)
        broker._sessions[session.client_id] = (session, handler)
        await handler.mqtt_connack_authorize(authenticated)
        if not authenticated:
            await writer.close()
            return
        await broker.plugins_manager.fire_event(BrokerEvents.CLIENT_CONNECTED, client_id=session.client_id,
                                                client_session=session)
        await handler.start()
        await broker._publish_session_retained_messages(session)
        await broker._client_message_loop(session, handler)

    step(Broker, "_handle_client_session", body=handle_client_session)


async def _mark_connected(broker: Broker, session: Any) -> None:
    """amqtt's step from its ``_handle_client_session``: ``session`` connected, its live connection taken over (the
    old handler stopped), or, while its previous connection is still being torn down, a retry each second."""
    while True:
        try:
            session.transitions.connect()
            return
        except (MachineError, ValueError):
            if session.transitions.is_connected():
                broker.logger.warning(f"Client {session.client_id} is already connected, performing take-over.")
                _, old_handler = broker._sessions[session.client_id]
                await old_handler.handle_connection_closed()
                await old_handler.stop()
                return
            broker.logger.warning(f"Client {session.client_id} is reconnecting too quickly, make it wait")
            await asyncio.sleep(1)


def filters_of(broker: Broker, clientid: str) -> list[str]:
    """The topic filters ``clientid`` holds in ``broker``'s subscriptions map (amqtt's ``Broker._subscriptions``), in
    the order subscribed, without walking the map: kept by :func:`index_subscriptions_by_client` and
    :func:`note_subscription`. Only for a broker that runs the ECQ plugin."""
    return list(_filters_of_clients(broker).get(clientid, ()))


def filters_held(context: BrokerContext, clientid: str) -> list[str]:
    """:func:`filters_of` the broker of ``context`` (for the plugin's side, which sees only the context)."""
    return filters_of(context._broker_instance, clientid)


def granted_of(broker: Broker, clientid: str) -> dict[str, int]:
    """``{topic filter: granted QoS}`` of the subscriptions ``clientid`` holds in ``broker``'s subscriptions map, in
    the order subscribed, as :func:`filters_of` reads them: the QoS amqtt keeps in the map, read without walking any
    filter's subscribers."""
    return dict(_filters_of_clients(broker).get(clientid, {}))


def note_subscription(broker: Broker, clientid: str, topic_filter: str, qos: int) -> None:
    """Record that ``clientid`` holds ``topic_filter`` at ``qos``: for code that adds to amqtt's subscriptions map
    itself rather than through ``Broker.add_subscription`` (the cluster's hand-over of a session)."""
    _held_by(broker, clientid)[topic_filter] = qos


def _filters_of_clients(broker: Broker) -> dict[str, dict[str, int]]:
    return kept_on(broker, _FILTERS_OF_CLIENTS, dict)


def _held_by(broker: Broker, clientid: str) -> dict[str, int]:
    """``clientid``'s entry in the index, ``{topic filter: granted QoS}``, made empty if it has none."""
    return _filters_of_clients(broker).setdefault(clientid, {})


def index_subscriptions_by_client() -> None:
    """amqtt 0.12.1's ``Broker._del_all_subscriptions``, which deletes a session's subscriptions when the session
    ends (expiry, clean session, the broker's stop), tries every topic filter of the broker, each through
    ``_del_subscription``'s walk of its subscribers: deleting N sessions cost N x all filters, and a SIGTERM with
    8,000 offline sessions took 24-64 s. So the filters each client id holds are kept beside the map with their
    granted QoS (recorded when amqtt's ``add_subscription`` grants one, dropped when ``_del_subscription`` deletes
    one), and a session's deletion, like the reading of its subscriptions for the session store, goes through its
    own filters only. amqtt matches a session's subscriptions by client id, so does the index; a filter the client
    holds already has its QoS replaced by a new SUBSCRIBE (:func:`_add_subscription`)."""
    original_add = Broker.add_subscription
    original_del = Broker._del_subscription
    original_del_all = Broker._del_all_subscriptions

    async def add_subscription(broker: Broker, subscription: tuple[str, int], session: Any) -> int:  # the body
        if find_target(broker.plugins_manager) is None:
            return await original_add(broker, subscription, session)
        return await _add_subscription(broker, subscription, session)

    def del_subscription(broker: Broker, a_filter: str, session: Any) -> int:
        deleted = original_del(broker, a_filter, session)
        index = _filters_of_clients(broker)
        if deleted and (filters := index.get(session.client_id)) is not None:
            filters.pop(a_filter, None)
            if not filters:
                del index[session.client_id]
        return deleted

    async def del_all_subscriptions(broker: Broker, session: Any) -> None:
        if find_target(broker.plugins_manager) is None:
            return await original_del_all(broker, session)
        for topic_filter in _filters_of_clients(broker).pop(session.client_id, {}):
            broker._del_subscription(topic_filter, session)
            if topic_filter in broker._subscriptions and not broker._subscriptions[topic_filter]:
                del broker._subscriptions[topic_filter]

    step(Broker, "add_subscription", body=add_subscription)
    replace(Broker, "_del_subscription", del_subscription)
    replace(Broker, "_del_all_subscriptions", del_all_subscriptions)


async def _add_subscription(broker: Broker, subscription: tuple[str, int], session: Any) -> int:
    """amqtt 0.12.1's ``Broker.add_subscription`` with two corrections. It walked every subscriber of the filter to
    learn whether the client held it already (a SUBSCRIBE to a filter 10,000 devices share read all 10,000): the
    client's own index entry answers that. And a SUBSCRIBE to a filter the client held kept the old QoS while its
    SUBACK granted the new one; MQTT 3.1.1 section 3.8.4 (MQTT 5.0 section 3.8.4 the same) says the new subscription
    completely replaces the old, so its QoS is taken (only then are the subscribers walked, to find it). amqtt's
    checks come first, unchanged: a malformed filter (MQTT 3.1.1 section 4.7.1) or one the ACL refuses is 0x80, and
    the QoS is capped by amqtt's ``max-qos``. Returns the granted QoS (0-2) or 0x80."""
    topic_filter, qos = subscription
    if not _well_formed(topic_filter) or not await broker._topic_filtering(session, topic_filter, Action.SUBSCRIBE):
        return SUBACK_FAILURE
    max_qos = broker.config.get("max-qos", qos)
    granted = min(qos, max_qos) if isinstance(max_qos, int) else qos
    subscribers = broker._subscriptions.setdefault(topic_filter, [])
    held = _held_by(broker, session.client_id)
    if topic_filter in held:
        subscribers[:] = [(s, granted) if s.client_id == session.client_id else (s, q) for s, q in subscribers]
    else:
        subscribers.append((session, granted))
    held[topic_filter] = granted
    return granted


def _well_formed(topic_filter: str) -> bool:
    """MQTT 3.1.1 section 4.7.1: ``#`` alone in the last level, ``+`` alone in its level (amqtt's own test)."""
    levels = topic_filter.split("/")
    return (all("#" not in level or (level == "#" and index == len(levels) - 1) for index, level in enumerate(levels))
            and all("+" not in level or level == "+" for level in levels))


class _Expiries:
    """The one heap of the deadlines of a broker's offline sessions (:class:`ecq.queue.deadlines.DeadlineHeap`, epoch
    ms by client id), wherever each session lives: in amqtt's memory (:func:`_watch`, the value
    ``end_if_due``) or in the session store only (the store sets its own deadline and value,
    :func:`session_deadlines`); :meth:`run` sleeps until the earliest and hands each due client id to its value."""

    def __init__(self, broker: Broker) -> None:
        self.changed = asyncio.Event()
        self.deadlines = DeadlineHeap(on_earlier=self.changed.set)
        self.end_if_due = partial(_end_if_due, broker)  # one object, the value of every amqtt-held session's deadline

    async def run(self) -> None:
        while True:
            earliest_ms = self.deadlines.next_deadline()
            wait_s = None if earliest_ms is None else (earliest_ms - _now_ms()) / 1000
            if wait_s is None or wait_s > 0:
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), wait_s)
                except TimeoutError:
                    pass
                continue
            for clientid, end in self.deadlines.pop_due(_now_ms()):
                try:
                    await end(clientid)
                except Exception:  # one session's end failing must not stop the others' expiry
                    log.exception("ECQ could not end the expired session of %r", clientid)


def _expiries(broker: Broker) -> _Expiries:
    return kept_on(broker, _EXPIRIES, lambda: _Expiries(broker))


def session_deadlines(context: BrokerContext) -> DeadlineHeap:
    """The heap of the offline sessions' deadlines of ``context``'s broker (epoch ms by client id), swept by its
    session monitor: a session kept in the store only sets its deadline there with the coroutine function that ends
    it (called with the client id when due), replacing the one amqtt's copy had, so each offline session has one."""
    return _expiries(context._broker_instance).deadlines


def _now_ms() -> int:
    return int(time.time() * 1000)


def _deadline(broker: Broker, session: Any) -> int | None:
    """When amqtt's monitor would first forget the disconnected ``session`` (epoch ms): at once for a clean or anonymous
    one, else once ``session_expiry_interval`` has passed since its (whole-second) disconnect time; None: never."""
    if session.is_anonymous or session.clean_session:
        return 0
    interval = broker.config.session_expiry_interval
    if interval is None or not session.last_disconnect_time:
        return None
    return int((session.last_disconnect_time + interval + 1) * 1000)


def _watch(broker: Broker, session: Any) -> None:
    """Put ``session``, disconnected, under the broker's expiry watch."""
    if session.transitions.state == "disconnected" and (deadline := _deadline(broker, session)) is not None:
        expiries = _expiries(broker)
        expiries.deadlines.set(session.client_id, deadline, expiries.end_if_due)


async def _end_if_due(broker: Broker, clientid: str) -> None:
    """amqtt's monitor's decision for the session now stored for ``clientid``: forget it if it is disconnected and
    clean, anonymous or past its expiry; watch it again if it is disconnected but not yet due."""
    session, _ = broker._sessions.get(clientid, (None, None))
    if session is None or session.transitions.state != "disconnected":
        return
    interval = broker.config.session_expiry_interval
    if (session.is_anonymous or session.clean_session or (
            interval is not None and session.last_disconnect_time
            and session.last_disconnect_time < floor(time.time() - interval))):
        await broker._cleanup_session(clientid)
    else:
        _watch(broker, session)


def expire_sessions_from_their_deadlines() -> None:
    """amqtt 0.12.1's ``Broker._session_monitor`` walks every session once a second to forget the disconnected ones
    that are clean, anonymous or past ``session_expiry_interval``: an idle broker holding 19,800 consumers spent
    8 % of a core on it. So a session is put on a heap of deadlines when it goes offline (``_handle_disconnect``,
    ``create_offline_session``) and the monitor sleeps until the earliest one; at that instant it takes amqtt's
    decision for the session then stored (one that reconnected is dropped from the heap until its next
    disconnect). Sessions are forgotten when amqtt's monitor would have first seen them due, never later. The heap
    is the one of all offline sessions (:func:`session_deadlines`): a session handed to the session store replaces
    its deadline there with the store's, and the monitor ends it as the store says."""
    original_monitor = Broker._session_monitor
    original_offline = Broker.create_offline_session

    async def session_monitor(broker: Broker) -> None:
        if find_target(broker.plugins_manager) is None:
            return await original_monitor(broker)
        await _expiries(broker).run()

    def watch_the_offline_session(_: None, broker: Broker, session: Any, handler: BrokerProtocolHandler,
                                  disconnect_waiter: asyncio.Future) -> None:
        if find_target(broker.plugins_manager) is not None:
            _watch(broker, session)

    def create_offline_session(broker: Broker, clientid: str) -> tuple[BrokerProtocolHandler, Any]:
        handler, session = original_offline(broker, clientid)
        if find_target(broker.plugins_manager) is not None:
            _watch(broker, session)
        return handler, session

    replace(Broker, "_session_monitor", session_monitor)
    step(Broker, "_handle_disconnect", after=watch_the_offline_session)
    replace(Broker, "create_offline_session", create_offline_session)


class RetainedTopics(dict):
    """amqtt's table of retained messages, topic -> ``RetainedApplicationMessage``, with a
    :class:`ecq.queue.topic_tree.TopicTree` of its topics kept in step with every write made to it (amqtt's
    ``retain_message``: a retain, a replace, a delete by an empty retained payload, MQTT 3.1.1 section 3.3.1.3; its
    ``start`` and ``shutdown`` clearing it; the cluster's ``set_retained_from_cluster``), so :meth:`matching` costs the
    retained topics a filter matches, not all of them. A dict write that would bypass the tree raises TypeError."""

    def __init__(self, messages: dict[str, RetainedApplicationMessage]) -> None:
        super().__init__()
        self._topics = TopicTree()
        for topic, message in messages.items():
            self[topic] = message

    def __setitem__(self, topic: str, message: RetainedApplicationMessage) -> None:
        if topic not in self:
            self._topics.add(topic, topic, None)
        super().__setitem__(topic, message)

    def __delitem__(self, topic: str) -> None:
        super().__delitem__(topic)
        self._topics.remove(topic, topic)

    def pop(self, topic: str, *default: Any) -> Any:
        if topic in self:
            self._topics.remove(topic, topic)
        return super().pop(topic, *default)

    def clear(self) -> None:
        super().clear()
        self._topics.clear()

    def matching(self, topic_filter: str) -> list[RetainedApplicationMessage]:
        """The retained messages whose topics the well-formed ``topic_filter`` matches (MQTT 3.1.1 section 4.7)."""
        return [self[topic] for topics in self._topics.topics_matched_by(topic_filter) for topic in topics]

    def _bypasses_the_index(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("RetainedTopics is written only by item, pop and clear, which keep its topic tree in step")

    update = setdefault = popitem = __ior__ = _bypasses_the_index


def retained_matching(broker: Broker, topic_filter: str) -> list[RetainedApplicationMessage]:
    """The retained messages of ``broker`` (one running the ECQ plugin) a new subscription to the well-formed
    ``topic_filter`` gets, from its :class:`RetainedTopics`
    (:func:`subscribe_without_walking_every_retained_message`)."""
    return broker._retained_messages.matching(topic_filter)


def subscribe_without_walking_every_retained_message() -> None:
    """amqtt 0.12.1 keeps its retained messages in a plain dict, ``Broker._retained_messages``, and sends a new
    subscription its retained messages by testing every one of them against the filter
    (``_publish_retained_messages_for_subscription``; ECQ's conformant SUBSCRIBE handling,
    ``conformance._handle_subscribe``, did the same): with 100,000 retained topics each SUBSCRIBE cost 100,000 matches.
    So before amqtt's ``Broker.start`` runs (it empties the table, then the plugins' start loads the cluster's retained
    messages) the table of a broker with ECQ becomes a :class:`RetainedTopics`, and a SUBSCRIBE reads the messages of
    the topics its filter matches from its tree (:func:`retained_matching`)."""
    original = Broker.start

    async def start(broker: Broker) -> None:
        retained = broker._retained_messages
        if find_target(broker.plugins_manager) is not None and not isinstance(retained, RetainedTopics):
            broker._retained_messages = RetainedTopics(broker._retained_messages)
        await original(broker)

    replace(Broker, "start", start)


def no_write_timer_per_connection() -> None:
    """amqtt 0.12.1's ``ProtocolHandler`` arms a timer of the keepalive for ``handle_write_timeout`` as it starts, and
    cancels it and arms a new one on every packet ``_send_packet`` sends; ``BrokerProtocolHandler.handle_write_timeout``
    does nothing (a client pings the server, not the reverse: MQTT 3.1.1 section 3.1.2.10). So each connection held a
    timer handle for nothing, and each cancelled one stayed in the event loop's heap until its time came: about two
    per connection (issue 32 point 5, no per-connection timers beyond the keepalive's). A broker handler of a broker
    with ECQ starts without ``keepalive_timeout``, amqtt's condition for arming it; the reading keepalive is
    ``session.keep_alive`` (``conformance.enforce_keepalive``, the framer), which this leaves alone."""
    def without_a_write_timer(handler: BrokerProtocolHandler) -> None:
        if find_target(handler.plugins_manager) is not None:
            handler.keepalive_timeout = None

    step(BrokerProtocolHandler, "start", before=without_a_write_timer)
