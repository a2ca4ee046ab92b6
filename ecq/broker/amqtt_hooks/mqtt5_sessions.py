"""The life of an MQTT 5.0 session on amqtt 0.12.1, which keeps sessions as MQTT 3.1.1 does (CleanSession, one
broker-wide ``session_expiry_interval``, a Will published at once, connections closed without a word).

- Session Expiry Interval per session (MQTT 5.0 sections 3.1.2.11.2, 3.14.2.2.2, 4.1): the CONNECT's value (absent
  = 0, 0xFFFFFFFF = never), capped at ``session_expiry``, applies to that session; a DISCONNECT may change it.
  Clean Start alone decides whether an existing session is resumed (section 3.1.2.4);
- the Will with its Will Delay Interval (sections 3.1.2.5, 3.1.3.2.2): published when the delay has passed or the
  session ends, whichever comes first; not at all when the session is resumed before;
- Server Keep Alive (section 3.2.2.3.14): above ``max_keepalive`` (or 0), the client is given and held to it;
- a server DISCONNECT before the broker closes a v5 connection (section 3.14.2.1): 0x8E on a takeover, 0x8D on a
  keepalive timeout, 0x8B when the broker stops.

:func:`session_options` and :func:`connack_properties` serve ``mqtt5_edge`` (CONNECT, CONNACK),
:func:`take_disconnect_expiry` serves ``mqtt5_framer`` (DISCONNECT); the other public functions are corrections.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from amqtt.broker import Broker
from amqtt.mqtt.disconnect import DisconnectPacket
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

from ecq.broker.amqtt_hooks.ecq_paths import connection_is_open
from ecq.broker.amqtt_hooks.mqtt5_messages import payload_of
from ecq.broker.amqtt_hooks.mqtt5_packets import context_of, disconnect
from ecq.broker.amqtt_hooks.seam import replace, step
from ecq.broker.amqtt_hooks.target import find_target

log = logging.getLogger(__name__)

SERVER_SHUTTING_DOWN, KEEP_ALIVE_TIMEOUT, SESSION_TAKEN_OVER = 0x8B, 0x8D, 0x8E
_PENDING = "ecq_mqtt5_pending_end"  # the key of amqtt's Session.attributes that holds its _Offline
_ENDED, _TAKEN_OVER, _OFFLINE = "ended", "taken over", "offline"  # a session at the end of one of its connections
_EXPIRY = "ecq_session_expiry_s"  # the key of amqtt's Session.attributes holding a v5 session's expiry interval
_tasks: set[asyncio.Task] = set()  # wills and expiries in progress (a reference keeps each task alive)


@dataclass
class SessionOptions:
    """What ECQ applies of a v5 CONNECT's session options, for the life of the connection.

    ``expiry_s``: the Session Expiry Interval in force, seconds (0: the session ends with the connection), at most
    ``cap_s`` (the broker's ``session_expiry``, rounded up); ``keep_alive_s``: the Keep Alive ECQ holds the client
    to, seconds (0: none); ``server_keep_alive_s``: the Server Keep Alive announced in CONNACK, None when the
    client's own applies; ``will``: the CONNECT's Will (``mqtt5.Will``, with its properties and Will Delay
    Interval), None without one; ``disconnect_sent``: a server DISCONNECT went out on this connection.
    """

    expiry_s: int
    cap_s: int
    keep_alive_s: int
    server_keep_alive_s: int | None
    will: Any
    disconnect_sent: bool = False


@dataclass
class _Offline:
    """An offline v5 session's pending end: its Will not yet published, and the timers of the Will and the expiry."""

    will: Any
    timers: list[asyncio.TimerHandle] = field(default_factory=list)

    def cancel(self) -> None:
        for timer in self.timers:
            timer.cancel()


def session_options(connect: Any, settings: Any) -> SessionOptions:
    """The options ECQ applies to a v5 ``connect`` (mqtt5.ConnectPacket) under ``settings`` (EcqSettings): the
    Session Expiry Interval capped at ``session_expiry`` (MQTT 5.0 section 3.1.2.11.2: 0xFFFFFFFF, never, is
    the cap too), and a Keep Alive of 0 or above ``max_keepalive`` replaced by ``max_keepalive`` (section
    3.2.2.3.14)."""
    cap_s = math.ceil(settings.session_expiry)
    asked_keep_alive, most = connect.keep_alive, settings.max_keepalive
    server_keep_alive = most if most is not None and (asked_keep_alive == 0 or asked_keep_alive > most) else None
    return SessionOptions(expiry_s=min(connect.session_expiry_interval, cap_s), cap_s=cap_s,
                          keep_alive_s=asked_keep_alive if server_keep_alive is None else server_keep_alive,
                          server_keep_alive_s=server_keep_alive, will=connect.will)


def connack_properties(context: Any) -> dict[str, int | None]:
    """The CONNACK properties of the session options of ``context`` (Mqtt5Context), as ``mqtt5.ConnAckPacket``
    keywords: the Session Expiry Interval when ECQ applies another one than asked (section 3.2.2.3.2), the Server
    Keep Alive when the client's is replaced (section 3.2.2.3.14); None leaves a property off."""
    options = context.session
    return {"session_expiry_interval": None if options.expiry_s == context.session_expiry_s else options.expiry_s,
            "server_keep_alive": options.server_keep_alive_s}


def take_disconnect_expiry(context: Any, packet: Any) -> bool:
    """Apply the Session Expiry Interval of a client's DISCONNECT (mqtt5.DisconnectPacket) to the connection of
    ``context``, capped as the CONNECT's was (MQTT 5.0 section 3.14.2.2.2). False, and nothing changed, for a
    non-zero value after a CONNECT's 0: a Protocol Error [MQTT-3.14.2-2]."""
    expiry = packet.session_expiry_interval
    if expiry is None:
        return True
    if context.session_expiry_s == 0 and expiry != 0:
        return False
    context.session.expiry_s = min(expiry, context.session.cap_s)
    return True


def expiry_of(session: Any) -> int | None:
    """The Session Expiry Interval (seconds) of amqtt's ``session`` as its last v5 connection left it (a DISCONNECT
    may have changed it), or None for a session of MQTT 3.1.1 connections (the broker's ``session_expiry``)."""
    return session.attributes.get(_EXPIRY)


def will_pending(session: Any) -> bool:
    """True while the Will of amqtt's offline ``session`` waits for its Will Delay Interval (MQTT 5.0 section
    3.1.3.2.2)."""
    offline = session.attributes.get(_PENDING)
    return offline is not None and offline.will is not None


def _options(handler: Any) -> SessionOptions | None:
    context = context_of(handler)
    return None if context is None else context.session


def tell(handler: BrokerProtocolHandler, code: int) -> None:
    """Write a server DISCONNECT with reason ``code`` (MQTT 5.0 section 3.14.2.1) on the v5 connection of
    ``handler`` while it is open, once; nothing on a 3.1.1 connection (it has no server DISCONNECT)."""
    options = _options(handler)
    if options is not None and not options.disconnect_sent and connection_is_open(handler):
        options.disconnect_sent = True
        handler.writer.write(disconnect(code))


async def _publish_will(broker: Broker, session: Any, will: Any) -> None:
    """Publish ``will`` as amqtt publishes a 3.1.1 Will: a broadcast, and retained with Will Retain; its properties
    go with it (``mqtt5_messages.payload_of``)."""
    data, qos = payload_of(will, session.client_id), int(will.qos)
    log.debug("publishing the Will of %s on %r", session.client_id, will.topic)
    await broker._broadcast_message(session, will.topic, data, qos)
    if will.retain:
        await broker.retain_message(session, will.topic, data, qos)


def _end_of_connection(broker: Broker, session: Any) -> str:
    """What became of ``session`` once a connection of it ended (after amqtt's ``_handle_disconnect``): _ENDED (no
    longer amqtt's session of its client id), _TAKEN_OVER (a newer connection resumed it: amqtt's takeover keeps it
    connected, see ``acks.keep_the_new_connection_on_persistent_takeover``) or _OFFLINE."""
    if broker._sessions.get(session.client_id, (None, None))[0] is not session:
        return _ENDED
    return _OFFLINE if session.transitions.state == "disconnected" else _TAKEN_OVER


def _later(delay_s: float, work: Any, *args: Any) -> asyncio.TimerHandle:
    """Run the coroutine function ``work(*args)`` in a task after ``delay_s`` seconds."""
    def start() -> None:
        task = asyncio.ensure_future(work(*args))
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)
    return asyncio.get_running_loop().call_later(delay_s, start)


def expire_sessions_one_by_one() -> None:
    """amqtt 0.12.1 keeps a session while CleanSession=0, for the broker-wide ``session_expiry_interval`` (checked
    once a second by ``Broker._session_monitor``), and ends it with its connection otherwise. MQTT 5.0 sections
    3.1.2.4 and 3.1.2.11.2 split the two: Clean Start says whether the CONNECT resumes an existing session (the
    translated CONNECT carries it as CleanSession, so amqtt's lookup and Session Present follow it), the Session
    Expiry Interval of the session how long it outlives its connection. So after amqtt's
    ``_initialize_client_session`` a v5 session is marked clean exactly when its interval is 0 (amqtt and
    ``conformance`` then end it with its connection), a resumed session's pending expiry is cancelled, and at the
    end of the connection (``_handle_disconnect``, outermost) a session with an interval, which a DISCONNECT may
    have changed, is forgotten after it (at most ``session_expiry``, amqtt's monitor's bound), at once for 0."""
    original_cleanup = Broker._cleanup_session

    def resume_or_mark(connected: tuple[BrokerProtocolHandler, Any], broker: Broker, *args: Any) -> None:
        handler, session = connected
        if (offline := session.attributes.pop(_PENDING, None)) is not None:
            offline.cancel()  # resumed: its Will is not published (section 3.1.3.2.2), its expiry is off
        if (options := _options(handler)) is not None:
            session.clean_session = options.expiry_s == 0
            session.attributes[_EXPIRY] = options.expiry_s
        else:
            session.attributes.pop(_EXPIRY, None)

    async def expire_the_offline_session(_: None, broker: Broker, session: Any, handler: BrokerProtocolHandler,
                                         disconnect_waiter: asyncio.Future) -> None:
        options = _options(handler)
        if options is None or _end_of_connection(broker, session) != _OFFLINE:
            return  # 3.1.1, or the session ended or went to a newer connection: nothing left to expire
        session.attributes[_EXPIRY] = options.expiry_s
        if options.expiry_s == 0:
            await broker._cleanup_session(session.client_id)
            return
        offline = session.attributes.setdefault(_PENDING, _Offline(None))
        offline.timers.append(_later(options.expiry_s, _expire, broker, session, offline))

    async def cleanup_session(broker: Broker, client_id: str) -> None:
        session, _ = broker._sessions.get(client_id, (None, None))
        if session is not None and (offline := session.attributes.pop(_PENDING, None)) is not None:
            offline.cancel()  # ended otherwise (amqtt's monitor, handed over to another broker): nothing pending
        await original_cleanup(broker, client_id)

    step(Broker, "_initialize_client_session", after=resume_or_mark)
    step(Broker, "_handle_disconnect", after=expire_the_offline_session)
    replace(Broker, "_cleanup_session", cleanup_session)


async def _expire(broker: Broker, session: Any, offline: _Offline) -> None:
    """The end of an offline session: its pending Will published, the session forgotten (by the cluster too)."""
    if session.attributes.get(_PENDING) is not offline:
        return  # resumed or ended meanwhile
    del session.attributes[_PENDING]
    offline.cancel()
    if offline.will is not None:
        await _publish_will(broker, session, offline.will)
    if broker._sessions.get(session.client_id, (None, None))[0] is session:
        await broker._cleanup_session(session.client_id)
        if (plugin := find_target(broker.plugins_manager)) is not None:
            await plugin.session_expired(session.client_id)


def publish_wills_after_their_delay() -> None:
    """amqtt 0.12.1's ``Broker._handle_disconnect`` publishes the Will at once, without its properties, when a
    connection ends without DISCONNECT. MQTT 5.0 sections 3.1.2.5 and 3.1.3.2.2: the Will is published once the
    Will Delay Interval has passed or the session has ended, whichever comes first, and not at all when the
    session is resumed before (a takeover by a connection that resumes it, within the delay, included). So amqtt
    is given no Will flag for a v5 session (``ecq_guards`` has checked the Will by then), and the end of a v5
    connection publishes its own Will (kept in its ``SessionOptions``) now or later: at once when the session
    ended with it (interval 0, Clean Start elsewhere) or the delay is 0, else when the first of the delay and the
    session's expiry runs out. A Clean Start CONNECT that discards an offline session publishes its pending
    Will (``Broker._delete_session``)."""

    def keep_the_will_from_amqtt(connected: tuple[BrokerProtocolHandler, Any], broker: Broker, *args: Any) -> None:
        handler, session = connected
        if _options(handler) is not None:
            session.will_flag = False

    async def publish_the_will(_: None, broker: Broker, session: Any, handler: BrokerProtocolHandler,
                               disconnect_waiter: asyncio.Future) -> None:
        options = _options(handler)
        if options is None or options.will is None or isinstance(disconnect_waiter.result(), DisconnectPacket):
            return  # 3.1.1, no Will, or a DISCONNECT other than 0x04 (which mqtt5_framer hands over as none)
        end = _end_of_connection(broker, session)
        delay = min(options.will.will_delay_interval, options.expiry_s)
        if end == _TAKEN_OVER and delay:
            return  # taken over by a connection that resumed the session within the delay
        offline = session.attributes.get(_PENDING) if end == _OFFLINE else None
        if offline is None or delay == 0:
            await _publish_will(broker, session, options.will)
            return
        offline.will = options.will
        offline.timers.append(_later(delay, _will_due, broker, session, offline))

    async def publish_a_pending_will(broker: Broker, client_id: str) -> None:
        session, _ = broker._sessions.get(client_id, (None, None))
        offline = session.attributes.pop(_PENDING, None) if session is not None else None
        if offline is not None:
            offline.cancel()
            if offline.will is not None:
                await _publish_will(broker, session, offline.will)

    step(Broker, "_initialize_client_session", after=keep_the_will_from_amqtt)
    step(Broker, "_handle_disconnect", after=publish_the_will)
    step(Broker, "_delete_session", before=publish_a_pending_will)


async def _will_due(broker: Broker, session: Any, offline: _Offline) -> None:
    """The Will Delay Interval of an offline session has passed: publish its Will, unless resumed or ended."""
    if session.attributes.get(_PENDING) is offline and offline.will is not None:
        will, offline.will = offline.will, None
        await _publish_will(broker, session, will)


def tell_v5_clients_why_they_are_closed() -> None:
    """amqtt 0.12.1 closes a connection without a word on a takeover (``Broker._handle_client_session`` for a
    resumed session, ``_delete_session`` for a Clean Start one, whose old connection ``sessions`` then closes), on
    a keepalive timeout (``handle_read_timeout``, see ``conformance.enforce_keepalive``) and when the broker stops
    (``Broker.shutdown``). MQTT 5.0 section 3.14.2.1: the server may send DISCONNECT with the reason before it
    closes; a v5 connection is sent 0x8E Session taken over, 0x8D Keep Alive timeout, 0x8B Server shutting down."""
    original_shutdown = Broker.shutdown

    def tell_the_connection_taken_over(broker: Broker, reader: Any, writer: Any, session: Any,
                                       handler: BrokerProtocolHandler, *args: Any) -> None:
        _, previous = broker._sessions.get(session.client_id, (None, None))
        if previous is not None and previous is not handler:
            tell(previous, SESSION_TAKEN_OVER)

    def tell_the_connection_of_a_discarded_session(broker: Broker, client_id: str) -> None:
        _, previous = broker._sessions.get(client_id, (None, None))
        if previous is not None:
            tell(previous, SESSION_TAKEN_OVER)

    def tell_of_the_timeout(handler: BrokerProtocolHandler) -> None:
        if find_target(handler.plugins_manager) is not None:
            tell(handler, KEEP_ALIVE_TIMEOUT)

    async def shutdown(broker: Broker) -> None:
        if find_target(broker.plugins_manager) is not None:
            for _, handler in list(broker._sessions.values()):
                if handler is not None:
                    tell(handler, SERVER_SHUTTING_DOWN)
        await original_shutdown(broker)

    step(Broker, "_handle_client_session", before=tell_the_connection_taken_over)
    step(Broker, "_delete_session", before=tell_the_connection_of_a_discarded_session)
    step(BrokerProtocolHandler, "handle_read_timeout", before=tell_of_the_timeout)
    replace(Broker, "shutdown", shutdown)
