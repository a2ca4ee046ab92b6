"""Draining a node (``ecq drain``, ``POST /api/v1/drain``): before a node is stopped, its clients move to the
other nodes of the cluster and nothing it took is lost.

In order: the MQTT listeners close (a client connecting now is refused by the kernel and tries another node);
every client connection is closed (MQTT 3.1.1 section 4.4: a client resends the QoS 1 and 2 PUBLISHes it got
no acknowledgement for when it reconnects, here to another node); every write read before the close is
waited for until it is stored or failed (``write_timeout``); a connection whose CONNECT was under way when the
listeners closed is closed too; every consumer's received acks are saved, so the node its client moves to
resumes after them. A write read before the close is stored, and its PUBACK, queued at the close, is lost
with the connection: the client sends it again to the other node, which stores it again under the same key
(the queue keeps its newest value; the consumer may get it twice, as after any lost PUBACK).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass

from amqtt.broker import BrokerContext

from ecq.broker import amqtt_hooks as hooks
from ecq.broker.writes import EcqWrites
from ecq.queue.engine import QueueEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrainReport:
    """What a drain did. ``drained`` is True once nothing taken is pending: no write left unsettled."""

    drained: bool
    listeners_closed: int
    connections_closed: int
    writes_in_flight: int   # writes read before the close, waited for
    writes_unsettled: int   # of those, not stored or failed within the bound
    consumers_released: int
    seconds: float

    def as_dict(self) -> dict:
        """The report as the admin API's JSON object."""
        return asdict(self)


async def drain_node(context: BrokerContext, writes: EcqWrites, engine: QueueEngine,
                     write_bound_s: float) -> DrainReport:
    """Drain the broker of ``context`` (see the module docstring); ``write_bound_s`` bounds, in seconds, the wait
    for writes in flight. The engine and the store stay open (the broker is stopped next); returns the report."""
    started = time.monotonic()
    listeners = hooks.close_listeners(context)
    closed = await _close_connections(context)
    in_flight = writes.in_flight
    unsettled = await writes.settle(write_bound_s)
    closed += await _close_connections(context)  # their CONNECT was under way when the listeners closed
    consumers = list(engine.consumers)
    await asyncio.gather(*(engine.release(clientid) for clientid in consumers))
    report = DrainReport(unsettled == 0, listeners, closed, in_flight, unsettled, len(consumers),
                         round(time.monotonic() - started, 3))
    log.info("ECQ node drained: %s", report)
    return report


async def _close_connections(context: BrokerContext) -> int:
    connections = hooks.open_connections(context)
    await asyncio.gather(*(hooks.close_connection(handler) for handler in connections), return_exceptions=True)
    return len(connections)
