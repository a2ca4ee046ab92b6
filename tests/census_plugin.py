"""A test-only amqtt plugin that counts the broker's live connection objects through amqtt's own plugin API.

A PUBLISH to ``census/ask`` makes it count the objects alive whose class is amqtt's ``BrokerProtocolHandler``
(one per connection), asyncio's ``StreamReader``, amqtt's ``Session``, ECQ's ``Consumer`` (one per queue, reader or
SCQ group in memory) and ``GroupDispatch`` (an SCQ group's members), first as they are (what reference
counting has not freed: ``"live"``), then after a full garbage collection (what is still referenced:
``"referenced"``), and broadcast both as JSON on ``census/answer``, with ``"session_reprs"``: how many times
``Session.__repr__`` ran in the broker process since the plugin started, and ``"matches"``: how many topics amqtt's
``Broker._matches`` tested against a filter since then. Tests use it to see what a closed connection leaves behind in
the broker process, and what work a packet caused; ``"session_deadlines"``: the live deadlines and the entries (stale
ones too) of the broker's heap of offline sessions' deadlines (``amqtt_hooks.session_deadlines``); ``"timers"``: the event loop's timers
still to come (not cancelled), by the name of what each calls. At start it retains
a message on ``$census/retained`` (amqtt's plugin API), a retained ``$`` topic no client may publish (MQTT 3.1.1
section 4.7.2).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
from typing import Any

from amqtt.broker import Broker, BrokerContext
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.plugins.base import BasePlugin
from amqtt.session import Session

from ecq.broker.amqtt_hooks import session_deadlines
from ecq.queue.delivery import Consumer
from ecq.queue.groups import GroupDispatch

PLUGIN_PATH = "tests.census_plugin.CensusPlugin"
ASK, ANSWER = "census/ask", "census/answer"
RETAINED_DOLLAR_TOPIC = "$census/retained"
COUNTED = {"handlers": BrokerProtocolHandler, "stream_readers": asyncio.StreamReader, "sessions": Session,
           "consumers": Consumer, "group_dispatches": GroupDispatch}


class CensusPlugin(BasePlugin[BrokerContext]):
    """Answer ``census/ask`` with the live object counts on ``census/answer`` (see the module docstring)."""

    session_reprs = 0
    matches = 0

    def __init__(self, context: BrokerContext) -> None:
        super().__init__(context)
        counted = Session.__repr__

        def counting_repr(session: Session) -> str:
            CensusPlugin.session_reprs += 1
            return counted(session)

        Session.__repr__ = counting_repr
        matches = Broker._matches

        def counting_matches(broker: Broker, topic: str, topic_filter: str) -> bool:
            CensusPlugin.matches += 1
            return matches(broker, topic, topic_filter)

        Broker._matches = counting_matches

    async def on_broker_post_start(self) -> None:
        await self.context.retain_message(RETAINED_DOLLAR_TOPIC, b"$", 0)

    async def on_broker_message_received(self, *, client_id: str, message: Any) -> None:
        if message is None or message.topic != ASK:
            return
        live = _counts()
        gc.collect()
        deadlines = session_deadlines(self.context)
        answer = {"live": live, "referenced": _counts(), "session_reprs": CensusPlugin.session_reprs,
                  "matches": CensusPlugin.matches,
                  "session_deadlines": {"live": len(deadlines), "entries": deadlines.entries}, "timers": _timers()}
        await self.context.broadcast_message(ANSWER, json.dumps(answer).encode(), qos=1)


def _counts() -> dict[str, int]:
    alive = gc.get_objects()
    return {name: sum(1 for o in alive if type(o) is cls) for name, cls in COUNTED.items()}


def _timers() -> dict[str, int]:
    """The running loop's timers not cancelled, by their callback's qualified name (asyncio's own heap of them)."""
    scheduled = asyncio.get_running_loop()._scheduled
    return dict(collections.Counter(getattr(timer._callback, "__qualname__", "?") for timer in scheduled
                                    if not timer.cancelled()))
