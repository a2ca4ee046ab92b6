"""A CONNECT is authenticated before anything is done with its client id's session, and why a client cannot connect
is said, not left to guess: amqtt 0.12.1 refuses a CONNECT that no authentication plugin allowed (CONNACK 0x05 Not
authorized, 0x87 to an MQTT 5 client) without a line in its log, also when the config lists no authentication plugin
at all and so refuses every client of a broker that started and said ``ECQ ready``."""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, NoReturn

from amqtt.broker import Broker
from amqtt.errors import MQTTError
from amqtt.events import MQTTEvents
from amqtt.mqtt.connack import NOT_AUTHORIZED, ConnackPacket
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.plugins.manager import PluginManager

from ecq.broker.amqtt_hooks.seam import Result, replace, step
from ecq.broker.amqtt_hooks.target import find_target
from ecq.queue.throttle import LogThrottle

log = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL_S, REFUSAL_LOG_BURST = 10.0, 10  # as bad_clients' violations: a reconnect loop floods nothing
ANONYMOUS_PLUGIN = "amqtt.plugins.authentication.AnonymousAuthPlugin"
_refusal_log = LogThrottle(REFUSAL_LOG_INTERVAL_S, REFUSAL_LOG_BURST)
_AUTHENTICATED = "ecq_authenticated"  # Session.attributes key: authenticated at CONNECT; value: its is_anonymous


class ConnectRefused(MQTTError):
    """A CONNECT refused by :func:`refuse_connect`: with CONNACK 0x05 for the authentication plugins' answer or a Will
    ECQ forbids (``ecq_guards.refuse_forbidden_wills``), with 0x03 beyond ``max_connections`` (``connection_cap``)."""


async def refuse_connect(plugins_manager: Any, writer: Any, reason: str,
                         return_code: int = NOT_AUTHORIZED) -> NoReturn:
    """Refuse the CONNECT just read as amqtt 0.12.1 refuses a bad protocol level: CONNACK ``return_code`` (0x05 Not
    authorized unless told; 0x03 Server unavailable for ``connection_cap``) with session present 0 (MQTT 3.1.1 section
    3.2.2.3, MQTT-3.2.2-4; to an MQTT 5 client its v5 code, ``mqtt5_edge``: 0x87 for 0x05), close, and raise
    :class:`ConnectRefused` with ``reason``, which ends the connection with nothing of its client id's session
    touched; amqtt's log lines for it are dropped (:class:`_RefusalAlreadyLogged`): the caller logged why."""
    connack = ConnackPacket.build(0, return_code)
    await plugins_manager.fire_event(MQTTEvents.PACKET_SENT, packet=connack)
    await connack.to_stream(writer)
    await writer.close()
    raise ConnectRefused(f"CONNECT refused with 0x{return_code:02x}: {reason}")


class _RefusalAlreadyLogged(logging.Filter):
    """Drops amqtt's two WARNINGs for a connection that ended in :class:`ConnectRefused` (``Invalid connection from ...``,
    ``Failed to initialize client session: ...``, logged while handling it): :func:`log_refused_connects` said why,
    rate-limited, so a client retrying a wrong password floods no log."""

    def filter(self, record: logging.LogRecord) -> bool:
        handled = sys.exc_info()[1]
        return not (isinstance(handled, ConnectRefused)
                    or isinstance(getattr(handled, "__cause__", None), ConnectRefused))


def authenticate_before_the_session() -> None:
    """Correct amqtt 0.12.1's order of CONNECT handling: ``Broker._initialize_client_session`` acts on the session
    stored under the CONNECT's client id (a CleanSession=1 CONNECT deletes it, ``Broker._delete_session``: its
    subscriptions and queued messages; a CleanSession=0 one takes it and gives it the CONNECT's username and
    password) and ``Broker._handle_client_session`` takes over its live connection (closed) and registers the new
    connection as the session's, all before ``Broker._authenticate`` asks the authentication plugins; a refused
    CONNECT then got CONNACK 0x05 (with session present 1 for a resumed session) and was closed, too late. So a
    CONNECT with a wrong password naming client id ``bob`` deleted bob's persistent session, or (another username,
    ``session_owners``) discarded it, or closed bob's live connection; on a cluster, the claim of ``cluster``'s
    ``adopt_sessions_from_the_cluster`` took bob's session and connection from the other brokers.

    MQTT 3.1.1 section 3.1.4 (MQTT 5.0 the same): the server authenticates first and, on refusal, sends a CONNACK
    with a non-zero return code and closes the connection; EMQX and Mosquitto authenticate before any session
    takeover. So right after amqtt read the CONNECT, before any step looks the session up, amqtt's
    ``Broker._authenticate`` judges the CONNECT's own session (amqtt's rule and the plugins' answers, logged by
    :func:`log_refused_connects`); a refusal is answered as amqtt refuses a bad protocol level: CONNACK 0x05 with
    session present 0 (MQTT-3.2.2-4), close (:func:`refuse_connect`), which ends the connection with nothing changed. An allowed CONNECT is not judged again: amqtt's
    later ``_authenticate`` of the session it resumes or creates answers True with the ``is_anonymous`` the
    plugins gave, so no plugin is asked twice, and steps outside this one (``conformance.keep_persistent_sessions``)
    still judge that final session.
    """
    original_authenticate = Broker._authenticate
    allowed: weakref.WeakKeyDictionary[BrokerProtocolHandler, bool] = weakref.WeakKeyDictionary()  # -> is_anonymous

    async def authenticate_the_connect(connected: tuple[BrokerProtocolHandler, Any], cls: type, reader: Any,
                                       writer: Any, plugins_manager: Any, loop: Any) -> None:
        handler, session = connected
        plugin = find_target(plugins_manager)
        if plugin is None:
            return
        if not await original_authenticate(plugin.context._broker_instance, session, None):
            await refuse_connect(plugins_manager, writer, f"client id {session.client_id!r} not authorized")
        allowed[handler] = session.is_anonymous

    def mark_the_session_allowed(connected: tuple[BrokerProtocolHandler, Any], broker: Broker, *args: Any) -> None:
        handler, session = connected
        if (anonymous := allowed.pop(handler, None)) is not None:
            session.attributes[_AUTHENTICATED] = anonymous

    def allow_what_was_allowed(broker: Broker, session: Any, listener: Any) -> Result | None:
        anonymous = session.attributes.pop(_AUTHENTICATED, None)
        if anonymous is None:
            return None
        session.is_anonymous = anonymous
        return Result(True)

    step(BrokerProtocolHandler, "init_from_connect", after=authenticate_the_connect)
    step(Broker, "_initialize_client_session", after=mark_the_session_allowed)
    step(Broker, "_authenticate", before=allow_what_was_allowed)
    logging.getLogger("amqtt.broker").addFilter(_RefusalAlreadyLogged())


def warn_when_no_authentication_plugin() -> None:
    """Log a WARNING as ``Broker.start`` opens the listeners when the config lists no authentication plugin.

    amqtt 0.12.1's ``Broker._authenticate`` allows a CONNECT only when some plugin of
    ``PluginManager._auth_plugins`` (the listed plugins that are a ``BaseAuthPlugin``) answered True and none
    False: with none listed, every client is refused, while the broker starts and logs as if it would serve.
    """

    def warn_of_no_authentication_plugin(broker: Broker) -> None:
        if find_target(broker.plugins_manager) is not None and not broker.plugins_manager._auth_plugins:
            log.warning("ECQ: the broker config lists no authentication plugin, so every client will be refused "
                        "(CONNACK 0x05, MQTT 5 0x87); list one under plugins, e.g. %s with allow_anonymous, or "
                        "amqtt.plugins.authentication.FileAuthPlugin (see docs/listeners.md)", ANONYMOUS_PLUGIN)

    step(Broker, "_start_listeners", before=warn_of_no_authentication_plugin)


def log_refused_connects() -> None:
    """Log why amqtt refuses a CONNECT, at most :data:`REFUSAL_LOG_BURST` lines per :data:`REFUSAL_LOG_INTERVAL_S`.

    amqtt 0.12.1's ``Broker._authenticate`` takes the answers of ``PluginManager.map_plugin_auth`` (one per
    authentication plugin: True, False, or None for "not mine") and refuses when no plugin answered a boolean or
    any answered False, logging that only at DEBUG. The answers are read here, where they are made, so that no
    plugin is asked twice; the decision stays amqtt's.

    amqtt asks the plugins in a task each, gathered (``PluginManager._map_plugin_method``): a task, a future and
    their callbacks for every CONNECT. Here each plugin's ``authenticate`` is awaited in turn on the CONNECT's own
    task, in the config's order; the answers are the same (only several slow plugins, e.g. two that ask an HTTP
    service, now add their waits up).
    """
    original_map_plugin_auth = PluginManager.map_plugin_auth

    async def map_plugin_auth(manager: PluginManager, *, session: Any) -> dict:
        if find_target(manager) is None:
            return await original_map_plugin_auth(manager, session=session)
        answers = {plugin: await plugin.authenticate(session=session) for plugin in manager._auth_plugins}
        if (reason := _refusal(answers)) is not None:
            if (held_back := _refusal_log.due()) is not None:
                more = f" ({held_back} more refused CONNECTs since the last such line)" if held_back else ""
                log.warning("ECQ: CONNECT of client %r (user %r) from %s refused (CONNACK 0x05, MQTT 5 0x87): %s%s",
                            session.client_id, session.username, session.remote_address, reason, more)
        return answers

    replace(PluginManager, "map_plugin_auth", map_plugin_auth)


def _refusal(answers: dict[Any, bool | str | None]) -> str | None:
    """Why amqtt's rule refuses a CONNECT given the authentication plugins' answers; None when it allows it."""
    if not answers:
        return f"the broker config lists no authentication plugin (e.g. {ANONYMOUS_PLUGIN})"
    refusing = [type(plugin).__name__ for plugin, answer in answers.items() if answer is not None and not answer]
    if refusing:
        return f"refused by {', '.join(refusing)}"
    if all(answer is None for answer in answers.values()):
        names = ", ".join(type(plugin).__name__ for plugin in answers)
        return f"no authentication plugin allowed it ({names} did not answer for this client)"
    return None
