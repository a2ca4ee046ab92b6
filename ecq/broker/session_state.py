"""A persistent MQTT session as ECQ stores it, whichever the store: the value types and encodings shared by the
cluster's JetStream KV bucket and stream (:mod:`ecq.broker.cluster_state`) and the embedded LevelDB session tables
(:mod:`ecq.broker.stored_sessions`, ``ecq.store.leveldb_sessions``), and the :class:`SessionStore` protocol both
implement. Free of NATS, so the embedded broker imports it without the ``[cluster]`` extra.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ecq.broker.amqtt_hooks import PersistentSession, Subscription, cluster_form, from_cluster_form

NO_QOS = 3                 # the QoS byte of a retained message stored without a QoS (amqtt's ``qos=None``)
WITH_MQTT5 = 0x80          # the QoS byte's flag: an MQTT 5.0 message's cluster form follows it


class TurnBatch:
    """Keys given during one turn of the event loop, handed together to ``flush(keys)`` at its next turn (at once when
    no loop runs, or on :meth:`flush`): both stores delete the copies of the sends settled in one turn in one write."""

    def __init__(self, flush: Callable[[list[Any]], None]) -> None:
        self._flush = flush
        self._keys: list[Any] = []

    def add(self, keys: list[Any]) -> None:
        """Gather ``keys`` for the next turn's flush."""
        self._keys += keys
        if len(self._keys) > len(keys):  # a flush is due already
            return
        try:
            asyncio.get_running_loop().call_soon(self.flush)
        except RuntimeError:
            self.flush()

    def flush(self) -> None:
        """Hand every key gathered so far to ``flush`` now (nothing when there is none)."""
        keys, self._keys = self._keys, []
        if keys:
            self._flush(keys)


class SessionStore(Protocol):
    """Where persistent sessions outlive their broker: the cluster's KV bucket and stream
    (``cluster_state.ClusterState``) or the embedded LevelDB store (``stored_sessions.StoredSessions``). Every
    method returns at once (the cluster writes in call order on its link; LevelDB writes before returning) and
    logs, rather than raises, a write that fails."""

    def save_session(self, clientid: str, session: PersistentSession) -> bool:
        """Store the owner, subscriptions and expiry of ``clientid``'s persistent session (at each CONNACK, SUBACK,
        UNSUBACK and disconnect): True when a record was written (LevelDB writes none when it holds that record
        already; the cluster always writes)."""

    def forget_session(self, clientid: str) -> None:
        """Delete ``clientid``'s stored session and queue (a clean-session CONNECT, another username's CONNECT, an
        MQTT 5 session's expiry)."""

    def queue_message(self, clientid: str, topic: str, qos: int, payload: bytes) -> None:
        """Store a QoS 1/2 message queued for ``clientid``'s offline persistent session (at most
        ``session_max_queued`` kept, the oldest dropped)."""

    def settle_sends(self, keys: list[Any]) -> None:
        """Delete the stored copies of messages sent to connected sessions (``amqtt_hooks.stored_sends``), their
        clients having acknowledged them: those of one event-loop turn together."""


@dataclass
class SessionState:
    """A persistent session as one broker hands it to another: ``username`` its owner's (None for none; a CONNECT of
    another username does not resume it, ``amqtt_hooks.session_owners``), ``owner_known`` False for a session
    stored by a broker that did not record its owner (none resumes it), ``subscriptions`` ``[(filter, granted QoS,
    MQTT 5.0 options or None)]`` (``amqtt_hooks.Subscription``: No Local, Retain As Published, Retain Handling,
    Subscription Identifier) and ``messages`` ``[(topic, QoS, payload)]`` queued for it, oldest first (a payload
    may be an MQTT 5.0 one, with its properties); ``releases`` the packet ids of QoS 2 messages its client received
    and has not completed, for which the PUBREL goes out again (MQTT 3.1.1 section 4.3.3); ``present`` False when
    there is none."""

    present: bool
    subscriptions: list[tuple[str, int, Subscription | None]] = field(default_factory=list)
    messages: list[tuple[str, int, bytes]] = field(default_factory=list)
    username: str | None = None
    owner_known: bool = True
    releases: list[int] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        """JSON: the owner, the subscriptions (:func:`subscriptions_value`), payloads in base64, each followed by its
        cluster form (null for none), and the packet ids of the releases owed."""
        return json.dumps({"present": self.present, "username": self.username,
                           "subscriptions": subscriptions_value(self.subscriptions),
                           "messages": [[t, q, base64.b64encode(d).decode(), cluster_form(d)]
                                        for t, q, d in self.messages],
                           "releases": self.releases}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> SessionState:
        """Inverse of :meth:`to_bytes`; from a broker of an earlier version (no ``username``), a session of no known
        owner (no ``releases``: none owed). Raises ValueError (or KeyError, TypeError) for anything else."""
        raw = json.loads(data)
        return cls._of(raw, bool(raw["present"]), [_message(*entry) for entry in raw["messages"]])

    @classmethod
    def from_kv(cls, value: bytes) -> SessionState:
        """The session of an ``NS_sessions`` value (see the module's docstring), without its messages; a list of
        subscriptions alone (from a broker of an earlier version) is a session of no known owner. Raises
        ValueError (or KeyError, TypeError) for anything else."""
        raw = json.loads(value)
        return cls._of({"subscriptions": raw} if isinstance(raw, list) else raw, True, [])

    @classmethod
    def _of(cls, raw: dict[str, Any], present: bool, messages: list[tuple[str, int, bytes]]) -> SessionState:
        return cls(present, read_subscriptions(raw["subscriptions"]), messages, _username(raw.get("username")),
                   owner_known="username" in raw, releases=read_releases(raw.get("releases", [])))


def subscriptions_value(subscriptions: list[tuple[str, int, Subscription | None]]) -> list[list[Any]]:
    """The JSON of a session's subscriptions: ``[filter, QoS]``, followed for an MQTT 5.0 subscription by its options
    ``{"no_local": bool, "retain_as_published": bool, "retain_handling": 0-2, "subscription_id": int or null}``."""
    return [[f, q] if options is None else [f, q, dataclasses.asdict(options)] for f, q, options in subscriptions]


def read_subscriptions(value: list[list[Any]]) -> list[tuple[str, int, Subscription | None]]:
    """Inverse of :func:`subscriptions_value` (``[filter, QoS]`` alone from a broker of an earlier version). Raises
    ValueError, KeyError or TypeError for anything else."""
    return [(str(entry[0]), int(entry[1]), _subscription(entry[2]) if len(entry) > 2 else None) for entry in value]


def _subscription(options: dict[str, Any]) -> Subscription:
    subscription_id = options["subscription_id"]
    return Subscription(bool(options["no_local"]), bool(options["retain_as_published"]),
                        int(options["retain_handling"]), None if subscription_id is None else int(subscription_id))


def read_releases(value: list[Any]) -> list[int]:
    """The packet ids of a session's ``releases`` (JSON integers 1-65535). Raises ValueError for anything else."""
    for packet_id in value:
        if not isinstance(packet_id, int) or not 1 <= packet_id <= 65535:
            raise ValueError(f"a packet id {packet_id!r} among the releases")
    return list(value)


def _username(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"a username of type {type(value).__name__}")
    return value


def _message(topic: str, qos: int, data: str, form: str | None = None) -> tuple[str, int, bytes]:
    """One message of :meth:`SessionState.to_bytes` (three elements from a broker of an earlier version)."""
    return str(topic), int(qos), from_cluster_form(base64.b64decode(data), form)


def retained_value(payload: bytes, qos: int | None) -> bytes:
    """The ``NS_retained`` value of a retained message (see the module's docstring)."""
    qos_byte = NO_QOS if qos is None else qos
    if (form := cluster_form(payload)) is None:
        return bytes([qos_byte]) + payload
    encoded = form.encode()
    return bytes([qos_byte | WITH_MQTT5]) + len(encoded).to_bytes(4, "big") + encoded + payload


def retained_message(value: bytes) -> tuple[bytes, int | None]:
    """``(payload, QoS or None)`` of an ``NS_retained`` value, the inverse of :func:`retained_value`. Raises
    ValueError for a value it did not write."""
    qos_byte, form = value[0], None
    body = bytes(value[1:])
    if qos_byte & WITH_MQTT5:
        qos_byte &= ~WITH_MQTT5
        length = int.from_bytes(body[:4], "big")
        if len(body) < 4 + length:
            raise ValueError(f"a value of {len(value)} bytes announces {length} bytes of MQTT 5 properties")
        form, body = body[4:4 + length].decode("ascii", errors="replace"), body[4 + length:]
    if qos_byte not in (0, 1, 2, NO_QOS):
        raise ValueError(f"QoS byte {value[0]:#x}")
    return from_cluster_form(body, form), None if qos_byte == NO_QOS else qos_byte


def message_value(topic: str, qos: int, payload: bytes) -> bytes:
    """A message queued for an offline session as the LevelDB session queue keeps it: the topic as 2-byte length and
    UTF-8, then :func:`retained_value` of the payload (an MQTT 5.0 payload's properties and expiry kept)."""
    raw = topic.encode()
    return len(raw).to_bytes(2, "big") + raw + retained_value(payload, qos)


def read_message(value: bytes) -> tuple[str, int, bytes]:
    """``(topic, QoS, payload)`` of a :func:`message_value`. Raises ValueError for anything else."""
    end = 2 + int.from_bytes(value[:2], "big")
    payload, qos = retained_message(value[end:])
    if qos not in (1, 2):
        raise ValueError(f"a queued message of QoS {qos}")
    return value[2:end].decode(), qos, payload
