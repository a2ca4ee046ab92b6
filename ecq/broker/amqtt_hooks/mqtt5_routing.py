"""Deliveries on ordinary topics to MQTT 5.0 clients, as their subscriptions and CONNECT ask (amqtt 0.12.1 sends
every matching message, as 3.1.1 has it):

- :func:`subscribed` / :func:`unsubscribed` keep a v5 session's subscription options and identifiers
  (``mqtt5_messages.subscriptions_of``) and give UNSUBACK its reason codes (MQTT 5.0 section 3.11.3);
- :func:`sends_retained`: Retain Handling, whether a SUBSCRIBE gets the retained messages (section 3.8.3.1);
- :func:`deliver_as_mqtt5_clients_ask` wraps amqtt's ``BrokerProtocolHandler.mqtt_publish`` on v5 connections:
  an expired message is not sent (Message Expiry, section 3.3.2.3.3), nor a message back to its publisher whose
  every matching subscription has No Local, nor a packet above the client's Maximum Packet Size (section
  3.1.2.11.4); Retain As Published keeps the PUBLISH's RETAIN flag; the Subscription Identifiers of the matching
  subscriptions go with it (section 3.3.4); at most Receive Maximum QoS 1 and 2 messages are in flight (section
  4.9).
"""

from __future__ import annotations

import logging
from typing import Any

from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

from ecq.broker.acl.rules import filter_covers
from ecq.broker.amqtt_hooks.mqtt5_messages import (Mqtt5Payload, Subscription, as_mqtt5_payload, encoded_size,
                                                   subscriptions_of)
from ecq.broker.amqtt_hooks.mqtt5_packets import context_of
from ecq.broker.amqtt_hooks.seam import replace
from ecq.broker.amqtt_hooks.shared_subscriptions import is_shared, share_target

log = logging.getLogger(__name__)

NO_SUBSCRIPTION_EXISTED = 0x11
_SEND_RETAINED, _SEND_RETAINED_IF_NEW = 0, 1


def subscribed(handler: BrokerProtocolHandler, topic_filter: Any, subscription_id: int | None) -> None:
    """Keep the options of a v5 SUBSCRIBE's filter (``mqtt5.TopicFilter``) on the session, and whether this
    SUBSCRIBE gets the filter's retained messages (Retain Handling 0: always, 1: only when the subscription is new,
    2: never; MQTT 5.0 section 3.8.3.1)."""
    subscriptions = subscriptions_of(handler.session)
    handling = int(topic_filter.retain_handling)
    new = topic_filter.pattern not in subscriptions
    subscriptions[topic_filter.pattern] = Subscription(bool(topic_filter.no_local),
                                                       bool(topic_filter.retain_as_published), handling,
                                                       subscription_id)
    wanted = handling == _SEND_RETAINED or (handling == _SEND_RETAINED_IF_NEW and new)
    context_of(handler).retained_wanted[topic_filter.pattern] = wanted


def unsubscribed(session: Any, patterns: list[str]) -> list[int]:
    """Forget the v5 subscriptions of an UNSUBSCRIBE: its UNSUBACK reason codes, 0x00 for a filter the session
    had, 0x11 No subscription existed for another (MQTT 5.0 section 3.11.3)."""
    subscriptions = subscriptions_of(session)
    return [0 if subscriptions.pop(pattern, None) is not None else NO_SUBSCRIPTION_EXISTED for pattern in patterns]


def sends_retained(handler: BrokerProtocolHandler, topic_filter: str) -> bool:
    """Whether the SUBSCRIBE being handled on ``handler`` sends the retained messages of ``topic_filter``
    (Retain Handling, see :func:`subscribed`); always True on a 3.1.1 connection."""
    context = context_of(handler)
    return context is None or context.retained_wanted.pop(topic_filter, True)


def deliver_as_mqtt5_clients_ask() -> None:
    """Correct amqtt 0.12.1's ``BrokerProtocolHandler.mqtt_publish`` on v5 connections (it sends every message it
    is given, as MQTT 3.1.1 does): see the module's docstring. A message not sent returns None."""
    original = BrokerProtocolHandler.mqtt_publish

    async def mqtt_publish(handler: BrokerProtocolHandler, topic: str, data: Any, qos: int | None, retain: bool,
                           ack_timeout: int | None = None) -> Any:
        context = context_of(handler)
        if context is None or handler.session is None:
            return await original(handler, topic, data, qos, retain, ack_timeout)
        if isinstance(data, Mqtt5Payload) and data.expired():
            return None
        matching = [s for f, s in subscriptions_of(handler.session).items() if filter_covers(_filter_of(f), topic)]
        if _local(handler, data, matching) and not retain:
            return None
        if not retain and isinstance(data, Mqtt5Payload) and any(s.retain_as_published for s in matching):
            retain = data.retain
        data = as_mqtt5_payload(data, tuple(sorted({s.subscription_id for s in matching if s.subscription_id})))
        if context.maximum_packet_size is not None and encoded_size(topic, data, qos or 0) > context.maximum_packet_size:
            log.debug("%s: a PUBLISH to %r above the client's Maximum Packet Size %d not sent",
                      handler.session.client_id, topic, context.maximum_packet_size)
            return None
        if not qos:
            return await original(handler, topic, data, qos, retain, ack_timeout)
        async with context.window():
            return await original(handler, topic, data, qos, retain, ack_timeout)

    replace(BrokerProtocolHandler, "mqtt_publish", mqtt_publish)


def _filter_of(pattern: str) -> str:
    """The topic filter of a subscription: ``f`` of a shared ``$share/<group>/f`` (MQTT 5.0 section 4.8.2)."""
    return (share_target(pattern) or pattern) if is_shared(pattern) else pattern


def _local(handler: BrokerProtocolHandler, data: Any, matching: list[Subscription]) -> bool:
    """True when ``data`` was published by this client and every subscription it matches has No Local (MQTT 5.0
    section 3.8.3.1: it is then not sent back)."""
    return (isinstance(data, Mqtt5Payload) and data.publisher == handler.session.client_id and bool(matching)
            and all(s.no_local for s in matching))
