"""A model-based test of ECQ's MQTT surface (issue 23), and the known bugs it must keep covering.

``test_the_broker_follows_the_queue_model`` is a hypothesis state machine (:class:`BrokerMachine`) that drives
real connections, raw MQTT 3.1.1 bytes over TCP and WebSocket (:mod:`tests.mqtt_wire`), against ONE running
`ecq broker` process: producers writing ``$ECQ/w/<cid>/<key>`` at QoS 0, 1 and 2 (DUP retransmits, PUBREL
resends, pipelined bursts that mix plain topics, one-shot publishers that disconnect at once or just close),
consumers connecting (clean and persistent), subscribing, acking in and out of order or not at all,
unsubscribing and then acking, disconnecting, closing, resetting, taken over, rewinding, and broker restarts
(SIGTERM and kill -9). After every step what the clients received is checked against :class:`QueueModel`, a
small model of each queue; a drain step (and the end of every run) checks that everything owed was delivered.

The model is exact where the guarantees are (docs/guarantees.md; MQTT 3.1.1 sections 3.14.4, 4.3, 4.4, 4.6)
and tolerant where they are not:

- a write is stored once its PUBACK (QoS 1) or PUBREC (QoS 2) was read, or, at QoS 0, once the broker read it
  (on a connection still open, or before a DISCONNECT or the end of the stream: section 3.14.4); a QoS 1 resend
  with DUP=1 may be stored twice (section 4.3.2), a QoS 2 resend never (4.3.3). A write whose acknowledgement
  was not read when the broker died may or may not be stored: each queue's ``last_seqno`` (admin API) after the
  restart says how many were, and they are a prefix, in arrival order, of that connection's writes to the queue.
  The admin API's ``last_seqno`` is also how the model learns that a QoS 0 write was stored;
- writes of one connection are stored in the order they arrived, whatever their QoS, so the newest value of each
  key is the last one sent; delivery is in seqno order within a stream (one attach, or one rewind);
- an ack the broker is proven to have read (a PINGRESP or the broker's close after it, or a later delivery that
  the window ``reader_batch_size`` only allows after it) is never delivered again; after kill -9 only an ack
  proven stored by the window counts (docs/guarantees.md: a PUBACK less than one commit before a crash may be lost).
  An ack not proven read (the connection was reset, taken over or the broker died) may or may not count;
- an unacked delivery may be delivered again; nothing expires or is evicted here (no retention, no quotas);
- and MQTT 3.1.1 itself: CONNACK's session present (3.2.2.2), a takeover closes the older connection (3.1.4),
  nothing is delivered after UNSUBACK (3.10.4), every PUBLISH and PUBREL is answered (4.3), acknowledgements
  leave in the order of the PUBLISHes (4.6).

Every network wait is bounded (``tests.mqtt_wire.WAIT_S``). The hypothesis profile comes from
``MQTT_MODEL_PROFILE``: ``ci`` (default, a few minutes, no shrinking) or ``soak`` (scripts/soak-model). A
failure prints its steps, the seed (``MQTT_MODEL_SEED`` draws the same runs again) and the ``@reproduce_failure``
blob (``print_blob``; put it on :class:`BrokerMachine`); the first failure of a test is also printed as it
happened, since a broker's timing can make hypothesis's replay of it differ.

The plain tests at the end pin the bugs of issue 23, points 1-8, each over real connections.
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest
import yaml
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from ecq.testing import BrokerProcess, free_port, wait_until
from tests.harness import metrics_text
from tests.mqtt_wire import (DISCONNECT_PACKET, PINGREQ_PACKET, PINGRESP, PUBACK, PUBCOMP, PUBLISH, PUBREC,
                             SUBACK, UNSUBACK, WAIT_S, Packet, WebSocket, WireClient, connect_packet, puback_packet,
                             publish_packet, pubrel_packet, subscribe_packet, unsubscribe_packet)

WINDOW = 3  # reader_batch_size of the model's broker: deliveries in flight per consumer
QUEUES = 2  # queue owners per run
KEYS = ("k0", "k1", "a/b")  # few keys, so compaction happens
FAR_FUTURE_MS = 4_000_000_000_000
NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]  # CI: a failure prints the run as it happened

settings.register_profile("mqtt-model-ci", max_examples=12, stateful_step_count=25, deadline=None,
                          derandomize=False, print_blob=True, database=None, phases=NO_SHRINK,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("mqtt-model-soak", max_examples=400, stateful_step_count=80, deadline=None,
                          derandomize=False, print_blob=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = os.environ.get("MQTT_MODEL_PROFILE", "ci")
MODEL_TIMEOUT_S = {"ci": 600, "soak": 6 * 3600}[PROFILE]


def last_seqno(broker: BrokerProcess, cid: str) -> int:
    """The last seqno of the queue of ``cid``, from the broker's admin API (0 for a queue never written): how many
    entries were ever appended to it (seqnos count from 1, one per entry, on LevelDB)."""
    url = f"http://127.0.0.1:{broker.admin_port}/api/v1/queues/{cid}"
    try:
        with urllib.request.urlopen(url, timeout=WAIT_S) as response:
            return json.load(response)["last_seqno"]
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return 0
        raise


def now_ms() -> int:
    """The wall clock in ms, as the broker stamps writes (ecq.queue.clock.now_ms)."""
    return time.time_ns() // 1_000_000


# ------------------------------------------------------------------------------------------------ the model

@dataclass
class Write:
    """One write: a PUBLISH to ``$ECQ/w/<cid>/<key>`` (and its resends). Its payload is unique in the run, so a
    delivery names its write. ``seqnos``: the queue entries it made (two for a QoS 1 resend stored twice);
    ``sent_ms``/``stored_ms`` bound the time the broker stamped on it."""

    cid: str
    key: str
    payload: bytes
    qos: int
    sent_ms: int
    acked: bool = False  # its PUBACK (PUBREC) was read when the broker stopped: it must be stored
    stored_ms: int = 0
    seqnos: list[int] = field(default_factory=list)


@dataclass
class Ack:
    """A PUBACK a consumer sent. ``read_tick``: when the broker was proven to have read it (None: not proven,
    it may or may not count); ``stored``: proven committed (a later delivery needed it), so it survives kill -9."""

    read_tick: int | None = None
    stored: bool = False


@dataclass
class Stream:
    """The deliveries of one queue to one connection since one start (an attach, or a rewind while attached):
    in seqno order, nothing stored under ``floor``, nothing compacted away or acked before ``start_tick``."""

    start_tick: int
    floor: int
    last: int = 0
    received: int = 0
    delivered: set[int] = field(default_factory=set)
    acks: list[Ack] = field(default_factory=list)  # the acks of this stream's deliveries, in the order sent
    rewound: bool = False  # a rewind came after it: late PUBACKs of its deliveries count for nothing


class QueueModel:
    """The reference model of the queue of ``cid``: its entries (seqno -> write), compaction, the ack state,
    and which deliveries a stream may hold."""

    def __init__(self, cid: str) -> None:
        self.cid = cid
        self.entries: dict[int, Write] = {}
        self.superseded: dict[int, int] = {}  # seqno -> tick at which a newer value of its key was known stored
        self.newest: dict[str, int] = {}
        self.writes: dict[bytes, Write] = {}  # by payload
        self.last_seqno = 0
        self.floor = 0  # seqnos at or below it are never delivered again (a rewind's point)
        self.acks: dict[int, Ack] = {}

    def append(self, write: Write, count: int, tick: int) -> None:
        """``count`` entries of ``write`` were committed (ticks are the model's clock)."""
        for _ in range(count):
            self.last_seqno += 1
            if (older := self.newest.get(write.key)) is not None:
                self.superseded.setdefault(older, tick)
            self.newest[write.key] = self.last_seqno
            self.entries[self.last_seqno] = write
            write.seqnos.append(self.last_seqno)
        self.writes[write.payload] = write
        write.stored_ms = now_ms()

    def stored(self) -> list[int]:
        """Seqnos the broker stores now (the newest value of each key), ascending."""
        return sorted(self.newest.values())

    def owed(self) -> set[int]:
        """Seqnos that an attached consumer must get: stored, above the floor, not acked (an ack that may or may
        not count excuses it)."""
        return {s for s in self.stored() if s > self.floor and s not in self.acks}

    def certainly_acked(self, seqno: int, before_tick: int) -> bool:
        """True when an ack of ``seqno`` was proven read before ``before_tick``."""
        ack = self.acks.get(seqno)
        return ack is not None and ack.read_tick is not None and ack.read_tick < before_tick

    def match(self, stream: Stream, key: str, payload: bytes) -> int | None:
        """The seqno a delivery of ``key``=``payload`` on ``stream`` can be (the lowest the model allows), or None."""
        write = self.writes.get(payload)
        if write is None or write.key != key:
            return None
        return next((s for s in write.seqnos if not self._why_not(stream, s)), None)

    def deliver(self, stream: Stream, key: str, payload: bytes, tick: int) -> int:
        """A delivery arrived on ``stream``: returns its seqno; raises AssertionError when the model forbids it.
        The ``reader_batch_size`` window proves the oldest acks of the stream stored: the broker sends nothing new
        to a consumer before the acks it read are stored, and at most WINDOW deliveries are unacked."""
        seqno = self.match(stream, key, payload)
        if seqno is None:
            write = self.writes.get(payload)
            assert write is not None and write.key == key, (
                f"{self.cid}: delivered {key!r}={payload!r}, which was never stored in this queue")
            raise AssertionError(f"{self.cid}: delivery of {key!r}={payload!r} (seqnos {write.seqnos}): " + "; ".join(
                self._why_not(stream, s) for s in write.seqnos))
        stream.last, stream.received = seqno, stream.received + 1
        stream.delivered.update(self.writes[payload].seqnos)  # twins of a resend: the consumer cannot tell them apart
        for ack in stream.acks[:max(0, stream.received - WINDOW)]:
            ack.stored, ack.read_tick = True, tick if ack.read_tick is None else ack.read_tick
        return seqno

    def _why_not(self, stream: Stream, seqno: int) -> str:
        if seqno <= stream.last:
            return f"seqno {seqno} after {stream.last}: out of seqno order or twice in one stream"
        if seqno <= stream.floor:
            return f"seqno {seqno} is at or below the rewind point {stream.floor}"
        if (superseded := self.superseded.get(seqno)) is not None and superseded < stream.start_tick:
            newer = self.newest[self.entries[seqno].key]
            return f"seqno {seqno} was compacted away (by seqno {newer}) before the stream began"
        if self.certainly_acked(seqno, stream.start_tick):
            return f"seqno {seqno} was acked (and the broker read the PUBACK) before the stream began"
        return ""

    def rewind_point(self, kind: str, value: int = 0) -> int | None:
        """The acked seqno a rewind payload sets (docs/topics.md, "Rewind"); None when it is refused (a seqno above the
        last one, issue 23 point 8)."""
        stored = self.stored()
        if kind == "seqno":
            return value if value <= self.last_seqno else None
        if kind == "earliest":
            return stored[0] - 1 if stored else 0
        if kind == "since":
            return next((s - 1 for s in stored if self.entries[s].sent_ms >= value), self.last_seqno)
        return self.last_seqno

    def since_boundaries(self) -> list[int]:
        """Times T for which ``since:T`` has one answer: the send time of a stored entry that every older stored
        entry was stamped before."""
        stored, times = self.stored(), []
        for index, seqno in enumerate(stored):
            sent = self.entries[seqno].sent_ms
            if all(self.entries[s].stored_ms < sent for s in stored[:index]):  # each stamped at or before stored_ms
                times.append(sent)
        return times

    def rewind(self, point: int) -> None:
        """A rewind to ``point``: everything stored above it is owed again, nothing at or below it."""
        self.floor, self.acks = point, {}

    def crash(self) -> None:
        """kill -9: an ack not proven stored may be lost."""
        for ack in self.acks.values():
            if not ack.stored:
                ack.read_tick = None


# ----------------------------------------------------------------------------------------- the connections

@dataclass
class Link:
    """One connection of a client: its wire, and for a consumer the stream it is attached to and the deliveries
    it has not acked yet (packet id -> (stream, seqno))."""

    wire: WireClient
    client_id: str
    clean: bool
    stream: Stream | None = None
    rewinding: Stream | None = None  # between a rewind PUBLISH and its PUBACK: the stream the rewind starts
    unacked: dict[int, tuple[Stream, int]] = field(default_factory=dict)
    acks: list[Ack] = field(default_factory=list)  # acks sent on this link and not yet proven read


@dataclass
class Session:
    """What the broker keeps of a clientid's MQTT session: persistent or not, holding ``$ECQ/<cid>/#`` or not."""

    persistent: bool
    subscribed: bool = False


def _step(method, logged: bool = True):
    """Run a rule (``logged``: noted in the run's steps) or an invariant, marked as running so that teardown knows
    whether the run ended normally. A failure gets the end of the broker's log as a note, and the first failure of
    a test is printed with the steps that led to it: a broker's timing can make hypothesis's replay of a failing
    run differ (it then reports a flaky test, without the original failure)."""
    @functools.wraps(method)
    def run(self, **kwargs):
        self.running = method.__name__
        if logged:
            self.steps.append(f"{method.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
        try:
            method(self, **kwargs)
        except Exception as exc:
            exc.add_note("broker log, last lines:\n" + "\n".join(self.broker.log().splitlines()[-12:]))
            self.report_first_failure(exc)
            raise
        self.running = None
    return run


transports = st.sampled_from(["tcp", "ws"])
queues = st.integers(0, QUEUES - 1)
keys = st.sampled_from(KEYS)


class BrokerMachine(RuleBasedStateMachine):
    """The state machine; ``broker`` and ``ws_port`` are set on a subclass by the test before it runs."""

    broker: BrokerProcess
    ws_port: int
    runs = 0
    failure_reported = False  # set on the subclass of one test

    def __init__(self) -> None:
        super().__init__()
        BrokerMachine.runs += 1
        self.prefix = f"r{BrokerMachine.runs}"
        self.cids = [f"{self.prefix}c{i}" for i in range(QUEUES)]
        self.queues = {cid: QueueModel(cid) for cid in self.cids}
        self.tick = 0
        self.serial = 0
        self.consumers: dict[str, Link | None] = dict.fromkeys(self.cids)
        self.sessions: dict[str, Session | None] = {}
        self.producers: dict[str, Link] = {}
        self.running: str | None = None
        self.steps: list[str] = []
        if not self.broker.proc or self.broker.proc.poll() is not None:
            self._start_broker()

    def report_first_failure(self, exc: BaseException) -> None:
        """Print the first failure of this test with its run's steps (pytest shows it with the failure)."""
        if type(self).failure_reported:
            return
        type(self).failure_reported = True
        print(f"first failure, run {self.prefix}, in {self.running}: {type(exc).__name__}: {exc}")
        print("steps:\n  " + "\n  ".join(self.steps))

    # -- small helpers

    def _start_broker(self) -> None:
        self.broker.start()
        assert wait_until(lambda: websocket_accepts(self.ws_port), WAIT_S), "the WebSocket listener did not open"

    def _tick(self) -> int:
        self.tick += 1
        return self.tick

    def _next(self) -> int:
        self.serial += 1
        return self.serial

    def _port(self, transport: str) -> int:
        return self.ws_port if transport == "ws" else self.broker.port

    def _connect(self, client_id: str, clean: bool, transport: str) -> Link:
        """Connect and check CONNACK's session present against the model (MQTT 3.1.1 section 3.2.2.2)."""
        session = self.sessions.get(client_id)
        try:
            wire, present = WireClient.connected(self._port(transport), client_id, clean, transport)
        except TimeoutError:
            raise AssertionError(f"{client_id} ({transport}, clean {clean}): no CONNACK within {WAIT_S} s") from None
        expected = not clean and session is not None and session.persistent
        assert present == expected, f"{client_id}: CONNACK session present {present}, expected {expected}"
        if clean or not expected:
            self.sessions[client_id] = Session(persistent=not clean)
        return Link(wire, client_id, clean)

    def _last_seqno(self, cid: str) -> int:
        return last_seqno(self.broker, cid)

    def _stored(self, writes: list[Write], may_be_twice: bool = False) -> None:
        """``writes`` (in arrival order) were read by the broker, so they are stored: wait until each queue's last
        seqno shows them, then record them. ``may_be_twice``: the last one (a QoS 1 resend) may have made two
        entries (MQTT 3.1.1 section 4.3.2)."""
        for cid in dict.fromkeys(w.cid for w in writes):
            queue, mine = self.queues[cid], [w for w in writes if w.cid == cid]
            wait_until(lambda: self._last_seqno(cid) >= queue.last_seqno + len(mine), WAIT_S)
            made = self._last_seqno(cid) - queue.last_seqno
            written = [f"{w.key}={w.payload!r} (QoS {w.qos})" for w in mine]
            assert len(mine) <= made <= len(mine) + may_be_twice, (
                f"{cid}: {made} entries stored for the writes {written}")
            tick = self._tick()
            for w in mine:
                queue.append(w, 1 + (made - len(mine) if w is mine[-1] else 0), tick)

    def _new_write(self, cid: str, key: str, qos: int) -> Write:
        payload = f"{self.prefix}-w{self._next()}".encode()
        return Write(cid, key, payload, qos, sent_ms=now_ms())

    def _producer(self, index: int) -> Link:
        """Producer ``index`` (0 and 2 on TCP, 1 on WebSocket), connected if it was not."""
        name = f"{self.prefix}p{index}"
        link = self.producers.get(name)
        if link is None or link.wire.ended:
            link = self.producers[name] = self._connect(name, True, "ws" if index == 1 else "tcp")
        return link

    def _expect(self, link: Link, kind: int, packet_id: int | None = None, tolerated: int | None = None) -> Packet:
        """The next packet on ``link`` must be ``kind`` (with ``packet_id``); deliveries on the way are taken, and
        packets of type ``tolerated`` for the same packet id skipped."""
        while True:
            try:
                packet = link.wire.next()
            except TimeoutError:
                raise AssertionError(f"{link.client_id} ({link.wire.transport_name}): no packet type {kind} "
                                     f"(packet id {packet_id}) within {WAIT_S} s") from None
            assert packet is not None, f"{link.client_id}: the broker closed the connection; waited for type {kind}"
            if packet.kind == PUBLISH:
                self._take_delivery(link, packet)
                continue
            if packet.kind == tolerated and packet.packet_id == packet_id:
                continue
            assert packet.kind == kind, f"{link.client_id}: got packet type {packet.kind}, expected {kind}"
            assert packet_id is None or packet.packet_id == packet_id, (
                f"{link.client_id}: type {kind} for packet id {packet.packet_id}, expected {packet_id}")
            return packet

    def _take_delivery(self, link: Link, packet: Packet) -> None:
        """A PUBLISH from the broker on a consumer link: it must fit the model."""
        publish = packet.publish()
        cid = link.client_id
        assert cid in self.queues, f"{cid}: a producer received a PUBLISH {publish}"
        prefix, queue = f"$ECQ/{cid}/", self.queues[cid]
        assert publish.topic.startswith(prefix) and publish.qos == 1, f"{cid}: unexpected delivery {publish}"
        key, stream = publish.topic[len(prefix):], link.stream
        assert stream is not None, f"{cid}: delivery {publish} on a connection not subscribed to {prefix}#"
        if link.rewinding is not None and queue.match(stream, key, publish.payload) is None:
            stream, link.stream, link.rewinding = link.rewinding, link.rewinding, None  # the rewound stream began
        seqno = queue.deliver(stream, key, publish.payload, self._tick())
        link.unacked[publish.packet_id] = (stream, seqno)

    def _receive(self, link: Link, timeout: float = 0.0) -> None:
        """Take what arrived on ``link``: deliveries on a consumer; nothing else is expected."""
        for packet in link.wire.available(timeout):
            assert packet.kind == PUBLISH, f"{link.client_id}: unexpected packet type {packet.kind}"
            self._take_delivery(link, packet)
        assert not link.wire.ended, f"{link.client_id}: the broker closed the connection"

    def _ping(self, link: Link) -> None:
        """PINGREQ until PINGRESP: every PUBACK sent before it was read by the broker."""
        link.wire.send(PINGREQ_PACKET)
        self._expect(link, PINGRESP)
        self._proven_read(link)

    def _proven_read(self, link: Link) -> None:
        tick = self._tick()
        for ack in link.acks:
            ack.read_tick = tick if ack.read_tick is None else ack.read_tick
        link.acks.clear()

    def _ack(self, link: Link, packet_ids: list[int]) -> None:
        """PUBACK the deliveries ``packet_ids`` of ``link``, in that order, in one write."""
        link.wire.send(*(puback_packet(pid) for pid in packet_ids))
        queue = self.queues[link.client_id]
        for pid in packet_ids:
            stream, seqno = link.unacked.pop(pid)
            twins = queue.entries[seqno].seqnos
            for acked in twins:
                queue.acks[acked] = ack = Ack()
            if stream.rewound or len(twins) > 1:
                # docs/topics.md: a late PUBACK of a delivery from before a rewind counts for nothing, and a write
                # stored twice (a QoS 1 resend) makes two deliveries the consumer cannot tell apart: such a PUBACK
                # may or may not count for the entry the model has in mind, so it is never proven (a stand-in keeps
                # its place in the stream's acks, which the window counts)
                stream.acks.append(Ack())
                continue
            link.acks.append(ack)
            stream.acks.append(ack)

    def _end(self, link: Link) -> None:
        """``link`` is closed: its stream ends, a clean session ends with it."""
        link.stream = link.rewinding = None
        session = self.sessions.get(link.client_id)
        if session is not None and not session.persistent and self._live(link.client_id) in (None, link):
            self.sessions[link.client_id] = None
        if self.consumers.get(link.client_id) is link:
            self.consumers[link.client_id] = None

    def _live(self, cid: str) -> Link | None:
        """The newest connection of queue owner ``cid``."""
        return self.consumers.get(cid)

    def _start_stream(self, cid: str, link: Link, tick: int) -> None:
        link.stream = Stream(start_tick=tick, floor=self.queues[cid].floor)

    # -- producers

    @rule(producer=st.integers(0, 2), cid=queues, key=keys, qos=st.sampled_from([0, 1, 2]),
          resend=st.sampled_from(["none", "publish", "publish-after-ack", "pubrel", "reconnect"]))
    @_step
    def write(self, producer, cid, key, qos, resend):
        """One write from a long-lived producer; at QoS 1/2 maybe resent with DUP=1 before or after its
        acknowledgement was read (the ack was lost), a PUBREL resent, or the PUBLISH resent on a new connection
        after a reset."""
        link, cid = self._producer(producer), self.cids[cid]
        write, pid = self._new_write(cid, key, qos), self._next() % 65535 + 1
        packet = functools.partial(publish_packet, f"$ECQ/w/{cid}/{key}", write.payload, qos, pid)
        link.wire.send(packet())
        if qos == 0:
            self._stored([write])
            return
        if resend == "reconnect" and qos == 1:
            link.wire.reset()
            link = self.producers[link.client_id] = self._connect(link.client_id, True, link.wire.transport_name)
            link.wire.send(packet(dup=True))
            self._expect(link, PUBACK, pid)
            self._stored([write], may_be_twice=True)
            return
        if resend == "publish":
            link.wire.send(packet(dup=True))
        ack = PUBACK if qos == 1 else PUBREC
        self._expect(link, ack, pid)
        if resend == "publish":
            self._expect(link, ack, pid)  # every PUBLISH is acknowledged (sections 4.3.2, 4.3.3)
        if resend == "publish-after-ack":
            link.wire.send(packet(dup=True))
            self._expect(link, ack, pid)
        if qos == 2:
            link.wire.send(pubrel_packet(pid), *([pubrel_packet(pid)] if resend == "pubrel" else []))
            self._expect(link, PUBCOMP, pid)
            if resend == "pubrel":
                self._expect(link, PUBCOMP, pid)  # "MUST respond to a PUBREL packet by sending a PUBCOMP" (4.3.3)
        self._stored([write], may_be_twice=qos == 1 and resend in ("publish", "publish-after-ack"))

    @rule(cid=queues, key=keys, transport=transports, reset=st.booleans(),
          resend=st.sampled_from(["publish", "pubrel"]))
    @_step
    def qos2_resent_after_a_persistent_reconnect(self, cid, key, transport, reset, resend):
        """QoS 2 PUBLISH, PUBREC read, connection lost before PUBCOMP, persistent reconnect; then the PUBLISH
        resent with DUP=1 (the PUBREC was lost) and PUBREL, or the PUBREL resent (MQTT-4.4.0-1): stored once,
        and the flow ends with PUBCOMP (section 4.3.3: the packet id awaits PUBREL in the session)."""
        cid, name = self.cids[cid], f"{self.prefix}q2{transport}"
        write, pid = self._new_write(cid, key, 2), self._next() % 65535 + 1
        packet = functools.partial(publish_packet, f"$ECQ/w/{cid}/{key}", write.payload, 2, pid)
        link = self._connect(name, False, transport)
        link.wire.send(packet())
        self._expect(link, PUBREC, pid)
        if resend == "pubrel":
            link.wire.send(pubrel_packet(pid))
        if reset:
            link.wire.reset()
        else:
            link.wire.send(DISCONNECT_PACKET)
            link.wire.until_closed()
        link = self._connect(name, False, transport)
        if resend == "publish":
            link.wire.send(packet(dup=True))
            self._expect(link, PUBREC, pid)
        link.wire.send(pubrel_packet(pid))
        self._expect(link, PUBCOMP, pid, tolerated=PUBREC)  # a broker may resend PUBREC on reconnect
        link.wire.send(DISCONNECT_PACKET)
        link.wire.until_closed()
        self._stored([write])

    @rule(writes=st.lists(st.tuples(queues, keys, st.sampled_from([0, 1, 2])), min_size=1, max_size=3),
          transport=transports, wait_for_acks=st.booleans(), ending=st.sampled_from(["disconnect", "close"]),
          one_send=st.booleans())
    @_step
    def one_shot(self, writes, transport, wait_for_acks, ending, one_send):
        """A publisher that connects, publishes and leaves at once (mosquitto_pub): with DISCONNECT or by just
        closing, in one send or one send per packet, with or without waiting for the acknowledgements.
        Every PUBLISH the broker read before DISCONNECT or the end of the stream is stored (section 3.14.4)."""
        made = [self._new_write(self.cids[cid], key, qos) for cid, key, qos in writes]
        client_id = f"{self.prefix}o{self._next()}"
        link = Link(WireClient(self._port(transport), transport), client_id, clean=True)
        sent = self._publishes(made)
        packets = [connect_packet(client_id), *(packet for packet, _qos, _pid in sent)]
        ending_packets = [DISCONNECT_PACKET] if ending == "disconnect" else []
        if one_send and not wait_for_acks:
            link.wire.send(*packets, *ending_packets)
        else:
            for packet in packets:
                link.wire.send(packet)
            if wait_for_acks:
                assert link.wire.read_connack() is False
                self._acknowledged(link, sent)
            link.wire.send(*ending_packets)
        link.wire.close()
        self._stored(made)

    def _publishes(self, items: list[Write | str]) -> list[tuple[bytes, int, int]]:
        """(PUBLISH packet, QoS, packet id) of each of ``items``: a write, or a plain topic for a plain QoS 1
        PUBLISH."""
        sent = []
        for item in items:
            pid = self._next() % 65535 + 1
            topic, payload, qos = (item, b"plain", 1) if isinstance(item, str) else (
                f"$ECQ/w/{item.cid}/{item.key}", item.payload, item.qos)
            sent.append((publish_packet(topic, payload, qos, pid if qos else None), qos, pid))
        return sent

    def _acknowledged(self, link: Link, sent: list[tuple[bytes, int, int]]) -> None:
        """Read the acknowledgements of pipelined PUBLISHes (see :meth:`_publishes`): PUBACKs in the order of the
        QoS 1 PUBLISHes, PUBRECs in the order of the QoS 2 ones (MQTT 3.1.1 section 4.6; either QoS may come
        first); then PUBREL each QoS 2 one and read its PUBCOMP."""
        order = {qos: [pid for _packet, q, pid in sent if q == qos] for qos in (1, 2)}
        answers = {PUBACK: [], PUBREC: []}
        while len(answers[PUBACK]) < len(order[1]) or len(answers[PUBREC]) < len(order[2]):
            try:
                packet = link.wire.next()
            except TimeoutError:
                raise AssertionError(f"{link.client_id}: {answers} of {order} acknowledged within {WAIT_S} s") from None
            assert packet is not None, f"{link.client_id}: the broker closed the connection; acknowledged {answers}"
            assert packet.kind in answers, f"{link.client_id}: unexpected packet type {packet.kind}"
            answers[packet.kind].append(packet.packet_id)
        assert answers[PUBACK] == order[1], f"PUBACKs {answers[PUBACK]} for QoS 1 PUBLISHes {order[1]}"
        assert answers[PUBREC] == order[2], f"PUBRECs {answers[PUBREC]} for QoS 2 PUBLISHes {order[2]}"
        link.wire.send(*(pubrel_packet(pid) for pid in order[2]))
        assert [self._expect(link, PUBCOMP).packet_id for _ in order[2]] == order[2]

    @rule(producer=st.integers(0, 2),
          items=st.lists(st.tuples(st.integers(0, QUEUES), keys, st.sampled_from([0, 1, 2])), min_size=2,
                         max_size=8))
    @_step
    def burst(self, producer, items):
        """Pipelined PUBLISHes in one write, ECQ writes at QoS 0/1/2 mixed with plain QoS 1 topics (a queue
        index of QUEUES): acknowledged in order, and every write stored in arrival order."""
        link = self._producer(producer)
        made = [f"plain/{key}" if queue == QUEUES else self._new_write(self.cids[queue], key, qos)
                for queue, key, qos in items]
        sent = self._publishes(made)
        link.wire.send(*(packet for packet, _qos, _pid in sent))
        self._acknowledged(link, sent)
        self._stored([w for w in made if isinstance(w, Write)])

    # -- consumers

    @rule(cid=queues, clean=st.booleans(), transport=transports)
    @_step
    def consumer_connects(self, cid, clean, transport):
        """The owner connects; a connection it already has is taken over (closed by the broker, section 3.1.4).
        A persistent session that holds its queue's subscription resumes delivery at once."""
        cid = self.cids[cid]
        old = self._live(cid)
        if old is not None and old.clean and not clean:
            # amqtt 0.12.1 gives a CleanSession=0 CONNECT that takes over a live CleanSession=1 connection that clean
            # session (session present 1, its subscriptions): known and in docs/guarantees.md ("MQTT conformance", not
            # changed). The clean connection leaves first, so that the rest of the run is checked exactly.
            self._leave(old, "disconnect")
            old = None
        tick = self._tick()
        link = self._connect(cid, clean, transport)
        self.consumers[cid] = link
        if old is not None:
            self._taken_over(old)
        session = self.sessions[cid]
        if session.subscribed:
            self._start_stream(cid, link, tick)

    def _taken_over(self, old: Link) -> None:
        """The broker closes the older connection of a clientid that connects again (MQTT-3.1.4-2)."""
        try:
            packets = old.wire.until_closed()
        except TimeoutError:
            raise AssertionError(f"{old.client_id}: older connection open {WAIT_S} s after a takeover") from None
        for packet in packets:
            assert packet.kind == PUBLISH, f"{old.client_id}: unexpected packet type {packet.kind} on takeover"
            self._take_delivery(old, packet)
        self._end(old)

    @rule(cid=queues, qos=st.sampled_from([1, 2]))
    @_step
    def consumer_subscribes(self, cid, qos):
        """SUBSCRIBE to ``$ECQ/<cid>/#``: granted QoS 1, delivery starts from the stored ack state."""
        cid = self.cids[cid]
        link, session = self._live(cid), self.sessions.get(cid)
        if link is not None and not session.subscribed:
            self._subscribe(cid, link, qos)

    def _subscribe(self, cid: str, link: Link, qos: int) -> None:
        pid = self._next() % 65535 + 1
        self._start_stream(cid, link, self._tick())
        self.sessions[cid].subscribed = True
        link.wire.send(subscribe_packet(pid, (f"$ECQ/{cid}/#", qos)))
        suback = self._expect(link, SUBACK, pid)
        assert suback.body[2:] == b"\x01", f"{cid}: SUBACK {suback.body[2:]!r}, expected QoS 1 granted"

    @rule(cid=queues, picks=st.lists(st.integers(0, 2 * WINDOW), min_size=1, max_size=WINDOW + 1),
          confirm=st.booleans())
    @_step
    def consumer_acks(self, cid, picks, confirm):
        """PUBACK some of the deliveries not yet acked, in any order (a PINGREQ after them proves them read).
        ``picks`` index the unacked deliveries in arrival order (modulo their number): drawn whatever the broker
        sent, so that a replay draws the same."""
        link = self._live(self.cids[cid])
        if link is None or not link.unacked:
            return
        pending = list(link.unacked)
        chosen = list(dict.fromkeys(pending[pick % len(pending)] for pick in picks))
        self._ack(link, chosen)
        if confirm:
            self._ping(link)

    @rule(cid=queues, ack_after=st.booleans())
    @_step
    def consumer_unsubscribes(self, cid, ack_after):
        """UNSUBSCRIBE ``$ECQ/<cid>/#``: nothing new is delivered after UNSUBACK; PUBACKs of what was in flight
        still count (MQTT-3.10.4-3)."""
        cid = self.cids[cid]
        link, session = self._live(cid), self.sessions.get(cid)
        if link is None or session is None or not session.subscribed:
            return
        pid = self._next() % 65535 + 1
        link.wire.send(unsubscribe_packet(pid, f"$ECQ/{cid}/#"))
        self._expect(link, UNSUBACK, pid)
        session.subscribed = False
        link.stream = None
        if ack_after and link.unacked:
            self._ack(link, sorted(link.unacked))
            self._ping(link)

    @rule(cid=queues, how=st.sampled_from(["disconnect", "close", "reset"]))
    @_step
    def consumer_leaves(self, cid, how):
        """DISCONNECT (or a plain close), each waiting for the broker's close, which proves every PUBACK before it
        was read; or a reset, after which a PUBACK just sent may or may not count."""
        link = self._live(self.cids[cid])
        if link is not None:
            self._leave(link, how)

    def _leave(self, link: Link, how: str) -> None:
        if how == "reset":
            link.wire.reset()
        else:
            if how == "disconnect":
                link.wire.send(DISCONNECT_PACKET)
            else:
                link.wire.transport.sock.shutdown(1)  # FIN, still reading
            for packet in link.wire.until_closed():
                assert packet.kind == PUBLISH, f"{link.client_id}: unexpected packet type {packet.kind}"
                self._take_delivery(link, packet)
            self._proven_read(link)
            link.wire.close()
        self._end(link)

    @rule(cid=queues, kind=st.sampled_from(["seqno", "beyond", "earliest", "latest", "since", "since-far"]),
          pick=st.integers(0, 100))
    @_step
    def consumer_rewinds(self, cid, kind, pick):
        """The owner publishes ``$ECQ/ctl/<cid>/rewind`` (docs/topics.md, "Rewind"); a seqno above the last one is
        refused (still PUBACKed) and changes nothing. ``pick`` chooses the seqno or time (modulo the choices)."""
        cid = self.cids[cid]
        link, queue = self._live(cid), self.queues[cid]
        if link is None:
            return
        if kind in ("seqno", "beyond"):
            beyond = [queue.last_seqno + 1, 1767225600000]  # docs/topics.md's example without since: (issue 23 point 8)
            value = pick % (queue.last_seqno + 1) if kind == "seqno" else beyond[pick % 2]
            payload, point = str(value), queue.rewind_point("seqno", value)
        elif kind in ("since", "since-far"):
            times = [0, *queue.since_boundaries()]
            value = FAR_FUTURE_MS if kind == "since-far" else times[pick % len(times)]
            payload, point = f"since:{value}", queue.rewind_point("since", value)
        else:
            payload, point = kind, queue.rewind_point(kind)
        pid = self._next() % 65535 + 1
        tick = self._tick()
        link.wire.send(publish_packet(f"$ECQ/ctl/{cid}/rewind", payload.encode(), 1, pid))
        if point is not None:  # applied between this PUBLISH and its PUBACK
            queue.rewind(point)
            for stream in [link.stream, *(stream for stream, _seqno in link.unacked.values())]:
                if stream is not None:
                    stream.rewound = True
            if link.stream is not None:
                link.rewinding = Stream(start_tick=tick, floor=point)
        self._expect(link, PUBACK, pid)
        if link.rewinding is not None:  # nothing of the new stream came yet: it begins now
            link.stream, link.rewinding = link.rewinding, None

    @rule(kill=st.booleans(), producer=st.integers(0, 2),
          inflight=st.lists(st.tuples(queues, keys, st.sampled_from([0, 1, 2])), max_size=4))
    @_step
    def broker_restarts(self, kill, producer, inflight):
        """SIGTERM or kill -9 right after pipelined writes whose acknowledgements were not read; then a restart.
        Writes acknowledged before the end are stored; the others may be (a prefix per queue, in arrival order).
        Every connection ends; clean sessions end with them, persistent ones are kept (stored before each CONNACK,
        SUBACK and UNSUBACK, ecq.broker.stored_sessions)."""
        link = self._producer(producer)
        made = [self._new_write(self.cids[cid], key, qos) for cid, key, qos in inflight]
        sent = self._publishes(made)
        link.wire.send(*(packet for packet, _qos, _pid in sent))
        if kill:
            self.broker.kill()
        else:
            self._stop_cleanly()
        acked = {p.packet_id for p in link.wire.until_closed() if p.kind in (PUBACK, PUBREC)}
        for w, (_packet, qos, pid) in zip(made, sent):
            w.acked = qos > 0 and pid in acked
        late = {}
        for other in [*self.producers.values(), *(c for c in self.consumers.values() if c is not None)]:
            late[id(other)] = (other, [] if other is link else other.wire.until_closed())
        self._start_broker()
        self._resolve(made)
        if kill:
            for queue in self.queues.values():
                queue.crash()
        for other, packets in late.values():
            for packet in packets:
                if packet.kind == PUBLISH and other.client_id in self.queues:
                    self._take_delivery(other, packet)
            other.wire.close()
            self._end(other)
        self.producers.clear()
        self.sessions = {cid: s for cid, s in self.sessions.items() if s is not None and s.persistent}

    def _stop_cleanly(self) -> None:
        """SIGTERM: the broker exits 0 within 15 s (docs/configuration.md, "Running the broker"); if not, it is
        killed and started again (for the next run) before the step fails."""
        try:
            code = self.broker.stop()
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            self.broker.kill()
            self._start_broker()
            raise AssertionError(f"SIGTERM: the broker exited with {code} (None: still running after 15 s)")

    def _resolve(self, made: list[Write]) -> None:
        """After a restart: how many of the unacknowledged writes ``made`` each queue stored (a prefix)."""
        tick = self._tick()
        for cid in dict.fromkeys(w.cid for w in made):
            queue, mine = self.queues[cid], [w for w in made if w.cid == cid]
            count = self._last_seqno(cid) - queue.last_seqno
            must = max((i + 1 for i, w in enumerate(mine) if w.acked), default=0)
            assert must <= count <= len(mine), (
                f"{cid}: {count} of the writes {[(w.key, w.payload, w.qos, w.acked) for w in mine]} stored after "
                f"the restart; the first {must} were acknowledged")
            for w in mine[:count]:
                queue.append(w, 1, tick)

    @rule(cid=queues)
    @_step
    def drain(self, cid):
        """An attached consumer that acks everything gets every entry it is owed (bounded wait)."""
        cid = self.cids[cid]
        link = self._live(cid)
        if link is None or link.stream is None:
            return
        self._drain(cid, link)

    def _drain(self, cid: str, link: Link) -> None:
        """Ack every delivery as it comes until ``link``'s stream holds every entry the queue owes (WAIT_S)."""
        queue = self.queues[cid]
        if link.unacked:
            self._ack(link, sorted(link.unacked))
        self._ping(link)
        deadline = time.monotonic() + WAIT_S
        while (missing := queue.owed() - link.stream.delivered) and time.monotonic() < deadline:
            self._receive(link, 0.2)
            if link.unacked:
                self._ack(link, sorted(link.unacked))
            self._ping(link)
        assert not missing, f"{cid}: never delivered: " + ", ".join(
            f"seqno {s} {queue.entries[s].key}={queue.entries[s].payload!r} (QoS {queue.entries[s].qos})"
            for s in sorted(missing))

    @invariant()
    @functools.partial(_step, logged=False)
    def deliveries_fit_the_model(self):
        """Whatever the consumers received since the last step fits the model; nothing came to the producers."""
        for link in [*(c for c in self.consumers.values() if c is not None), *self.producers.values()]:
            self._receive(link)

    def teardown(self):
        """Unless a step failed: every queue is drained by a consumer; then every connection is closed."""
        try:
            if self.running is None:
                for cid in self.cids:
                    link = self._live(cid)
                    if link is None:
                        link = self.consumers[cid] = self._connect(cid, True, "tcp")
                    if link.stream is None:
                        self._subscribe(cid, link, 1)
                    self._drain(cid, link)
        finally:
            for link in [*self.producers.values(), *(c for c in self.consumers.values() if c is not None)]:
                link.wire.close()



def with_websocket_listener(broker: BrokerProcess) -> int:
    """Add a ``type: ws`` listener on a free port to ``broker``'s config (not started yet); returns its port."""
    port = free_port()
    config = yaml.safe_load(broker.config_path.read_text())
    config["listeners"]["ws"] = {"type": "ws", "bind": f"127.0.0.1:{port}"}
    broker.config_path.write_text(yaml.safe_dump(config))
    return port


def websocket_accepts(port: int) -> bool:
    """True when a WebSocket opening handshake with 127.0.0.1:``port`` succeeds."""
    try:
        WebSocket(port).close()
        return True
    except OSError:  # refused, timed out, or the handshake failed (ConnectionError)
        return False


@pytest.fixture
def ws_broker(broker_process):
    """Factory: ws_broker(**plugin_options) -> (started BrokerProcess with a WebSocket listener too, its port)."""
    def factory(**options) -> tuple[BrokerProcess, int]:
        broker = broker_process(**options)
        ws_port = with_websocket_listener(broker)
        broker.start()
        assert wait_until(lambda: websocket_accepts(ws_port), WAIT_S), "the WebSocket listener did not open"
        return broker, ws_port
    return factory


@pytest.mark.timeout(MODEL_TIMEOUT_S)
@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "amqtt_reader"])
def test_the_broker_follows_the_queue_model(ws_broker, fast_path):
    # The seed is printed (shown with a failure) and taken from MQTT_MODEL_SEED: the same seed draws the same
    # steps again; MQTT_MODEL_EXAMPLES overrides the profile's number of runs.
    broker, ws_port = ws_broker(reader_batch_size=WINDOW, fast_path=fast_path)
    chosen = int(os.environ.get("MQTT_MODEL_SEED") or random.getrandbits(64))
    print(f"hypothesis seed {chosen}: MQTT_MODEL_SEED={chosen} draws these runs again")
    machine = seed(chosen)(type("Machine", (BrokerMachine,), {"broker": broker, "ws_port": ws_port}))
    profile = settings.get_profile(f"mqtt-model-{PROFILE}")
    if examples := os.environ.get("MQTT_MODEL_EXAMPLES"):
        profile = settings(profile, max_examples=int(examples))
    run_state_machine_as_test(machine, settings=profile)


# ---------------------------------------------------------------- issue 23 points 1-8, each as a fixed example

def subscribed(port: int, cid: str, transport: str = "tcp") -> WireClient:
    """A clean consumer ``cid`` over ``transport`` whose SUBSCRIBE to ``$ECQ/<cid>/#`` was granted QoS 1."""
    wire, _present = WireClient.connected(port, cid, transport=transport)
    wire.send(subscribe_packet(1, (f"$ECQ/{cid}/#", 1)))
    suback = wire.next()
    assert suback is not None and suback.kind == SUBACK and suback.body == b"\x00\x01\x01", suback
    return wire


def received(wire: WireClient, count: int, quiet_s: float = 1.0) -> list[tuple[str, bytes]]:
    """The next ``count`` deliveries on ``wire`` as (topic, payload), each PUBACKed as it comes, and whatever more
    arrives within ``quiet_s`` after them (so that a test sees a duplicate). Raises TimeoutError when fewer come."""
    messages, deadline = [], time.monotonic() + WAIT_S
    while len(messages) < count:
        packet = wire.next(max(0.0, deadline - time.monotonic()))
        assert packet is not None, f"the broker closed the connection after {messages}"
        messages += _taken(wire, [packet])
    return messages + _taken(wire, wire.available(quiet_s))


def _taken(wire: WireClient, packets: list[Packet]) -> list[tuple[str, bytes]]:
    publishes = [packet.publish() for packet in packets if packet.kind == PUBLISH]
    if publishes:
        wire.send(*(puback_packet(p.packet_id) for p in publishes))
    return [(p.topic, p.payload) for p in publishes]


def answer(wire: WireClient, kind: int, packet_id: int | None = None, skipping: int | None = None) -> None:
    """The broker's next packet on ``wire`` is ``kind`` (for ``packet_id``); packets of type ``skipping`` are
    skipped. Raises TimeoutError when none comes within WAIT_S."""
    packet = wire.next()
    while packet is not None and packet.kind == skipping:
        packet = wire.next()
    assert packet is not None and packet.kind == kind, f"expected packet type {kind}, got {packet}"
    assert packet_id is None or packet.packet_id == packet_id, f"expected packet id {packet_id}, got {packet}"


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "amqtt_reader"])
@pytest.mark.parametrize("sends", ["one_send", "send_each"])
@pytest.mark.parametrize("qos", [0, 2])
def test_every_write_of_a_one_shot_publisher_is_stored(make_broker, fast_path, sends, qos):
    # Issue 23 point 1: CONNECT, PUBLISH, DISCONNECT at once, as mosquitto_pub does (QoS 0 is its default), five
    # times: 5 of 5 stored (MQTT 3.1.1 section 3.14.4). QoS 2 (PUBREC means stored) was lost the same way.
    broker = make_broker(fast_path=fast_path)
    for i in range(5):
        packets = [connect_packet(f"pub{i}"), publish_packet(f"$ECQ/w/q0c/k{i}", b"v%d" % i, qos, 1 if qos else None),
                   DISCONNECT_PACKET]
        wire = WireClient(broker.port)
        for chunk in ([packets] if sends == "one_send" else [[p] for p in packets]):
            wire.send(*chunk)
        wire.close()
    assert received(subscribed(broker.port, "q0c"), 5) == [(f"$ECQ/q0c/k{i}", b"v%d" % i) for i in range(5)]


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "amqtt_reader"])
@pytest.mark.parametrize("reconnect", [False, True], ids=["same_connection", "persistent_reconnect"])
def test_a_qos2_publish_resent_with_dup_is_delivered_once(make_broker, fast_path, reconnect):
    # Issue 23 point 2: PUBLISH qos=2 pid=9, PUBREC read, the same PUBLISH again with DUP=1 (the PUBREC was lost),
    # on the same connection or after a persistent reconnect before PUBREL: one message (MQTT 3.1.1 section 4.3.3).
    broker = make_broker(fast_path=fast_path)
    consumer = subscribed(broker.port, "cq")
    publish = functools.partial(publish_packet, "$ECQ/w/cq/k", b"X", 2, 9)
    producer, _present = WireClient.connected(broker.port, "p2", clean_session=not reconnect)
    producer.send(publish())
    answer(producer, PUBREC, 9)
    if reconnect:
        producer.send(DISCONNECT_PACKET)
        producer.until_closed()
        producer, present = WireClient.connected(broker.port, "p2", clean_session=False)
        assert present
    producer.send(publish(dup=True))
    answer(producer, PUBREC, 9)
    producer.send(pubrel_packet(9))
    answer(producer, PUBCOMP, 9, skipping=PUBREC)  # a broker may resend PUBREC on the reconnect
    assert received(consumer, 1) == [("$ECQ/cq/k", b"X")]
    assert last_seqno(broker, "cq") == 1, "stored twice (the consumer may have got only the newer copy)"


def test_ecq_works_over_websocket(ws_broker):
    # Issue 23 point 3: over a `type: ws` listener an ECQ write is PUBACKed and its delivery arrives (amqtt's
    # WebSocket writer sends only on drain()).
    broker, ws_port = ws_broker()
    consumer = subscribed(ws_port, "wsq", transport="ws")
    producer, _present = WireClient.connected(ws_port, "wsp", transport="ws")
    producer.send(publish_packet("$ECQ/w/wsq/k", b"over ws", 1, 3))
    answer(producer, PUBACK, 3)
    assert received(consumer, 1) == [("$ECQ/wsq/k", b"over ws")]


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "amqtt_reader"])
def test_pubacks_after_unsubscribe_are_stored(make_broker, fast_path):
    # Issue 23 point 4: three deliveries in flight, UNSUBSCRIBE, then their PUBACKs: they count (MQTT-3.10.4-3),
    # so subscribing again delivers nothing.
    broker = make_broker(fast_path=fast_path)
    producer, _present = WireClient.connected(broker.port, "up")
    producer.send(*(publish_packet(f"$ECQ/w/uq/k{i}", b"v", 1, i + 1) for i in range(3)))
    for i in range(3):
        answer(producer, PUBACK, i + 1)
    consumer = subscribed(broker.port, "uq")
    in_flight = [consumer.next().publish().packet_id for _ in range(3)]
    consumer.send(unsubscribe_packet(2, "$ECQ/uq/#"))
    answer(consumer, UNSUBACK, 2)
    consumer.send(*(puback_packet(pid) for pid in in_flight), PINGREQ_PACKET)
    answer(consumer, PINGRESP)
    consumer.send(subscribe_packet(3, ("$ECQ/uq/#", 1)))
    answer(consumer, SUBACK, 3)
    assert received(consumer, 0) == []


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "amqtt_reader"])
def test_pubacks_keep_publish_order_across_ecq_and_plain_topics(make_broker, fast_path):
    # Issue 23 point 5: 300 pipelined QoS 1 PUBLISHes, every other one an ECQ write: PUBACKs in the order of the
    # PUBLISHes, whatever the topic (MQTT-4.6.0-2).
    broker = make_broker(fast_path=fast_path)
    producer, _present = WireClient.connected(broker.port, "mixed")
    producer.send(*(publish_packet(f"$ECQ/w/mq/k{i}" if i % 2 else f"plain/{i}", b"v", 1, i) for i in range(1, 301)))
    acks = [producer.next(10) for _ in range(300)]
    assert [(p.kind, p.packet_id) for p in acks] == [(PUBACK, i) for i in range(1, 301)]


def test_session_max_queued_holds_when_subscribes_arrive_in_one_segment(make_broker):
    # Issue 23 point 6: a persistent session whose SUBSCRIBEs to $ECQ/ps/# and plain/# arrive in one segment keeps
    # exactly session_max_queued (50) plain messages while offline: the newest, in order. It reconnects once a
    # witness subscriber got the last message, i.e. once amqtt fanned it out: amqtt PUBACKs a plain QoS 1 message
    # before its fan-out (docs/guarantees.md, "Not changed, and known"), and a session reconnecting in between gets the
    # messages still being fanned out live, on top of its 50.
    broker = make_broker(session_max_queued=50)
    wire = WireClient(broker.port)
    wire.send(connect_packet("ps", clean_session=False), subscribe_packet(1, ("$ECQ/ps/#", 1)),
              subscribe_packet(2, ("plain/#", 1)))
    assert wire.read_connack() is False
    answer(wire, SUBACK, 1)
    answer(wire, SUBACK, 2)
    wire.send(DISCONNECT_PACKET)
    wire.until_closed()
    witness, _present = WireClient.connected(broker.port, "witness")
    witness.send(subscribe_packet(1, ("plain/#", 1)))
    answer(witness, SUBACK, 1)
    producer, _present = WireClient.connected(broker.port, "plainp")
    for i in range(100):
        producer.send(publish_packet("plain/t", b"%d" % i, 1, i + 1))
        answer(producer, PUBACK, i + 1)
    assert received(witness, 100, quiet_s=0)[-1] == ("plain/t", b"99")
    wire, present = WireClient.connected(broker.port, "ps", clean_session=False)
    assert present
    assert received(wire, 50, quiet_s=1.5) == [("plain/t", b"%d" % i) for i in range(50, 100)]


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "amqtt_reader"])
@pytest.mark.parametrize("malformed", ["42020001", "4003000100", "320400202445"],
                         ids=["puback_reserved_flags", "puback_length_3", "publish_topic_past_the_end"])
def test_malformed_packets_close_the_connection(make_broker, fast_path, malformed):
    # Issue 23 point 7: MQTT 3.1.1 section 4.8: a malformed packet closes the connection; others are served.
    broker = make_broker(fast_path=fast_path)
    wire, _present = WireClient.connected(broker.port, "malformed")
    wire.send(bytes.fromhex(malformed))
    assert wire.until_closed() == []
    other, _present = WireClient.connected(broker.port, "other")
    other.send(PINGREQ_PACKET)
    answer(other, PINGRESP)


def test_a_rewind_past_the_last_seqno_is_refused_and_later_writes_are_delivered(make_broker):
    # Issue 23 point 8: docs/topics.md's rewind example without `since:` (a seqno far above the queue's last) is refused
    # as bad_rewind (still PUBACKed under MQTT 3.1.1) and swallows nothing written afterwards.
    broker = make_broker()
    producer, _present = WireClient.connected(broker.port, "carp")
    for i in range(2):
        producer.send(publish_packet(f"$ECQ/w/car7/k{i}", b"v%d" % i, 1, i + 1))
        answer(producer, PUBACK, i + 1)
    consumer = subscribed(broker.port, "car7")
    assert received(consumer, 2, quiet_s=0.2) == [("$ECQ/car7/k0", b"v0"), ("$ECQ/car7/k1", b"v1")]
    consumer.send(publish_packet("$ECQ/ctl/car7/rewind", b"1767225600000", 1, 7))
    answer(consumer, PUBACK, 7)
    assert 'ecq_writes_refused_total{reason="bad_rewind"} 1.0' in metrics_text(broker)
    producer.send(publish_packet("$ECQ/w/car7/k2", b"v2", 1, 3))
    answer(producer, PUBACK, 3)
    assert received(consumer, 1) == [("$ECQ/car7/k2", b"v2")]
