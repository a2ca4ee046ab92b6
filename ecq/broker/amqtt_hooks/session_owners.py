"""Whose persistent session a CONNECT resumes, and with what: the session belongs to the username that made it, and
its subscriptions are granted again at each resumption.

amqtt 0.12.1's ``Broker._initialize_client_session`` resumes the session stored under the CONNECT's client id
whatever the CONNECT's username, and gives the session that username: a client authenticated as alice that
connected with client id ``bob`` and CleanSession 0 (MQTT 5: Clean Start 0) got CONNACK session present 1 and bob's
subscriptions, his ECQ queue's ``$ECQ/bob/#`` among them, without a SUBSCRIBE the ACL would have judged; and a
resumed session kept subscriptions the ACL, reloaded since, no longer grants.
"""

from __future__ import annotations

import logging
from typing import Any

from amqtt.broker import Broker
from amqtt.contexts import Action
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

from ecq.broker.acl.rules import filter_covers
from ecq.broker.amqtt_hooks.fleet_scale import filters_of
from ecq.broker.amqtt_hooks.mqtt5_messages import subscriptions_of
from ecq.broker.amqtt_hooks.seam import step
from ecq.broker.amqtt_hooks.shared_subscriptions import is_shared, share_target
from ecq.broker.amqtt_hooks.target import find_target
from ecq.queue.topics import is_ecq_topic

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
    A session its owner resumes has each subscription granted again, as its SUBSCRIBE was (``Broker._topic_filtering``:
    the ACL as it is now, for the connecting client id, username and address; MQTT 5.0 section 3.9.3 lets a server
    refuse a subscription it does not authorize): one no longer granted is dropped, with the messages queued or in
    flight for it that no kept subscription matches (logged; the ECQ queue is then not attached). Installed outside
    ``cluster.adopt_sessions_from_the_cluster``: a session another broker hands over, or the cluster's store holds,
    is judged by the owner it carries."""

    async def judge_the_owner(connected: tuple[BrokerProtocolHandler, Any], cls: type, reader: Any, writer: Any,
                              plugins_manager: Any, loop: Any) -> None:
        _, session = connected
        plugin = find_target(plugins_manager)
        if plugin is None or session.clean_session or not session.client_id:
            return
        broker = plugin.context._broker_instance
        stored, _ = broker._sessions.get(session.client_id, (None, None))
        if stored is not None and not owned_by(stored, session.username):
            log.warning("ECQ did not resume the session of client id %r for username %r: it belongs to %s; it is "
                        "discarded (session present 0)", session.client_id, session.username,
                        "an unknown owner" if stored.attributes.get(_OWNER_UNKNOWN) else repr(stored.username))
            await broker._delete_session(session.client_id)
            plugin.session_discarded(session.client_id)
        elif stored is not None:
            await _grant_again(broker, stored, session)

    step(BrokerProtocolHandler, "init_from_connect", after=judge_the_owner)


async def _grant_again(broker: Broker, stored: Any, connecting: Any) -> None:
    """Drop each subscription of the resumed session ``stored`` that amqtt's topic filter refuses the ``connecting``
    session now, and the messages queued or in flight for ``stored`` that no kept subscription matches."""
    held = filters_of(broker, stored.client_id)
    refused = [topic_filter for topic_filter in held
               if not await broker._topic_filtering(connecting, topic_filter, Action.SUBSCRIBE)]
    if not refused:
        return
    log.warning("ECQ dropped subscriptions %s of the session of %r: no longer granted to username %r",
                refused, connecting.client_id, connecting.username)
    for topic_filter in refused:
        broker._del_subscription(topic_filter, stored)
        if not broker._subscriptions[topic_filter]:
            del broker._subscriptions[topic_filter]
        subscriptions_of(stored).pop(topic_filter, None)
    kept = [(share_target(f) or f) if is_shared(f) else f for f in held if f not in refused]
    wanted = [m for m in _drained(stored.retained_messages) if any(filter_covers(f, m.topic) for f in kept)]
    for message in wanted:
        stored.retained_messages.put_nowait(message)
    for packet_id, message in list(stored.inflight_out.items()):
        if not is_ecq_topic(message.topic) and not any(filter_covers(f, message.topic) for f in kept):
            del stored.inflight_out[packet_id]


def _drained(messages: Any) -> list[Any]:
    """Everything an asyncio.Queue held, taken out of it."""
    taken = []
    while not messages.empty():
        taken.append(messages.get_nowait())
    return taken
