"""Draining a node (``ecq drain``, ``POST /api/v1/drain``): before a node is stopped, its clients move to the
other nodes of the cluster and nothing it took is lost.

In order: the MQTT listeners close (a client connecting now is refused by the kernel and tries another node);
every TCP/TLS connection stops being read, once what was received before is taken; every write taken is
waited for (``write_timeout``) until it is stored, and so PUBACKed on its still open connection, or failed;
then every connection is closed (an MQTT 5 client is sent DISCONNECT 0x8B Server shutting down first), and a
client reconnects to another node (MQTT 3.1.1 section 4.4: it resends there the QoS 1 and 2 PUBLISHes it got no
acknowledgement for, such as one the pause cut in half); what a connection whose CONNECT was under way when the
listeners closed wrote is waited for too; last, every consumer's received acks are saved, so the node its client
moves to resumes after them.

Since a write is PUBACKed before its connection closes, the client cannot send a newer value of the same key
to another node while this one still stores the older. Where that order cannot be kept (a WebSocket
connection, which cannot stop being read, or a write not stored within ``write_timeout``), the write is not
PUBACKed and its client sends it again to the other node.
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
    for writes in flight (and, apart, for the connections' unread bytes). The engine and the store stay open (the
    broker is stopped next); returns the report."""
    started = time.monotonic()
    listeners = hooks.close_listeners(context)
    await _stop_reading(hooks.open_connections(context), write_bound_s)
    in_flight = writes.in_flight
    await writes.settle(write_bound_s)
    await asyncio.sleep(0)  # the settled writes' PUBACKs, queued by send_soon, leave at the end of this iteration
    closed = await _close_connections(context)
    in_flight += writes.in_flight  # taken from connections that could not stop reading, or connected late
    unsettled = await writes.settle(write_bound_s)
    consumers = list(engine.consumers)
    await asyncio.gather(*(engine.release(clientid) for clientid in consumers))
    report = DrainReport(unsettled == 0, listeners, closed, in_flight, unsettled, len(consumers),
                         round(time.monotonic() - started, 3))
    (log.info if report.drained else log.warning)("ECQ node drained: %s", report)
    return report


async def _stop_reading(connections: list, timeout_s: float) -> None:
    """Stop reading every connection of ``connections`` and return once what each received before is taken by
    its reader (at most ``timeout_s``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while connections and loop.time() < deadline:
        connections = [handler for handler in connections if hooks.stop_reading(handler)]
        await asyncio.sleep(0.001)


async def _close_connections(context: BrokerContext) -> int:
    connections = hooks.open_connections(context)
    for handler in connections:  # MQTT 5.0 section 3.14.2.1: a v5 client is told why
        hooks.send_disconnect(handler, hooks.SERVER_SHUTTING_DOWN)
    await asyncio.gather(*(hooks.close_connection(handler) for handler in connections), return_exceptions=True)
    return len(connections)
