"""What the amqtt corrections call on the ECQ plugin, and how they find it in a broker.

The corrections see the plugin only through :class:`EcqHooksTarget`, so this package does not import
``ecq.broker.plugin`` (which imports this package). :func:`find_target` looks for an instance of the
class given to :func:`register` in a broker's or handler's own PluginManager: several brokers in one
process work independently, and a broker without the ECQ plugin gets None and keeps stock amqtt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
    from amqtt.mqtt.publish import PublishPacket
    from amqtt.session import Session

    from ecq.config import EcqSettings

_target_class: type | None = None


class EcqHooksTarget(Protocol):
    """The plugin as the corrections use it (``ecq.broker.plugin.EcqPlugin`` implements it)."""

    settings: EcqSettings
    start_error: Exception | None  # a failure of the plugin's start, raised from ``Broker.start``

    async def handle_ecq_publish(self, handler: BrokerProtocolHandler, packet: PublishPacket) -> None:
        """Store a PUBLISH under ``$ECQ/`` and then acknowledge it, or refuse it."""

    def take_ecq_write(self, handler: BrokerProtocolHandler, topic: str, packet_id: int, payload: bytes) -> None:
        """Take a QoS 1 PUBLISH under ``$ECQ/`` read by the framer: store, then PUBACK in arrival order, or refuse."""

    def count_fast_path(self, publishes: int, pubacks: int) -> None:
        """Count packets the framer took on its fast path (QoS 1 ``$ECQ/`` PUBLISHes, PUBACKs of ECQ deliveries)."""

    def grant_subscription(self, clientid: str, topic_filter: str, qos: int) -> int | None:
        """QoS to grant for a SUBSCRIBE to an ``$ECQ/`` filter, or None to refuse it (SUBACK 0x80)."""

    def will_refusal(self, session: Session) -> str | None:
        """Why a CONNECT carrying a Will must be refused with CONNACK 0x05, or None to accept it."""

    def forward_to_cluster(self, topic: str, data: bytes, qos: int) -> None:
        """Send a message broadcast on this broker to the cluster's other brokers (no-op without a cluster)."""

    def session_message_dropped(self, clientid: str, topic: str, reason: str) -> None:
        """Count a message of an ordinary topic dropped from a persistent session at a bound
        (``reason``: ``queue_full`` or ``inflight_full``)."""


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
