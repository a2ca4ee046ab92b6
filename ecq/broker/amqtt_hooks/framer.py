"""The packet reader of a broker that runs the ECQ plugin: a buffered MQTT framer in place of amqtt 0.12.1's
``ProtocolHandler._reader_loop`` (option ``fast_path``, default true; false keeps amqtt's reader).

amqtt's reader takes each packet with about five awaited ``readexactly`` calls (the remaining length one byte
at a time) under a ``wait_for`` for the keepalive (a task per packet on Python 3.11), builds amqtt packet
objects (each with a ``datetime.now``), fires a PACKET_RECEIVED plugin event and starts one more task to
handle it. The framer reads what the socket has, up to :data:`READ_SIZE` bytes at a time, and cuts whole
packets from those bytes:

- a fixed header is checked (``bad_clients.fixed_header_violation``: ``max_packet_bytes``, QoS 3) as soon as
  it is complete, before any more of its body is read; a violation closes the connection;
- a PUBLISH under ``$ECQ/``, at any QoS, goes to the plugin's ``take_ecq_write`` with its topic, packet id and
  payload sliced from the bytes (bad_clients' length, UTF-8 and packet-id rules apply): no packet object, no
  task, no event, and its write starts before the next packet is read, so a DISCONNECT or EOF right after it
  loses nothing; its PUBACK or PUBREC leaves in arrival order once committed or refused (``writes.ArrivalOrder``);
- a PUBACK for an ECQ delivery (``ecq_paths.publish_qos1``) resolves that delivery's waiter at once;
- a PINGREQ read when every PUBLISH read before it was routed (``flow.all_routed``) is answered at once with
  PINGRESP (``ecq_paths.send_soon``); otherwise amqtt's handler answers it once they are
  (``flow.answer_pings_after_routing``). An idle fleet's keepalive pings were most of an idle broker's work;
- every other packet is decoded from its bytes by amqtt's own classes (bad_clients' decode checks apply to
  them; one that does not decode closes the connection), fires PACKET_RECEIVED and goes to amqtt's handler
  method in a task, as amqtt's reader does;
- the next bytes are read once the PUBLISHes of ordinary topics read and not yet routed are within
  ``inbound_max_messages`` and ``inbound_max_bytes`` (``flow.Inbound``);
- keepalive: when no whole packet came within ``session.keep_alive`` (which ``conformance.enforce_keepalive``
  makes 1.5 x the CONNECT's), the handler's ``handle_read_timeout`` is called (that correction closes the
  connection): one timer re-armed at most once per keepalive period, not a ``wait_for`` per packet;
- the end (EOF, a reset, which ``acks.read_to_the_end_after_a_reset`` turns into EOF after the bytes received,
  a protocol violation, the cancel of a takeover, keepalive close or broker stop) runs amqtt's exit path once:
  the pending handler tasks are run out (bounded, not on a cancel) or cancelled, then
  ``handle_connection_closed``, ``_reader_stopped``, ``stop``.

amqtt's handler events ``_reader_ready`` and ``_reader_stopped`` (an ``asyncio.Event``, with its 760-byte deque, each)
become :class:`ecq.queue.lean_event.LeanEvent`s as the framer starts, before anything but ``start`` waits on them.

Packets the fast path takes are not seen by amqtt's PACKET_RECEIVED plugins (e.g. the ``$SYS`` counters);
``ecq_fast_path_packets_total{packet}`` counts them.
"""

from __future__ import annotations

import asyncio
import io
import logging

from amqtt.adapters import BufferReader, StreamReaderAdapter
from amqtt.errors import MQTTError, NoDataError
from amqtt.events import MQTTEvents
from amqtt.mqtt import packet_class
from amqtt.mqtt.packet import (CONNACK, CONNECT, DISCONNECT, PINGREQ, PINGRESP, PUBACK, PUBCOMP, PUBLISH, PUBREC,
                               PUBREL, RESERVED_0, RESERVED_15, SUBACK, SUBSCRIBE, UNSUBACK, UNSUBSCRIBE,
                               MQTTFixedHeader)
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

from ecq.broker.amqtt_hooks.bad_clients import (PACKET_NAMES, ProtocolViolation, checked_connection,
                                                fixed_header_violation, publish_overrun, publish_violation,
                                                share_checks, stop_sharing_checks, utf8_or_violation, violation)
from ecq.broker.amqtt_hooks.ecq_paths import client_id, send_soon
from ecq.broker.amqtt_hooks.flow import all_routed, room_to_read
from ecq.broker.amqtt_hooks.seam import Instead, step
from ecq.broker.amqtt_hooks.target import EcqHooksTarget, find_target
from ecq.queue.lean_event import LeanEvent
from ecq.queue.topics import PREFIX, SCQ_PREFIX, is_ecq_topic

log = logging.getLogger(__name__)

READ_SIZE = 64 * 1024  # bytes taken from the socket's StreamReader per read
RUN_OUT_S = 5.0  # at the end of a connection, the longest its last packets' handlers are waited for
_QOS_2_FLAGS = 0x04  # PUBLISH flags & 0x06 for QoS 2
_ECQ_PREFIXES = (PREFIX.encode(), SCQ_PREFIX.encode())  # the topics ECQ takes itself
_PINGRESP = bytes((PINGRESP << 4, 0))  # the same two bytes in MQTT 3.1.1 and 5.0
_READY = LeanEvent()  # every framer's handler._reader_ready once it runs: set, never cleared, waited on by no one
_READY.set()
_HANDLERS = {CONNACK: "handle_connack", SUBSCRIBE: "handle_subscribe", UNSUBSCRIBE: "handle_unsubscribe",
             SUBACK: "handle_suback", UNSUBACK: "handle_unsuback", PUBACK: "handle_puback", PUBREC: "handle_pubrec",
             PUBREL: "handle_pubrel", PUBCOMP: "handle_pubcomp", PINGREQ: "handle_pingreq",
             PINGRESP: "handle_pingresp", PUBLISH: "handle_publish", DISCONNECT: "handle_disconnect"}


def read_with_the_framer() -> None:
    """Replace amqtt 0.12.1's ``BrokerProtocolHandler._reader_loop`` with :class:`Framer` on the TCP connections
    of brokers that run the ECQ plugin with ``fast_path`` on; any other connection keeps amqtt's reader."""
    def read_with_a_framer(handler: BrokerProtocolHandler) -> Instead | None:
        plugin = find_target(handler.plugins_manager)
        if (plugin is None or not plugin.settings.fast_path or not isinstance(handler.reader, StreamReaderAdapter)
                or checked_connection(handler.reader) is None):
            return None
        return Instead(Framer(handler, plugin).run())  # no frame of this step kept for the connection's life

    step(BrokerProtocolHandler, "_reader_loop", before=read_with_a_framer)


def _lean_events(handler: BrokerProtocolHandler) -> None:
    """Set amqtt's ``_reader_ready``, which ``start`` waits on, and give the handler lean events in place of amqtt's
    (an ``asyncio.Event`` holds a 760-byte deque; ecq.queue.lean_event): nothing waits on ``_reader_stopped`` yet,
    and ``_reader_ready`` is never waited on again."""
    handler._reader_stopped = LeanEvent()
    handler._reader_ready, ready = _READY, handler._reader_ready
    ready.set()


class _PacketReader(BufferReader):
    """amqtt's ``BufferReader`` over one packet body at a time: what amqtt's decoders read from."""

    def __init__(self) -> None:
        super().__init__(b"")

    def load(self, body: bytes) -> _PacketReader:
        self._stream = io.BytesIO(body)
        return self


class Framer:
    """Reads the packets of one connection served by ``handler`` (attached, reader a StreamReaderAdapter that
    ``bad_clients`` registered) and hands them on; :meth:`run` returns once the connection is closed."""

    def __init__(self, handler: BrokerProtocolHandler, plugin: EcqHooksTarget) -> None:
        self._handler, self._plugin = handler, plugin
        self._adapter = handler.reader
        self._stream: asyncio.StreamReader = self._byte_stream(handler.reader)
        self._max_packet_bytes = checked_connection(self._adapter).max_packet_bytes
        self._packets = _PacketReader()  # also names the connection in violations until the reader's exit
        self._running: list[tuple[asyncio.Task, bool]] = []  # amqtt handler tasks, each with whether it ends by
        # itself (see _run_out); a list, not a deque (760 bytes): a connection has a few at a time, mostly none
        self._loop = asyncio.get_running_loop()
        keep_alive = handler.session.keep_alive
        self._keepalive_s = keep_alive if keep_alive and keep_alive > 0 else None
        self._last_packet = self._loop.time()
        self._timer: asyncio.TimerHandle | None = None

    # why a fixed header closes the connection: MQTT 3.1.1's rules (an attribute: a subclass reads another version)
    _header_violation = staticmethod(fixed_header_violation)

    @staticmethod
    def _byte_stream(adapter: StreamReaderAdapter) -> asyncio.StreamReader:
        """The asyncio stream the framer reads (``read(n)``: what is there, up to n bytes; ``readexactly(n)``)."""
        return adapter._reader

    async def run(self) -> None:
        """Read until the connection ends, then run amqtt's reader exit path (once)."""
        handler, cancelled = self._handler, False
        _lean_events(handler)
        share_checks(self._adapter, self._packets)  # not a ``with``: no generator kept for the connection's life
        self._arm_keepalive()
        try:
            await self._read()
        except asyncio.CancelledError:
            log.debug("reader of %s cancelled", client_id(handler))
            cancelled = True
        except asyncio.IncompleteReadError:
            log.debug("%s: end of stream inside a packet", client_id(handler))
        except ProtocolViolation:
            pass  # logged with its reason by bad_clients.violation
        except Exception as exc:
            log.warning("reader of %s stopped by an unexpected exception: %r", client_id(handler), exc)
        finally:
            if self._timer is not None:
                self._timer.cancel()
            stop_sharing_checks(self._packets)
        await self._run_out(cancelled)
        await handler.handle_connection_closed()
        handler._reader_stopped.set()
        await handler.stop()

    async def _run_out(self, cancelled: bool) -> None:
        """End the handler tasks of the packets read. Every packet read before a DISCONNECT or the end of the stream
        is processed (MQTT 3.1.1 section 3.14.4): the tasks that end by themselves (all but a QoS 2 PUBLISH waiting
        for its PUBREL) get up to :data:`RUN_OUT_S` to do so, unless the reader itself was cancelled (takeover,
        broker stop). amqtt's reader cancels them all at once, before a SUBSCRIBE sent with DISCONNECT has run."""
        finishing = [task for task, finishes in self._running if finishes and not task.done()]
        if finishing and not cancelled:
            try:
                await asyncio.wait(finishing, timeout=RUN_OUT_S)
            except asyncio.CancelledError:
                log.debug("reader of %s cancelled while its last packets were handled", client_id(self._handler))
        for task, _ in self._running:
            task.cancel()
        self._running.clear()

    async def _read(self) -> None:
        """Cut and hand on packets until EOF; a partial fixed header waits for the next read."""
        # let ``start`` finish before the first packet, as amqtt's reader does (its first read yields): a DISCONNECT
        # sent with the CONNECT was otherwise handled before ``start`` armed its disconnect waiter, and lost
        await asyncio.sleep(0)
        pending = b""
        while True:
            chunk = await self._stream.read(READ_SIZE)
            if not chunk:
                return
            pending = await self._cut(pending + chunk if pending else chunk)
            await room_to_read(self._adapter)  # PUBLISHes read and not yet routed within their bounds
            if self._running:
                self._running = [running for running in self._running if not running[0].done()]

    async def _cut(self, data: bytes) -> bytes:
        """Hand on every whole packet of ``data``; returns the bytes of an incomplete fixed header at its end.
        The rest of a packet whose fixed header is complete is read here, after its header was checked."""
        start, publishes, pubacks, pings = 0, 0, 0, 0
        try:
            while (header := self._fixed_header(data, start)) is not None:
                first, length, body = header
                if (reason := self._header_violation(first >> 4, first & 0x0F, length, self._max_packet_bytes)):
                    raise violation(self._packets, reason)
                end = body + length
                if end > len(data):  # the rest of the body, read now that its header passed the checks
                    data = data[start:] + await self._stream.readexactly(end - len(data))
                    body, end, start = body - start, end - start, 0
                kind = first >> 4
                if kind == PUBLISH and self._take_ecq_publish(data, first, body, end):
                    publishes += 1
                elif kind == PUBACK and length == 2 and self._resolve_ecq_puback(data, body):
                    pubacks += 1
                elif kind == PINGREQ and all_routed(self._adapter):  # its flags and length were checked above
                    send_soon(self._handler, _PINGRESP)
                    pings += 1
                else:
                    await self._hand_to_amqtt(first, data[body:end])
                start = end
        finally:
            if start:
                self._last_packet = self._loop.time()
            if publishes or pubacks or pings:
                self._plugin.count_fast_path(publishes, pubacks, pings)
        return data[start:]

    def _fixed_header(self, data: bytes, start: int) -> tuple[int, int, int] | None:
        """(first byte, remaining length, offset of the body) of the packet at ``start``, None while incomplete.
        Raises ProtocolViolation for a remaining length longer than 4 bytes (MQTT 3.1.1 section 2.2.3)."""
        length, shift, index = 0, 0, start + 1
        while index < len(data):
            byte = data[index]
            index += 1
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return data[start], length, index
            shift += 7
            if shift == 28:
                raise violation(self._packets, "a remaining length longer than 4 bytes [MQTT-2.2.3]")
        return None

    def _topic_end(self, data: bytes, qos: int, body: int, end: int) -> int:
        """Where the topic of the PUBLISH whose body is ``data[body:end]`` ends (its first byte is at ``body + 2``).
        Raises ProtocolViolation when the topic length, or the packet id of QoS ``qos``, runs past the packet."""
        if (reason := publish_overrun(end - body, None, qos)) is not None:
            raise violation(self._packets, reason)
        topic_end = body + 2 + (data[body] << 8 | data[body + 1])
        if (reason := publish_overrun(end - body, topic_end - body - 2, qos)) is not None:
            raise violation(self._packets, reason)
        return topic_end

    def _take_ecq_publish(self, data: bytes, first: int, body: int, end: int) -> bool:
        """Hand a PUBLISH under ``$ECQ/`` or ``$SCQ/``, at any QoS, to the plugin as it is read; False for any other
        topic (amqtt decodes those). Raises ProtocolViolation: a topic or packet id running past the packet, invalid
        UTF-8, packet id 0."""
        qos = first >> 1 & 0x03
        topic_end = self._topic_end(data, qos, body, end)
        if not data.startswith(_ECQ_PREFIXES, body + 2, topic_end):
            return False
        topic = utf8_or_violation(self._packets, data[body + 2:topic_end], "PUBLISH topic")
        packet_id = data[topic_end] << 8 | data[topic_end + 1] if qos else None
        if (reason := publish_violation(topic, packet_id)) is not None:
            raise violation(self._packets, reason)
        payload_start = topic_end + 2 if qos else topic_end
        self._plugin.take_ecq_write(self._handler, topic, qos, packet_id, data[payload_start:end])
        return True

    def _resolve_ecq_puback(self, data: bytes, body: int) -> bool:
        """Resolve the delivery a PUBACK acknowledges, if it is an ECQ delivery waiting for it (amqtt's
        ``handle_puback``, through ``acks.handle_puback_at_once``, handles every other PUBACK)."""
        packet_id = data[body] << 8 | data[body + 1]
        waiter = self._handler._puback_waiters.get(packet_id)
        message = self._handler.session.inflight_out.get(packet_id)
        if waiter is None or waiter.done() or message is None or not is_ecq_topic(message.topic):
            return False
        waiter.set_result(None)
        return True

    async def _hand_to_amqtt(self, first: int, body: bytes) -> None:
        """What amqtt's reader does with one packet, decoded from its bytes: PACKET_RECEIVED, then its handler
        method in a task (CONNECT awaited; a reserved type closes the connection). A packet amqtt cannot decode
        (MQTTError, NoDataError) is malformed: ProtocolViolation closes the connection (MQTT 3.1.1 section 4.8),
        where amqtt's reader drops it and reads on."""
        handler, kind = self._handler, first >> 4
        if kind in (RESERVED_0, RESERVED_15):
            log.warning("%s sent a reserved packet type %d: closing the connection", client_id(handler), kind)
            await handler.handle_connection_closed()
            return
        header = MQTTFixedHeader(kind, first & 0x0F, len(body))
        try:
            packet = await packet_class(header).from_stream(self._packets.load(body), fixed_header=header)
        except (MQTTError, NoDataError) as exc:
            raise violation(self._packets, f"{PACKET_NAMES[kind]} packet that does not decode ({exc!r})") from None
        await self._handle(first, packet)

    async def _handle(self, first: int, packet: object) -> None:
        """PACKET_RECEIVED for an amqtt ``packet`` (first byte ``first``), then its amqtt handler method in a task
        (CONNECT awaited)."""
        handler, kind = self._handler, first >> 4
        await handler.plugins_manager.fire_event(MQTTEvents.PACKET_RECEIVED, packet=packet, session=handler.session)
        if kind == CONNECT:
            await handler.handle_connect(packet)
        else:
            task = asyncio.create_task(getattr(handler, _HANDLERS[kind])(packet))
            self._running.append((task, not (kind == PUBLISH and first & 0x06 == _QOS_2_FLAGS)))

    def _arm_keepalive(self) -> None:
        if self._keepalive_s is not None:
            self._timer = self._loop.call_at(self._last_packet + self._keepalive_s, self._keepalive_due)

    def _keepalive_due(self) -> None:
        """The keepalive timer: re-armed from the last whole packet, or the handler's read timeout is due."""
        if self._last_packet + self._keepalive_s - self._loop.time() > 0.001:
            self._arm_keepalive()
            return
        log.debug("%s: no packet within %s s", client_id(self._handler), self._keepalive_s)
        self._handler.handle_read_timeout()
        self._last_packet = self._loop.time()  # as amqtt's reader, wait a whole period again
        self._arm_keepalive()

