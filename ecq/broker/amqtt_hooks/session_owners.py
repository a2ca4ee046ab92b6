"""Whose persistent session a CONNECT resumes: the session belongs to the username that made it.

amqtt 0.12.1's ``Broker._initialize_client_session`` resumes the session stored under the CONNECT's client id
whatever the CONNECT's username, and gives the session that username: a client authenticated as alice that
connected with client id ``bob`` and CleanSession 0 (MQTT 5: Clean Start 0) got CONNACK session present 1 and bob's
subscriptions, his ECQ queue's ``$ECQ/bob/#`` among them, without a SUBSCRIBE the ACL would have judged.
"""

from __future__ import annotations

import logging
from typing import Any

from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

from ecq.broker.amqtt_hooks.target import find_target

log = logging.getLogger(__name__)

_OWNER_UNKNOWN = "ecq_owner_unknown"  # the key of amqtt's Session.attributes marking a session of no known owner


def mark_owner_unknown(session: Any) -> None:
    """Mark amqtt's ``session`` as owned by nobody known (a session stored by an ECQ broker that did not record its
    owner): no CONNECT resumes it."""
    session.attributes[_OWNER_UNKNOWN] = True


def owned_by(session: Any, username: str | None) -> bool:
    """True when amqtt's ``session`` belongs to ``username`` (None: a CONNECT without one)."""
    return not session.attributes.get(_OWNER_UNKNOWN) and session.username == username


def resume_sessions_only_for_their_owner() -> None:
    """Correct amqtt 0.12.1's resumption of another username's session (see the module's docstring). A CleanSession=0
    CONNECT whose username is not the stored session's owner's does not resume it: the session is discarded as a
    CleanSession=1 CONNECT would discard it (``Broker._delete_session``: its subscriptions and queued messages; its
    live connection, if any, is closed by the takeover; the cluster forgets its copy,
    :meth:`EcqHooksTarget.session_discarded`), so the CONNACK says session present 0 and the new identity gets only
    what its own SUBSCRIBEs are granted. An ECQ queue's entries and ack position belong to the client id, not the
    session: the queue is read again only once ``$ECQ/<clientid>/#`` is granted to a SUBSCRIBE of this connection.
    Installed outside ``cluster.adopt_sessions_from_the_cluster``: a session another broker hands over, or the
    cluster's store holds, is judged by the owner it carries."""
    original = BrokerProtocolHandler.init_from_connect

    async def init_from_connect(cls: type, reader: Any, writer: Any, plugins_manager: Any,
                                loop: Any = None) -> tuple[BrokerProtocolHandler, Any]:
        handler, session = await original(reader, writer, plugins_manager, loop)
        plugin = find_target(plugins_manager)
        if plugin is None or session.clean_session or not session.client_id:
            return handler, session
        broker = plugin.context._broker_instance
        stored, _ = broker._sessions.get(session.client_id, (None, None))
        if stored is not None and not owned_by(stored, session.username):
            log.warning("ECQ did not resume the session of client id %r for username %r: it belongs to %s; it is "
                        "discarded (session present 0)", session.client_id, session.username,
                        "an unknown owner" if stored.attributes.get(_OWNER_UNKNOWN) else repr(stored.username))
            await broker._delete_session(session.client_id)
            plugin.session_discarded(session.client_id)
        return handler, session

    BrokerProtocolHandler.init_from_connect = classmethod(init_from_connect)
