"""Shared subscriptions (MQTT 5.0 section 4.8.2) on ordinary topics, for v5 and 3.1.1 clients alike.

A SUBSCRIBE to ``$share/<ShareName>/<filter>`` is recorded by amqtt 0.12.1 under that whole string, as any filter
(so UNSUBSCRIBE, persistent sessions, session takeover and the cluster's copy of a session carry it unchanged); its
``Broker._matches`` never matches such a filter against a topic. The fan-out (``conformance._subscribers``) takes
its subscribers from :func:`receivers`: every subscriber of a matching non-shared filter, and for each matching
shared subscription one member of its group.

The member: the first connected one in the subscription's list, which then moves to the list's end (round robin
among the connected members). With no member connected, the first persistent offline one, which gets the message
queued as any QoS 1 or 2 message for an offline session (a QoS 0 one is dropped). EMQX keeps offline persistent
members in its rotation, so they hold a share of the messages while away (emqx/emqx#3243, #11865; VerneMQ did too
and called it a bug, vernemq/vernemq#618): ECQ gives the message to a connected member first. Groups are per
broker: in a cluster, each broker's members of a group get one copy of a forwarded message.

Retained messages are not sent on a shared subscription (section 4.8.2; ``_matches`` does not match its filter).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from amqtt.broker import Broker
from amqtt.contexts import Action

from ecq.broker.amqtt_hooks.ecq_paths import SUBACK_FAILURE
from ecq.broker.amqtt_hooks.seam import Result, replace, step
from ecq.broker.amqtt_hooks.target import find_target
from ecq.queue.groups import parse_group_filter
from ecq.queue.topics import is_ecq_topic

log = logging.getLogger(__name__)

SHARE_PREFIX = "$share/"
TOPIC_FILTER_INVALID, SHARED_NOT_SUPPORTED = 0x8F, 0x9E


def is_shared(topic_filter: str) -> bool:
    """True for a filter starting ``$share/`` (well formed or not, MQTT 5.0 section 4.8.2)."""
    return topic_filter.startswith(SHARE_PREFIX)


def share_target(topic_filter: str) -> str | None:
    """The topic filter a shared subscription ``$share/<ShareName>/<filter>`` reads, or None when it is malformed:
    an empty ShareName, one with ``+`` or ``#``, no ``/`` after it, or nothing after that ``/`` (MQTT 5.0 section
    4.8.2, [MQTT-4.8.2-1], [MQTT-4.8.2-2]). ``topic_filter`` must start with ``$share/``."""
    share_name, slash, target = topic_filter[len(SHARE_PREFIX):].partition("/")
    if not share_name or "+" in share_name or "#" in share_name or not slash or not target:
        return None
    return target


def v5_refusal(topic_filter: str) -> int | None:
    """The SUBACK reason code refusing ``topic_filter`` as a shared subscription, or None (not shared, or taken):
    0x8F Topic Filter invalid for a malformed one (see :func:`share_target`), 0x9E Shared Subscriptions not
    supported for one on an ``$ECQ/`` filter (a queue has exactly one reader) or on an ``$SCQ/`` one other than
    ``$SCQ/<queue>/#``. MQTT 5.0 sections 3.9.3, 4.8.2. A shared group of an SCQ is not refused here."""
    if not is_shared(topic_filter) or parse_group_filter(topic_filter) is not None:
        return None
    target = share_target(topic_filter)
    if target is None:
        return TOPIC_FILTER_INVALID
    return SHARED_NOT_SUPPORTED if is_ecq_topic(target) else None


def receivers(broker: Broker, topic: str) -> Iterator[tuple[Any, int]]:
    """(session, granted QoS) of each subscription that takes a message to ``topic``: every subscriber of each
    matching non-shared filter, and one member of each matching shared subscription (see the module's docstring;
    the chosen member moves to the end of the subscription's list). A client may appear more than once."""
    for topic_filter, subscriptions in broker.subscriptions.items():
        if not is_shared(topic_filter):
            if broker._matches(topic, topic_filter):
                yield from subscriptions
        elif subscriptions and (target := share_target(topic_filter)) and broker._matches(topic, target):
            if (member := _next_member(subscriptions)) is not None:
                yield member


def _next_member(subscriptions: list[tuple[Any, int]]) -> tuple[Any, int] | None:
    """The member of a shared subscription (amqtt's list of (session, QoS)) to take the next message, moved to the
    list's end: the first connected one, else the first persistent offline one; None when there is neither."""
    connected = (i for i, (session, _) in enumerate(subscriptions) if session.transitions.state == "connected")
    persistent = (i for i, (session, _) in enumerate(subscriptions) if session.clean_session is False)
    index = next(connected, None)
    if index is None:
        index = next(persistent, None)
    if index is None:
        return None
    subscriptions.append(subscriptions.pop(index))
    return subscriptions[-1]


def take_shared_subscriptions() -> None:
    """amqtt 0.12.1's ``Broker.add_subscription`` records ``$share/...`` as any filter, malformed or not, and its
    ``topic_filtering`` plugins (ECQ's ACL) judge the whole string, so an ACL that denies ``secret/#`` let
    ``$share/g/secret/#`` through. MQTT 5.0 section 4.8.2: a malformed shared subscription, or one on an ``$ECQ/``
    filter (a queue has one reader) or on an ``$SCQ/`` one other than ``$SCQ/<queue>/#``, is refused with SUBACK
    0x80 (v5 clients get their codes from ``mqtt5_framer``), logged; an SCQ's shared group
    ``$share/<group>/$SCQ/<queue>/#`` is granted as the plugin grants ``$SCQ/<queue>/#`` (QoS 1; QoS 0 refused). The
    ACL judges a shared subscription by the filter it reads, without ``$share/<group>/`` (as EMQX does)."""
    original_filtering = Broker._topic_filtering

    def grant_or_refuse(broker: Broker, subscription: tuple[str, int], session: Any) -> tuple[Any, ...] | Result | None:
        topic_filter = subscription[0]
        if find_target(broker.plugins_manager) is None or not is_shared(topic_filter):
            return None
        target = share_target(topic_filter)
        if parse_group_filter(topic_filter) is not None:
            granted = find_target(broker.plugins_manager).grant_subscription(session.client_id, target, subscription[1])
            return Result(SUBACK_FAILURE) if granted is None else (broker, (topic_filter, granted), session)
        if target is None or is_ecq_topic(target):
            log.warning("ECQ refused SUBSCRIBE of %s to %r: %s", session.client_id, topic_filter,
                        "a malformed shared subscription" if target is None else
                        "no shared subscription reads $ECQ/, nor $SCQ/ but as $share/<group>/$SCQ/<queue>/#")
            return Result(SUBACK_FAILURE)
        return None

    async def topic_filtering(broker: Broker, session: Any, topic: str, action: Action) -> bool:
        if (action == Action.SUBSCRIBE and is_shared(topic) and find_target(broker.plugins_manager) is not None
                and (target := share_target(topic)) is not None):
            topic = target
        return await original_filtering(broker, session, topic, action)

    step(Broker, "add_subscription", before=grant_or_refuse)
    replace(Broker, "_topic_filtering", topic_filtering)
