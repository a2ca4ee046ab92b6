"""Immutable views of the engine's state, made on the event loop, for operations to read anywhere
(status, inspect, metrics) without touching live :class:`ecq.queue.delivery.Consumer` objects."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ecq.queue.delivery import Consumer
from ecq.store.protocol import AckState


@dataclass(frozen=True, slots=True)
class Totals:
    """Counts of one broker: queues that ever had a write, stored entries and their payload bytes (kept
    exact by the commit fan-out since start), PUBLISHes in flight, consumers online."""

    queues: int
    stored_entries: int
    stored_bytes: int
    inflight: int
    online: int


@dataclass(frozen=True, slots=True)
class ConsumerSnapshot:
    """One consumer: every seqno <= ``acked`` is acked, ``above`` were acked out of order, last PUBACK at
    ``last_ack_ms`` (ms since the epoch, 0 = never); ``inflight`` PUBLISHes await their PUBACK; ``skipped``
    entries were too large for the attached connection (MQTT 5 Maximum Packet Size) and stay pending."""

    clientid: str
    acked: int
    last_ack_ms: int
    above: frozenset[int]
    inflight: int
    online: bool
    skipped: int = 0

    def ack_state(self) -> AckState:
        """The same progress as a (mutable, fresh) :class:`AckState`."""
        return AckState(self.acked, self.last_ack_ms, set(self.above))


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The totals and every consumer known in memory, by clientid (a read-only mapping)."""

    totals: Totals
    consumers: Mapping[str, ConsumerSnapshot]

    def __post_init__(self) -> None:
        object.__setattr__(self, "consumers", MappingProxyType(dict(self.consumers)))


def consumer_snapshot(consumer: Consumer) -> ConsumerSnapshot:
    """Copy the state of ``consumer`` (on the event loop that drives it)."""
    state = consumer.state
    return ConsumerSnapshot(consumer.clientid, state.acked, state.last_ack_ms, frozenset(state.above),
                            len(consumer.inflight), consumer.online, len(consumer.skipped))
