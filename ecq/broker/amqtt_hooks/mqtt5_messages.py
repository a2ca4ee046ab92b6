"""MQTT 5.0 messages on ordinary topics, carried through amqtt 0.12.1 (which keeps a message as topic, payload
bytes, QoS and retain flag only): the properties of a v5 PUBLISH ride in its payload object, a ``bytes`` subclass
amqtt passes unchanged from the PUBLISH to every delivery (the broadcast, a persistent session's offline queue, the
retained store), and the subscription options of a v5 SUBSCRIBE are kept on the session.

- :class:`Mqtt5Payload`: the payload with its PUBLISH's properties (forwarded unaltered, MQTT 5.0 section 3.3.2.3),
  its Message Expiry as a deadline, its publisher's client id (for No Local) and RETAIN flag (for Retain As
  Published);
- :class:`Subscription`: the options of one v5 filter (section 3.8.3.1) and its Subscription Identifier (3.8.2.1.2),
  kept per session (:func:`subscriptions_of`);
- :func:`publish_bytes`: the v5 PUBLISH of an amqtt one, with the properties, the remaining expiry, the
  Subscription Identifiers of the delivery and a Topic Alias when the client takes them (section 3.3.2.3.4);
- :func:`cluster_form` and :func:`from_cluster_form`: what of an Mqtt5Payload travels between the brokers of a
  cluster beside its bytes (forwarded messages, retained messages, offline sessions' queues).
"""

from __future__ import annotations

import base64
import math
import time
from dataclasses import dataclass
from typing import Any

import mqtt5

from ecq.broker.amqtt_hooks.mqtt5_packets import Mqtt5Context

_SESSION_SUBSCRIPTIONS = "ecq_mqtt5_subscriptions"  # the key of amqtt's Session.attributes that holds them
_FORWARDED = ("user_properties", "payload_format_indicator", "content_type", "response_topic", "correlation_data")


class Mqtt5Payload(bytes):
    """A PUBLISH payload (``bytes``) with what MQTT 5.0 says travels with it.

    ``properties``: keyword arguments of ``mqtt5.PublishPacket`` forwarded unaltered (User Properties, Payload
    Format Indicator, Content Type, Response Topic, Correlation Data; section 3.3.2.3); ``expires_at``: the
    ``time.monotonic()`` second after which it is not delivered, None for never (Message Expiry Interval,
    section 3.3.2.3.3); ``publisher``: the client id that published it; ``retain``: its PUBLISH's RETAIN flag;
    ``subscription_ids``: the Subscription Identifiers of one delivery (section 3.3.4), empty on the stored message.
    """

    properties: dict[str, Any]
    expires_at: float | None
    publisher: str | None
    retain: bool
    subscription_ids: tuple[int, ...]

    def __bytes__(self) -> Mqtt5Payload:
        """Itself: amqtt's ``ApplicationMessage.build_publish_packet`` copies the payload with ``bytes()``, which
        would drop the properties on the way to the connection."""
        return self

    def expired(self, now: float | None = None) -> bool:
        """True once the Message Expiry Interval has passed (section 3.3.2.3.3: it is then not delivered)."""
        return self.expires_at is not None and (time.monotonic() if now is None else now) >= self.expires_at

    def for_delivery(self, subscription_ids: tuple[int, ...]) -> Mqtt5Payload:
        """This payload with the Subscription Identifiers of one delivery (a copy; the stored message keeps none)."""
        return make_payload(self, self.properties, self.expires_at, self.publisher, self.retain, subscription_ids)


def make_payload(data: bytes, properties: dict[str, Any], expires_at: float | None, publisher: str | None,
                 retain: bool, subscription_ids: tuple[int, ...] = ()) -> Mqtt5Payload:
    """An :class:`Mqtt5Payload` of ``data`` with these attributes (a Will's payload is made with it too)."""
    payload = Mqtt5Payload(data)
    payload.properties, payload.expires_at, payload.publisher = properties, expires_at, publisher
    payload.retain, payload.subscription_ids = retain, subscription_ids
    return payload


def payload_of(packet: Any, publisher: str | None) -> Mqtt5Payload:
    """The payload of a decoded v5 PUBLISH or Will (``mqtt5.PublishPacket``, ``mqtt5.Will``) of ``publisher``, with
    the properties forwarded unaltered (MQTT 5.0 sections 3.3.2.3, 3.1.3.2) and its Message Expiry counted from now
    (for a Will: from its publication, section 3.1.3.2.4)."""
    expiry = packet.message_expiry_interval
    expires_at = None if expiry is None else time.monotonic() + expiry
    return make_payload(packet.payload or b"", _forwarded(packet), expires_at, publisher, bool(packet.retain))


def _forwarded(packet: Any) -> dict[str, Any]:
    return {name: value for name in _FORWARDED if (value := getattr(packet, name))}


def cluster_form(data: bytes) -> str | None:
    """What another broker of a cluster needs beside ``data`` to deliver it as this one would, as ASCII (it goes
    into NATS headers, JSON and KV values): ``<deadline>:<properties>``, the deadline being the Message Expiry as
    unix ms (empty for none; brokers' clocks are assumed in step, as for ``data_retention``) and the properties the
    base64 of a v5 PUBLISH with no payload that carries the forwarded properties and the RETAIN flag (the codec's
    encoding). None when there is nothing to carry: ``data`` is a 3.1.1 payload, or a v5 one without any of them.
    The publisher's client id is not carried: its connection is on the broker that took the PUBLISH."""
    if not isinstance(data, Mqtt5Payload) or not (data.properties or data.retain or data.expires_at is not None):
        return None
    deadline = "" if data.expires_at is None else str(round((time.time() + data.expires_at - time.monotonic()) * 1000))
    packet = mqtt5.PublishPacket("-", b"", retain=data.retain, **data.properties).write()
    return f"{deadline}:{base64.b64encode(packet).decode()}"


def from_cluster_form(data: bytes, form: str | None) -> bytes:
    """``data`` as another broker's :func:`cluster_form` describes it: an Mqtt5Payload, or ``data`` itself when
    ``form`` is None. Raises ValueError for a form that is not one."""
    if form is None:
        return data
    try:
        deadline, encoded = form.split(":", 1)
        packet, _used = mqtt5.read(memoryview(base64.b64decode(encoded, validate=True)))
        expires_in = None if not deadline else int(deadline) / 1000 - time.time()
    except Exception as exc:  # the codec raises ValueError and others on bytes that are not a packet
        raise ValueError(f"unreadable MQTT 5 properties {form[:60]!r}: {exc}") from None
    if not isinstance(packet, mqtt5.PublishPacket):
        raise ValueError(f"unreadable MQTT 5 properties {form[:60]!r}: not a PUBLISH")
    expires_at = None if expires_in is None else time.monotonic() + expires_in
    return make_payload(data, _forwarded(packet), expires_at, None, bool(packet.retain))


def as_mqtt5_payload(data: bytes, subscription_ids: tuple[int, ...]) -> bytes:
    """``data`` (an Mqtt5Payload, or the bytes of a 3.1.1 PUBLISH) carrying ``subscription_ids`` for one delivery."""
    if not subscription_ids:
        return data
    if isinstance(data, Mqtt5Payload):
        return data.for_delivery(subscription_ids)
    return make_payload(data, {}, None, None, False, subscription_ids)


@dataclass(frozen=True)
class Subscription:
    """The options of one v5 subscription (MQTT 5.0 section 3.8.3.1) and its Subscription Identifier (1..268435455
    or None, section 3.8.2.1.2)."""

    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0
    subscription_id: int | None = None


def subscriptions_of(session: Any) -> dict[str, Subscription]:
    """The v5 subscriptions of amqtt's ``session`` by filter (created empty); a 3.1.1 session has none."""
    return session.attributes.setdefault(_SESSION_SUBSCRIPTIONS, {})


def publish_bytes(context: Mqtt5Context, packet: Any) -> bytes:
    """The v5 bytes of amqtt's outgoing PublishPacket: :func:`_publish_properties`, and a Topic Alias while the
    client's Topic Alias Maximum has room (the topic is sent once with it, then as an empty topic)."""
    data, topic = packet.data, packet.topic_name
    properties = _publish_properties(data)
    alias, known = context.alias_out(topic)
    if alias is not None:
        properties["topic_alias"] = alias
        topic = "" if known else topic
    return mqtt5.PublishPacket(topic, bytes(data), qos=mqtt5.QoS(packet.qos or 0), retain=bool(packet.retain_flag),
                               duplicate=bool(packet.dup_flag), packet_id=packet.packet_id if packet.qos else None,
                               **properties).write()


def encoded_size(topic: str, data: bytes, qos: int) -> int:
    """The size in bytes of a v5 PUBLISH of ``data`` to ``topic`` without a Topic Alias (for the client's Maximum
    Packet Size, section 3.1.2.11.4)."""
    return len(mqtt5.PublishPacket(topic, bytes(data), qos=mqtt5.QoS(qos), packet_id=1 if qos else None,
                                   **_publish_properties(data)).write())


def _publish_properties(data: bytes) -> dict[str, Any]:
    """The properties of a v5 PUBLISH of ``data``: an Mqtt5Payload's forwarded ones, its Message Expiry Interval
    left in whole seconds, rounded up (section 3.3.2.3.3), the delivery's Subscription Identifiers (3.3.4)."""
    if not isinstance(data, Mqtt5Payload):
        return {}
    properties = dict(data.properties)
    if data.expires_at is not None:
        properties["message_expiry_interval"] = max(1, math.ceil(data.expires_at - time.monotonic()))
    if data.subscription_ids:
        properties["subscription_ids"] = list(data.subscription_ids)
    return properties
