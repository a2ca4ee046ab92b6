"""Shared reads of an SCQ (issue 33 point 3): ``$share/<group>/$SCQ/<queue>/#``.

A group has one position in the queue, saved as the ack state of ``$SCQ/<queue>/$share/<group>``
(:func:`group_position_id`), and one :class:`ecq.queue.delivery.Consumer` reading it, as any reader. That
consumer's connection is a :class:`GroupDispatch`, standing for the group's connected members: each delivery goes
to one member, chosen by ``scq_dispatch`` (EMQX's names: ``round_robin``, ``least_inflight``, ``random``), and its
PUBACK, from that member, acks the group's position. A member whose connection goes away before its PUBACK hands
the delivery on to another connected member (:meth:`GroupDispatch.publish`); with no member left the consumer
detaches and the group keeps its position (what was in flight is sent again on the next attach). A group with no
member and no delivery in flight (:meth:`GroupDispatch.settled`) is forgotten by the broker (ecq.broker.sessions):
its position is stored, and the next member starts from it. Each member has a
window of its own, ``reader_batch_size`` or its MQTT 5 Receive Maximum if lower, as one reader would; the group's
consumer keeps the sum of its members' windows in flight (:attr:`GroupDispatch.capacity`), so a group of 4 drains
about as fast as 4 readers rather than as one.

An entry whose delivery PUBLISH exceeds a member's MQTT 5 Maximum Packet Size (MQTT 5.0 section 3.1.2.11.4,
MQTT-3.1.2-24) goes to a member that takes it. When no connected member takes it, it is skipped for the group's
position as for a single reader (ecq.queue.oversize): not sent, counted, stored; later entries go on, and it is
handed out again when a member joins (one with a larger maximum may take it). Each member's deliveries carry the
Subscription Identifier of its own ``$share/<group>/$SCQ/<queue>/#`` (MQTT 5.0 section 3.3.4): the ``topic_filter``
given to ``send``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ecq.queue.delivery import Fits
from ecq.queue.oversize import NoConnectionTakes
from ecq.queue.topics import parse_scq_filter, position_id
from ecq.store.protocol import Message

SHARE_PREFIX = "$share/"
DISPATCH_STRATEGIES = ("round_robin", "least_inflight", "random")


def group_position_id(queue_id: str, group: str) -> str:
    """The id the position of the shared group ``group`` in the SCQ ``queue_id`` is saved under:
    ``$SCQ/<queue>/$share/<group>``. No client reads an SCQ under a client id starting ``$share/`` (refused at
    SUBSCRIBE), so no reader's position can be a group's."""
    return position_id(queue_id, f"{SHARE_PREFIX}{group}")


def group_filter(queue_id: str, group: str) -> str:
    """The filter a member of ``group`` subscribes to read the SCQ ``queue_id``: ``$share/<group>/$SCQ/<queue>/#``;
    the inverse of :func:`parse_group_filter`."""
    return f"{SHARE_PREFIX}{group}/{queue_id}/#"


def parse_group_filter(topic_filter: str) -> tuple[str, str] | None:
    """(group, SCQ queue id) of ``$share/<group>/$SCQ/<queue>/#`` (a ``<group>`` without ``+`` or ``#``, MQTT 5.0
    section 4.8.2; ``<queue>`` as for ``$SCQ/<queue>/#``), or None for any other filter."""
    if not topic_filter.startswith(SHARE_PREFIX):
        return None
    group, _, target = topic_filter[len(SHARE_PREFIX):].partition("/")
    queue = parse_scq_filter(target)
    if not group or "+" in group or "#" in group or queue is None:
        return None
    return group, queue


@dataclass(slots=True)
class Member:
    """A connected member of a group: its connection, the deliveries it holds unacked, at most ``cap`` of them, and
    ``fits``, its test of an entry's size (None: it takes every entry)."""

    connection: Any
    cap: int
    fits: Fits | None = None
    inflight: int = 0

    @property
    def has_room(self) -> bool:
        return self.inflight < self.cap

    def takes(self, topic: str, message: Message) -> bool:
        """True when the delivery of ``message`` on ``topic`` stays within this member's Maximum Packet Size."""
        return self.fits is None or self.fits(topic, message)


class GroupDispatch:
    """The connected members of one group, by client id, and the choice of the member for each delivery."""

    def __init__(self, strategy: str, window: int, topic_filter: str = "") -> None:
        """``strategy``: one of DISPATCH_STRATEGIES (``scq_dispatch``), else ValueError; ``window``: the deliveries
        a member holds unacked at most (``reader_batch_size``); ``topic_filter``: the group's filter
        (:func:`group_filter`), whose subscription each delivery answers."""
        if strategy not in DISPATCH_STRATEGIES:
            raise ValueError(f"scq_dispatch {strategy!r}: expected one of {', '.join(DISPATCH_STRATEGIES)}")
        self.strategy, self.window, self.topic_filter = strategy, window, topic_filter
        self.members: dict[str, Member] = {}  # in round-robin order: the member chosen moves to the end
        self.sending = 0                      # deliveries in flight, to members or to ones that left
        self._room = asyncio.Event()          # set when a member may take one more delivery, joins, or a send ends

    @property
    def capacity(self) -> int:
        """The deliveries the connected members take unacked together: the sum of their windows."""
        return sum(member.cap for member in self.members.values())

    def join(self, clientid: str, connection: Any, receive_maximum: int | None = None, fits: Fits | None = None
             ) -> None:
        """``clientid`` takes deliveries on ``connection`` (a newer connection of it replaces the older one), at
        most its window unacked at a time: ``window``, or its ``receive_maximum`` if lower (MQTT 5.0 section
        3.1.2.11.3; None: none given), only those ``fits`` passes (its Maximum Packet Size; None: every one)."""
        old = self.members.pop(clientid, None)
        cap = min(self.window, receive_maximum) if receive_maximum else self.window
        inflight = old.inflight if old and old.connection is connection else 0
        self.members[clientid] = Member(connection, cap, fits, inflight)
        self._room.set()

    def fits(self, topic: str, message: Message) -> bool:
        """True when a connected member takes the delivery of ``message`` on ``topic`` (the group consumer's
        ``fits``: an entry no member takes is skipped for the group's position, ecq.queue.oversize)."""
        return any(member.takes(topic, message) for member in self.members.values())

    def leave(self, clientid: str, connection: Any = None) -> None:
        """``clientid`` takes no new delivery (its connection closed, or it unsubscribed); with ``connection``,
        only when that is still the member's connection. Its deliveries in flight end with its PUBACKs or go to
        another member when its connection closes."""
        member = self.members.get(clientid)
        if member is not None and (connection is None or member.connection is connection):
            del self.members[clientid]
            self._room.set()  # a delivery waiting for room finds no member left, or another one

    async def settled(self) -> bool:
        """Wait until the group has no member and no delivery in flight (each ended with its PUBACK or its
        connection's close): True then; False once a member is connected."""
        while not self.members:
            if not self.sending:
                return True
            self._room.clear()
            await self._room.wait()
        return False

    def holds(self, clientid: str, connection: Any) -> bool:
        """True when ``connection`` is the member connection of ``clientid``."""
        member = self.members.get(clientid)
        return member is not None and member.connection is connection

    async def publish(self, send: Callable[..., Awaitable[None]], topic: str, payload: bytes, seqno: int,
                      ts_ms: int, expires_ms: int, dup: bool) -> None:
        """Send one delivery to a member that takes it with ``send(connection, topic, payload, seqno, ts_ms,
        expires_ms, dup, topic_filter=)`` (ecq.queue.delivery.Publish) and return once a member acked it; a member
        whose connection closes first leaves the group and the delivery goes to the next one chosen. Waits while
        every member that takes it holds as many as it takes. Raises ConnectionError once no member is left,
        ecq.queue.oversize.NoConnectionTakes once no connected member takes it (the one that did left)."""
        entry = Message(seqno, "", payload, ts_ms, expires_ms)  # what ``fits`` reads: the key is in ``topic``
        while True:
            clientid, member = await self._choose(topic, entry)
            member.inflight += 1
            self.sending += 1
            try:
                await send(member.connection, topic, payload, seqno, ts_ms, expires_ms, dup,
                           topic_filter=self.topic_filter)
                return
            except ConnectionError:
                self.leave(clientid, member.connection)
            finally:
                member.inflight -= 1
                self.sending -= 1
                self._room.set()

    async def _choose(self, topic: str, entry: Message) -> tuple[str, Member]:
        while True:
            if not self.members:
                raise ConnectionError("no member of the group is connected")
            takers = [(clientid, member) for clientid, member in self.members.items() if member.takes(topic, entry)]
            if not takers:
                raise NoConnectionTakes(f"no connected member of the group takes entry {entry.seqno}")
            ready = [(clientid, member) for clientid, member in takers if member.has_room]
            if ready:
                return self._pick(ready)
            self._room.clear()
            await self._room.wait()

    def _pick(self, ready: list[tuple[str, Member]]) -> tuple[str, Member]:
        if self.strategy == "random":
            return random.choice(ready)
        if self.strategy == "least_inflight":
            chosen = min(ready, key=lambda item: item[1].inflight)  # the first in round-robin order among equals
        else:
            chosen = ready[0]
        self.members[chosen[0]] = self.members.pop(chosen[0])  # to the end of the round-robin order
        return chosen
