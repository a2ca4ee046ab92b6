"""``max_connections``: the client connections one node serves at once, across all its listeners. amqtt 0.12.1 caps
connections only per listener (``max-connections``, a semaphore taken before the CONNECT is read: the connection beyond
it waits unanswered) and keeps every client it accepts, so a node past its memory took clients until it died.

The rule: a connection counts from its accepted CONNECT to its end, once per client id (a takeover, a CONNECT of a
client id already connected here, is accepted at the cap: it adds no connection, its old one is closed). A CONNECT
that would make ``max_connections + 1`` client ids is refused, after its authentication and before anything is done
with its client id's session, with CONNACK 0x03 Server unavailable (MQTT 3.1.1 section 3.2.2.3; MQTT 5: 0x97 Quota
exceeded, section 3.2.2.2), and closed. Mosquitto's ``max_connections`` and EMQX's ``max_connections`` refuse the same
way (Mosquitto closes without a CONNACK; EMQX sends 0x03 / 0x97 as here).
"""

from __future__ import annotations

import contextvars
import logging
import weakref
from typing import Any

from amqtt.broker import Broker, BrokerContext
from amqtt.mqtt.connack import SERVER_UNAVAILABLE
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

from ecq.broker.amqtt_hooks.authentication import refuse_connect
from ecq.broker.amqtt_hooks.mqtt5_edge import refuse_v5_with
from ecq.broker.amqtt_hooks.seam import step
from ecq.broker.amqtt_hooks.target import find_target
from ecq.queue.throttle import LogThrottle

log = logging.getLogger(__name__)

QUOTA_EXCEEDED = 0x97  # MQTT 5.0 section 3.2.2.2
REFUSAL_LOG_INTERVAL_S, REFUSAL_LOG_BURST = 10.0, 10  # as authentication's: a reconnect storm floods no log


class _Admission:
    """What one connection's task holds: the client id it was counted under, once its CONNECT was accepted."""

    __slots__ = ("client_id",)

    def __init__(self) -> None:
        self.client_id: str | None = None


class ConnectionCount:
    """The client ids connected to one broker: client id -> its connections from an accepted CONNECT to their end
    (2 while a takeover's old connection closes). ``len`` is what ``max_connections`` caps; O(1) per connect."""

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.refusal_log = LogThrottle(REFUSAL_LOG_INTERVAL_S, REFUSAL_LOG_BURST)

    def admit(self, client_id: str, cap: int) -> bool:
        """Count a connection of ``client_id``; False (nothing counted) when ``cap`` client ids other than it are
        connected already (``cap`` 0: no cap)."""
        if cap and client_id not in self.live and len(self.live) >= cap:
            return False
        self.live[client_id] = self.live.get(client_id, 0) + 1
        return True

    def release(self, client_id: str) -> None:
        """A connection counted under ``client_id`` ended."""
        if self.live[client_id] == 1:
            del self.live[client_id]
        else:
            self.live[client_id] -= 1


_counts: weakref.WeakKeyDictionary[Broker, ConnectionCount] = weakref.WeakKeyDictionary()
_admission: contextvars.ContextVar[_Admission | None] = contextvars.ContextVar("ecq_admission", default=None)


def connections(context: BrokerContext) -> int:
    """Client ids connected to the broker of ``context`` now, as ``max_connections`` counts them."""
    count = _counts.get(context._broker_instance)
    return len(count.live) if count is not None else 0


def connections_of(broker: Broker, client_id: str) -> int:
    """The connections of ``client_id`` to ``broker`` counted now, from their accepted CONNECT to their end: 2 or more
    while a newer CONNECT of it is under way or taking over."""
    count = _counts.get(broker)
    return count.live.get(client_id, 0) if count is not None else 0


def cap_connections() -> None:
    """Refuse a CONNECT beyond ``max_connections`` (see the module docstring), which amqtt 0.12.1 would accept.

    ``Broker._client_connected`` (one task per connection, from its accept to its end) holds an :class:`_Admission`;
    ``BrokerProtocolHandler.init_from_connect``, once the CONNECT was read and authenticated (installed right outside
    ``authentication.authenticate_before_the_session``: inside every step that touches a session), counts the
    connection or refuses it (``authentication.refuse_connect``: CONNACK, close, nothing of a session touched); the
    connection's end, on every path, releases what was counted.
    """
    def admit(broker: Broker, listener_name: str, reader: Any, writer: Any) -> None:
        _admission.set(_Admission())

    def release(broker: Broker, listener_name: str, reader: Any, writer: Any) -> None:
        admission = _admission.get()  # admit()'s: the connection's task is the one context that sets it
        if admission is not None and admission.client_id is not None:
            _counts[broker].release(admission.client_id)

    async def count_the_connect(connected: tuple[BrokerProtocolHandler, Any], cls: type, reader: Any, writer: Any,
                                plugins_manager: Any, loop: Any) -> None:
        _, session = connected
        plugin = find_target(plugins_manager)
        admission = _admission.get()
        if plugin is None or admission is None:
            return
        count = _counts.setdefault(plugin.context._broker_instance, ConnectionCount())
        if not count.admit(session.client_id, plugin.settings.max_connections):
            await _refuse(plugin, count, session, plugins_manager, writer)
        admission.client_id = session.client_id

    step(Broker, "_client_connected", before=admit, always=release)
    step(BrokerProtocolHandler, "init_from_connect", after=count_the_connect)


async def _refuse(plugin: Any, count: ConnectionCount, session: Any, plugins_manager: Any, writer: Any) -> None:
    plugin.connection_refused_at_cap()
    if (held_back := count.refusal_log.due()) is not None:
        more = f" ({held_back} more refused since the last such line)" if held_back else ""
        log.warning("ECQ: CONNECT of client %r from %s refused (CONNACK 0x03, MQTT 5 0x97): %d clients connected, "
                    "max_connections %d%s", session.client_id, session.remote_address, len(count.live),
                    plugin.settings.max_connections, more)
    refuse_v5_with(writer, QUOTA_EXCEEDED)
    await refuse_connect(plugins_manager, writer, f"max_connections ({plugin.settings.max_connections}) reached",
                         SERVER_UNAVAILABLE)
