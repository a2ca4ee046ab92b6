"""What the amqtt corrections call on the ECQ plugin, and how they find it in a broker.

The corrections see the plugin only through :class:`EcqHooksTarget`, and a session handed over by the cluster only
through :class:`HandedOverSession`, so this package imports nothing of ``ecq.broker`` above it (``plugin``,
``cluster_state``, ``bus`` import it). :func:`find_target` looks for an instance of the
class given to :func:`register` in a broker's or handler's own PluginManager: several brokers in one
process work independently, and a broker without the ECQ plugin gets None and keeps stock amqtt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from amqtt.broker import BrokerContext
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
    from amqtt.session import Session

    from ecq.broker.amqtt_hooks.mqtt5_messages import Subscription
    from ecq.config import EcqSettings

_target_class: type | None = None


class HandedOverSession(Protocol):
    """A persistent session as the cluster hands it to this broker (``ecq.broker.session_state.SessionState``):
    ``present`` False when there is none; ``username`` its owner's (None for none), ``owner_known`` False when the
    broker that stored it did not record its owner; ``subscriptions`` ``[(filter, granted QoS, MQTT 5.0 options or
    None)]``; ``messages`` ``[(topic, QoS, payload)]`` queued for it, oldest first; ``releases`` the packet ids of
    QoS 2 messages its client received (PUBREC came) and has not completed (no PUBCOMP yet)."""

    present: bool
    subscriptions: list[tuple[str, int, Subscription | None]]
    messages: list[tuple[str, int, bytes]]
    username: str | None
    owner_known: bool
    releases: list[int]


class SessionSends(Protocol):
    """The session store's copies of the messages of ordinary topics sent at QoS 1/2 to connected persistent sessions
    (``ecq.broker.session_keeper.SessionKeeper``), so that a broker killed before their acknowledgement still has
    them. A key is opaque (a LevelDB key, a JetStream stream sequence); None stands for a message not stored (a failed
    write, NATS unreachable)."""

    async def sent(self, sends: list[tuple[str, str, int, bytes]]) -> list[Any]:
        """Store each ``(clientid, topic, QoS, payload)`` about to be sent, before the publisher's PUBACK: a key
        each."""

    def settled(self, keys: list[Any]) -> None:
        """Delete the stored copies of ``keys``: acknowledged, or dropped from the session."""


class EcqHooksTarget(Protocol):
    """The plugin as the corrections use it (``ecq.broker.plugin.EcqPlugin`` implements it)."""

    settings: EcqSettings
    session_sends: SessionSends
    context: BrokerContext  # the broker the plugin runs in
    start_error: Exception | None  # a failure of the plugin's start, raised from ``Broker.start``

    def take_ecq_write(self, handler: BrokerProtocolHandler, topic: str, qos: int, packet_id: int | None,
                       payload: bytes, expiry_s: int = 0) -> None:
        """Take a PUBLISH under ``$ECQ/`` as it is read: start its write now; acknowledge it, in arrival order,
        once stored (QoS 1 PUBACK, QoS 2 PUBREC; a QoS 2 retransmit is not stored again), or refuse it.
        ``expiry_s``: an MQTT 5 PUBLISH's Message Expiry Interval in seconds, 0 for none (MQTT 5.0 section
        3.3.2.3.3)."""

    def hold_acknowledgement(self, handler: BrokerProtocolHandler) -> Callable[[Callable[[], None] | None], None]:
        """A place in the connection's arrival order for a plain QoS 1 or 2 PUBLISH; the returned function takes what
        sends its PUBACK or PUBREC (None: nothing)."""

    def count_fast_path(self, publishes: int, pubacks: int, pings: int = 0) -> None:
        """Count packets the framer took on its fast path (``$ECQ/`` PUBLISHes, PUBACKs of ECQ deliveries,
        PINGREQs answered at once)."""

    def count_protocol_violation(self) -> None:
        """Count a connection closed for a malformed packet or a protocol violation."""

    def connection_refused_at_cap(self) -> None:
        """Count a CONNECT refused because the node serves ``max_connections`` client ids already."""

    def grant_subscription(self, clientid: str, topic_filter: str, qos: int) -> int | None:
        """QoS to grant for a SUBSCRIBE to an ``$ECQ/`` filter, or None to refuse it (SUBACK 0x80)."""

    def subscription_refusal(self, clientid: str, topic_filter: str, qos: int) -> str | None:
        """Why :meth:`grant_subscription` refuses that SUBSCRIBE (an MQTT 5 SUBACK's Reason String), or None."""

    def will_refusal(self, session: Session) -> str | None:
        """Why a CONNECT carrying a Will must be refused with CONNACK 0x05, or None to accept it."""

    def forward_to_cluster(self, topic: str, data: bytes, qos: int) -> None:
        """Send a message broadcast on this broker to the cluster's other brokers (no-op without a cluster)."""

    def retained_changed(self, topic: str, data: bytes, qos: int | None) -> None:
        """Store a retained message of an ordinary topic for the cluster (empty ``data``: cleared; no-op without
        one)."""

    async def claim_session(self, clientid: str, clean: bool) -> HandedOverSession | None:
        """Claim ``clientid`` at its CONNECT (``clean``: its CleanSession flag): the persistent session another
        broker or the session store (the cluster's, or LevelDB's after a restart) held for it, or None."""

    def store_session(self, clientid: str) -> None:
        """Write ``clientid``'s persistent session (owner, subscriptions, expiry) to the session store; nothing for a
        clean session."""

    def session_discarded(self, clientid: str) -> None:
        """A persistent session was discarded at a CONNECT of another username, which did not resume it: forget it in
        the session store."""

    def session_message_queued(self, clientid: str, topic: str, qos: int, data: bytes) -> None:
        """Store a message queued for an offline persistent session in the session store."""

    def queue_for_stored_sessions(self, topic: str, data: bytes, qos: int) -> list[tuple[str, str]]:
        """Queue a message of an ordinary topic, fanned out at ``qos``, for the persistent sessions held in the
        session store only, that no CONNECT has claimed yet (none on a cluster); returns ``[(clientid, topic)]`` of
        the older messages dropped from their full queues (``session_max_queued``)."""

    async def session_queue_taken(self, clientid: str, messages: list[tuple[str, int, bytes]],
                                  kept: frozenset) -> list:
        """A persistent session's queued ``messages`` ``[(topic, QoS, payload)]`` are being sent: the session store
        keeps the sends of ``kept`` keys (:class:`SessionSends`) and these, and returns their keys (None: a message
        not stored)."""

    def session_evicted(self, clientid: str, session: Any, messages: list[tuple[str, int, bytes]]) -> bool:
        """Keep ``clientid``'s offline persistent ``session`` (``cluster.PersistentSession``) and the ``messages``
        ``[(topic, QoS, payload)]`` it has not received, oldest first, in the session store only, to be claimed at
        its next CONNECT; False (nothing kept) when the store does not keep offline sessions (a cluster) or could not
        take it: amqtt keeps it then."""

    async def session_expired(self, clientid: str) -> None:
        """A persistent session ended by its MQTT 5 Session Expiry Interval: forget it in the session store."""

    def session_message_dropped(self, clientid: str, topic: str, reason: str) -> None:
        """Count a message of an ordinary topic dropped from a persistent session at a bound
        (``reason``: ``queue_full`` or ``inflight_full``)."""

    def outgoing_message_dropped(self, clientid: str | None, topic: str) -> None:
        """Count a message to a connected client dropped because its connection is at ``max_queued_messages`` or
        ``max_queued_bytes``."""

    def stuck_subscriber_closed(self, clientid: str | None, messages: int, queued_bytes: int) -> None:
        """Count and log a connection closed after ``stuck_subscriber_timeout`` at its outgoing bound, with what it
        held (sends not done, bytes with its write buffer)."""


def register(target_class: type) -> bool:
    """Make ``target_class`` the plugin class :func:`find_target` looks for; False if one was registered
    already (the corrections are installed once per process)."""
    global _target_class
    if _target_class is not None:
        return False
    _target_class = target_class
    return True


def find_target(plugins_manager: Any) -> EcqHooksTarget | None:
    """The ECQ plugin among an amqtt PluginManager's plugins, or None when that broker does not run it."""
    for plugin in plugins_manager.plugins:
        if isinstance(plugin, _target_class):
            return plugin
    return None
