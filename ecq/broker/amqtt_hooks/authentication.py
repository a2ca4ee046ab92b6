"""Why a client cannot connect is said, not left to guess: amqtt 0.12.1 refuses a CONNECT that no authentication
plugin allowed (CONNACK 0x05 Not authorized, 0x87 to an MQTT 5 client) without a line in its log, also when the
config lists no authentication plugin at all and so refuses every client of a broker that started and said
``ECQ ready``."""

from __future__ import annotations

import logging
from typing import Any

from amqtt.broker import Broker
from amqtt.plugins.manager import PluginManager

from ecq.broker.amqtt_hooks.target import find_target
from ecq.queue.throttle import LogThrottle

log = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL_S, REFUSAL_LOG_BURST = 10.0, 10  # as bad_clients' violations: a reconnect loop floods nothing
ANONYMOUS_PLUGIN = "amqtt.plugins.authentication.AnonymousAuthPlugin"
_refusal_log = LogThrottle(REFUSAL_LOG_INTERVAL_S, REFUSAL_LOG_BURST)


def warn_when_no_authentication_plugin() -> None:
    """Log a WARNING as ``Broker.start`` opens the listeners when the config lists no authentication plugin.

    amqtt 0.12.1's ``Broker._authenticate`` allows a CONNECT only when some plugin of
    ``PluginManager._auth_plugins`` (the listed plugins that are a ``BaseAuthPlugin``) answered True and none
    False: with none listed, every client is refused, while the broker starts and logs as if it would serve.
    """
    original_start_listeners = Broker._start_listeners

    async def start_listeners(broker: Broker) -> None:
        if find_target(broker.plugins_manager) is not None and not broker.plugins_manager._auth_plugins:
            log.warning("ECQ: the broker config lists no authentication plugin, so every client will be refused "
                        "(CONNACK 0x05, MQTT 5 0x87); list one under plugins, e.g. %s with allow_anonymous, or "
                        "amqtt.plugins.authentication.FileAuthPlugin (see docs/listeners.md)", ANONYMOUS_PLUGIN)
        await original_start_listeners(broker)

    Broker._start_listeners = start_listeners


def log_refused_connects() -> None:
    """Log why amqtt refuses a CONNECT, at most :data:`REFUSAL_LOG_BURST` lines per :data:`REFUSAL_LOG_INTERVAL_S`.

    amqtt 0.12.1's ``Broker._authenticate`` takes the answers of ``PluginManager.map_plugin_auth`` (one per
    authentication plugin: True, False, or None for "not mine") and refuses when no plugin answered a boolean or
    any answered False, logging that only at DEBUG. The answers are read here, where they are made, so that no
    plugin is asked twice; the decision stays amqtt's.
    """
    original_map_plugin_auth = PluginManager.map_plugin_auth

    async def map_plugin_auth(manager: PluginManager, *, session: Any) -> dict:
        answers = await original_map_plugin_auth(manager, session=session)
        if find_target(manager) is not None and (reason := _refusal(answers)) is not None:
            if (held_back := _refusal_log.due()) is not None:
                more = f" ({held_back} more refused CONNECTs since the last such line)" if held_back else ""
                log.warning("ECQ: CONNECT of client %r (user %r) from %s refused (CONNACK 0x05, MQTT 5 0x87): %s%s",
                            session.client_id, session.username, session.remote_address, reason, more)
        return answers

    PluginManager.map_plugin_auth = map_plugin_auth


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
