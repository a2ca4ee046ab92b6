"""Ordinary MQTT messages across the brokers of a cluster (``backend: jetstream``).

amqtt 0.12.1 broadcasts a PUBLISH only to the subscribers of its own process. In a cluster, each broadcast of
an ordinary topic is also handed to the plugin (:meth:`EcqHooksTarget.forward_to_cluster`), which sends it to
the other brokers; what they send arrives through :func:`broadcast_from_cluster`, which broadcasts locally
and marks the broadcast so that it is not forwarded again (no loop, no duplicate).
"""

from __future__ import annotations

import contextvars
from typing import Any

from amqtt.broker import Broker, BrokerContext

from ecq.broker.amqtt_hooks.target import find_target

_FROM_CLUSTER: contextvars.ContextVar[bool] = contextvars.ContextVar("ecq_from_cluster", default=False)


def forward_broadcasts_to_the_cluster() -> None:
    """After amqtt's ``Broker._broadcast_message`` (client PUBLISHes, Wills, plugins' broadcasts) of a topic
    not starting with ``$``, hand the message to the plugin for the other brokers, unless it came from one."""
    original = Broker._broadcast_message

    async def broadcast_message(broker: Broker, session: Any, topic: str | None, data: Any,
                                force_qos: int | None = None) -> None:
        await original(broker, session, topic, data, force_qos)
        plugin = find_target(broker.plugins_manager)
        if plugin is not None and topic and not topic.startswith("$") and not _FROM_CLUSTER.get():
            plugin.forward_to_cluster(topic, bytes(data or b""), 2 if force_qos is None else force_qos)

    Broker._broadcast_message = broadcast_message


async def broadcast_from_cluster(context: BrokerContext, topic: str, data: bytes, qos: int) -> None:
    """Broadcast a message another broker of the cluster took to this broker's subscribers, at most at ``qos``
    (MQTT 3.1.1 section 3.3.5: min of the PUBLISH's and the subscription's QoS), not forwarded again."""
    token = _FROM_CLUSTER.set(True)
    try:
        await context._broker_instance._broadcast_message(None, topic, data, force_qos=qos)
    finally:
        _FROM_CLUSTER.reset(token)
