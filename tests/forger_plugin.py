"""A test-only amqtt plugin that forges messages through amqtt's own plugin API.

A PUBLISH to ``forge/<topic>`` makes it broadcast the payload on ``<topic>`` at QoS 1 with
``BrokerContext.broadcast_message`` and store it as retained with ``BrokerContext.retain_message``:
the internal paths by which anything but ECQ's delivery could reach an ``$ECQ/<clientid>/#`` subscription.
"""

from __future__ import annotations

from typing import Any

from amqtt.broker import BrokerContext
from amqtt.plugins.base import BasePlugin

PLUGIN_PATH = "tests.forger_plugin.ForgerPlugin"
PREFIX = "forge/"


class ForgerPlugin(BasePlugin[BrokerContext]):
    """Broadcast and retain ``forge/<topic>`` PUBLISHes on ``<topic>`` (see the module docstring)."""

    async def on_broker_message_received(self, *, client_id: str, message: Any) -> None:
        if message is None or not message.topic.startswith(PREFIX):
            return
        topic = message.topic[len(PREFIX):]
        await self.context.broadcast_message(topic, bytes(message.data), qos=1)
        await self.context.retain_message(topic, bytes(message.data), 1)
