"""Bad clients: what amqtt 0.12.1 (or asyncio) does with a client that misbehaves, corrected.

Sockets are closed on every path, a CONNECT must come within ``connect_timeout``, packet size and
protocol checks run before a body is read, ``$``-topics no longer end a client's loop, and accept failures
are logged at a bounded rate. Each function below corrects one behaviour and is installed by one line in
``install``. The connection checks act only on brokers that run the ECQ plugin: :func:`close_abandoned_connections`
registers their connections in ``_connections``, by amqtt reader.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from amqtt.adapters import StreamWriterAdapter
from amqtt.broker import Broker
from amqtt.codecs_amqtt import decode_packet_id, read_or_raise
from amqtt.errors import AMQTTError, MQTTError, NoDataError
from amqtt.mqtt.connect import ConnectPayload
from amqtt.mqtt.packet import (DISCONNECT, PINGREQ, PUBACK, PUBCOMP, PUBLISH, PUBREC, PUBREL, RESERVED_0, RESERVED_15,
                               SUBSCRIBE, UNSUBSCRIBE, MQTTFixedHeader)
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.publish import PublishVariableHeader
from amqtt.mqtt.subscribe import SubscribePayload

from ecq.broker.amqtt_hooks.seam import Result, replace, step
from ecq.broker.amqtt_hooks.target import find_target
from ecq.queue.throttle import LogThrottle
from ecq.queue.topics import is_ecq_topic

log = logging.getLogger(__name__)

ACCEPT_ERROR_LOG_INTERVAL_S = 10.0
VIOLATION_LOG_INTERVAL_S, VIOLATION_LOG_BURST = 10.0, 10
_ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's message (selector_events._accept_connection)
_FIXED_FLAGS = {PUBREL: 0x2, SUBSCRIBE: 0x2, UNSUBSCRIBE: 0x2}  # every other type but PUBLISH: 0 (section 2.2.2)
_FIXED_LENGTHS = {PUBACK: 2, PUBREC: 2, PUBREL: 2, PUBCOMP: 2, PINGREQ: 0, DISCONNECT: 0}
PACKET_NAMES = ("RESERVED", "CONNECT", "CONNACK", "PUBLISH", "PUBACK", "PUBREC", "PUBREL", "PUBCOMP", "SUBSCRIBE",
                 "SUBACK", "UNSUBSCRIBE", "UNSUBACK", "PINGREQ", "PINGRESP", "DISCONNECT", "RESERVED")


class ProtocolViolation(Exception):
    """A packet that MQTT 3.1.1 answers by closing the network connection, raised while it is decoded.

    It is deliberately not an amqtt ``MQTTError``: amqtt's reader loop skips those and reads on from the
    middle of the packet; any other exception ends the loop, which then closes the connection.
    """


@dataclass
class _Connection:
    """What the packet checks know about one connection: peer ``host:port``, limits, clientid once known."""

    peer: str
    max_packet_bytes: int
    connect_timeout_s: float
    count_violation: Callable[[], None]
    client_id: str | None = None

    def __str__(self) -> str:
        if self.client_id is None:
            return f"{self.peer} (before CONNECT)"
        return f"client {self.client_id!r} ({self.peer})"


_connections: dict[Any, _Connection] = {}  # by amqtt ReaderAdapter, while amqtt serves the connection
_violation_log = LogThrottle(VIOLATION_LOG_INTERVAL_S, VIOLATION_LOG_BURST)


def violation(reader: Any, reason: str) -> ProtocolViolation:
    """Count and log why the connection read by ``reader`` is closed (at most :data:`VIOLATION_LOG_BURST` lines
    per :data:`VIOLATION_LOG_INTERVAL_S`: a client looping on a bad packet must not flood the log); return the
    exception that makes the reader close it (MQTT 3.1.1 section 4.8)."""
    connection = _connections[reader]
    connection.count_violation()
    if (held_back := _violation_log.due()) is not None:
        more = f" ({held_back} more protocol violations closed connections since the last such line)" if held_back else ""
        log.warning("ECQ closing the connection of %s: %s%s", connection, reason, more)
    return ProtocolViolation(reason)


def checked_connection(reader: Any) -> _Connection | None:
    """What the packet checks know about the connection read by ``reader`` (None: not an ECQ broker's)."""
    return _connections.get(reader)


def share_checks(reader: Any, alias: Any) -> None:
    """Until :func:`stop_sharing_checks`, packets decoded from ``alias`` get the checks of ``reader``'s connection."""
    _connections[alias] = _connections[reader]


def stop_sharing_checks(alias: Any) -> None:
    """The end of :func:`share_checks` (nothing when ``alias`` shares none)."""
    _connections.pop(alias, None)


def fixed_header_violation(packet_type: int, flags: int, remaining_length: int, max_packet_bytes: int) -> str | None:
    """Why a fixed header closes its connection before any of its body is read, or None for a valid one: a size
    above ``max_packet_bytes``, PUBLISH QoS 3 (section 3.3.1.2), reserved flags other than section 2.2.2 gives
    them, a remaining length other than the packet's fixed one (sections 3.4-3.7, 3.12, 3.14)."""
    name = PACKET_NAMES[packet_type]
    if remaining_length > max_packet_bytes:
        return f"{name} packet announces {remaining_length} bytes, above max_packet_bytes {max_packet_bytes}"
    if packet_type == PUBLISH:
        return "PUBLISH with QoS 3 [MQTT-3.3.1-4]" if flags & 0x06 == 0x06 else None
    if packet_type in (RESERVED_0, RESERVED_15):
        return None  # the reader closes the connection for its type
    if flags != _FIXED_FLAGS.get(packet_type, 0):
        return f"{name} with reserved flags {flags:#x} [MQTT-2.2.2-2]"
    expected = _FIXED_LENGTHS.get(packet_type)
    if expected is not None and remaining_length != expected:
        return f"{name} with remaining length {remaining_length}, not {expected}"
    return None


def publish_overrun(remaining_length: int, topic_length: int | None, qos: int) -> str | None:
    """Why a PUBLISH whose topic (``topic_length`` bytes, None while its 2-byte length is unread) or packet id
    runs past its remaining length closes the connection, or None when they fit (section 3.3.2)."""
    if topic_length is None:
        return None if remaining_length >= 2 else (
            f"PUBLISH whose topic length runs past its remaining length {remaining_length}")
    if 2 + topic_length > remaining_length:
        return f"PUBLISH whose topic ({topic_length} bytes) runs past its remaining length {remaining_length}"
    if qos and 2 + topic_length + 2 > remaining_length:
        return f"PUBLISH whose packet id runs past its remaining length {remaining_length}"
    return None


def utf8_or_violation(reader: Any, raw: bytes, what: str) -> str:
    """``raw`` decoded as UTF-8; raises (and logs) ProtocolViolation when it is not valid UTF-8 or holds U+0000
    (section 1.5.3, MQTT-1.5.3-1 and -2: the receiver closes the connection)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise violation(reader, f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start}) [MQTT-1.5.3-1]")
    if "\x00" in text:
        raise violation(reader, f"{what} contains U+0000 [MQTT-1.5.3-2]")
    return text


def publish_violation(topic: str, packet_id: int | None) -> str | None:
    """Why a PUBLISH's topic or packet id closes its connection, or None (wildcards under ``$ECQ/`` are ECQ's
    to refuse)."""
    if not topic:
        return "PUBLISH to an empty topic [MQTT-4.7.3-1]"
    if ("+" in topic or "#" in topic) and not is_ecq_topic(topic):
        return f"PUBLISH to {topic!r}, a topic with a wildcard [MQTT-3.3.2-2]"
    if packet_id == 0:
        return f"PUBLISH to {topic!r} with packet id 0 [MQTT-2.3.1-1]"
    return None


def _abort(writer: Any) -> None:
    """Close a TCP connection's socket now, unless amqtt already closes it (unsent bytes are dropped)."""
    if isinstance(writer, StreamWriterAdapter):
        transport = writer._writer.transport
        if not transport.is_closing():
            writer.is_closed = True
            transport.abort()


def close_abandoned_connections() -> None:
    """Correct amqtt 0.12.1 ``Broker._client_connected``, which leaves the socket open when it stops serving a
    connection on any path but a handler stop: a CONNECT that does not decode, an EOF before or during CONNECT
    (``_initialize_client_session`` raises without closing the writer), an exception it does not expect.
    Every such connection kept its file descriptor: 2,500 connect-and-close cycles under ``ulimit -n 1024``
    left the broker unable to accept anyone. Now the socket is closed once amqtt returns.
    Also registers the connection in ``_connections`` for the packet checks below.
    """

    def register(broker: Broker, listener_name: str, reader: Any, writer: Any) -> None:
        plugin = find_target(broker.plugins_manager)
        if plugin is not None:
            peer = writer.get_peer_info()
            _connections[reader] = _Connection(f"{peer[0]}:{peer[1]}" if peer else "unknown peer",
                                               plugin.settings.effective_max_packet_bytes(),
                                               plugin.settings.connect_timeout, plugin.count_protocol_violation)

    def close(broker: Broker, listener_name: str, reader: Any, writer: Any) -> None:
        if find_target(broker.plugins_manager) is not None:  # the broker's plugins, as register() found them
            del _connections[reader]
            _abort(writer)

    step(Broker, "_client_connected", before=register, always=close)


def time_limit_connect() -> None:
    """Correct amqtt 0.12.1 ``BrokerProtocolHandler.init_from_connect``, which waits for the first packet
    forever: a socket that never sends a whole CONNECT held its file descriptor. Now it
    is closed after ``connect_timeout`` (EMQX does the same after its ``idle_timeout``). An unexpected
    exception while reading the CONNECT becomes an ``AMQTTError``, so amqtt logs it and releases the
    listener's slot instead of ending the connection's task with it. The body of the method's one wrapper
    (``seam.step``): amqtt's own, under that time limit.
    """
    original = BrokerProtocolHandler.init_from_connect.__func__

    async def init_from_connect(cls: type[BrokerProtocolHandler], reader: Any, writer: Any, plugins_manager: Any,
                                loop: Any) -> tuple[BrokerProtocolHandler, Any]:
        connection = _connections.get(reader)
        if connection is None:
            return await original(cls, reader, writer, plugins_manager, loop)
        try:
            async with asyncio.timeout(connection.connect_timeout_s):  # not wait_for: no task of its own (Python 3.11)
                handler, session = await original(cls, reader, writer, plugins_manager, loop)
        except TimeoutError:
            raise AMQTTError(f"no CONNECT from {connection.peer} within {connection.connect_timeout_s:g} s: "
                             "connection closed") from None
        except (AMQTTError, MQTTError, NoDataError):
            raise
        except Exception as exc:
            raise AMQTTError(f"CONNECT from {connection.peer} refused: {exc}") from exc
        connection.client_id = session.client_id
        return handler, session

    step(BrokerProtocolHandler, "init_from_connect", body=init_from_connect)


def check_fixed_headers() -> None:
    """Correct amqtt 0.12.1 ``MQTTFixedHeader.from_stream``, after which amqtt reads any packet body in full,
    whatever its announced length: one 200 MB PUBLISH took the broker from 135 to 726 MB RSS.
    Now a packet announcing a remaining length above ``max_packet_bytes`` closes the connection before its
    body is read (MQTT 3.1.1 has no other answer), and so does a PUBLISH with QoS 3 (section 3.3.1.2).
    """

    def check(header: MQTTFixedHeader | None, cls: type[MQTTFixedHeader], reader: Any) -> None:
        connection = _connections.get(reader)
        if header is None or connection is None:
            return
        reason = fixed_header_violation(header.packet_type, header.flags, header.remaining_length,
                                        connection.max_packet_bytes)
        if reason is not None:
            raise violation(reader, reason)

    step(MQTTFixedHeader, "from_stream", after=check)


async def _read_utf8(reader: Any, what: str) -> str:
    """One MQTT UTF-8 string (2-byte length, then the bytes); raises ProtocolViolation for invalid UTF-8.

    amqtt's ``decode_string`` turns invalid UTF-8 into the text ``"b'...'"`` and carries on with it.
    """
    raw = await read_or_raise(reader, struct.unpack("!H", await read_or_raise(reader, 2))[0])
    return utf8_or_violation(reader, raw, what)


def close_on_nul_in_connect() -> None:
    """Correct amqtt 0.12.1 ``ConnectPayload.from_stream``, which takes a client id, Will topic or user name holding
    U+0000 (a Will on ``a\x00b`` was published as such). MQTT 3.1.1 section 1.5.3 (MQTT-1.5.3-2): a receiver of a
    UTF-8 string with U+0000 closes the network connection; the CONNECT is now refused so, without a CONNACK, with
    its reason logged. (A v5 CONNECT is checked before its translation, ``mqtt5_edge``: CONNACK 0x81.)"""
    original = ConnectPayload.from_stream.__func__

    async def from_stream(cls: type[ConnectPayload], reader: Any, fixed_header: MQTTFixedHeader | None,
                          variable_header: Any) -> ConnectPayload:
        payload = await original(cls, reader, fixed_header, variable_header)
        if reader in _connections:
            for what, text in (("client id", payload.client_id), ("Will topic", payload.will_topic),
                               ("user name", payload.username)):
                if text and "\x00" in text:
                    raise violation(reader, f"CONNECT {what} contains U+0000 [MQTT-1.5.3-2]")
        return payload

    replace(ConnectPayload, "from_stream", classmethod(from_stream))


def check_publish_headers() -> None:
    """Correct amqtt 0.12.1 ``PublishVariableHeader.from_stream``: a topic of invalid UTF-8 is taken as the
    text ``"b'...'"`` (section 1.5.3), packet id 0 is taken at QoS 1 and 2 (section 2.3.1), and a wildcard
    topic raises an ``MQTTError`` that leaves the payload to be read as the next packet. An empty topic
    (section 4.7.3) passed decoding and then ended the client's message loop with the connection left open.
    A topic or packet id announced longer than the packet was read on into the next packets. Each now closes the
    connection with its reason logged, for ``$ECQ/`` writes too (nothing is stored); wildcards in ``$ECQ/``
    topics stay ECQ's to refuse (see ``ecq_paths.accept_ecq_wildcards``).
    """
    original = PublishVariableHeader.from_stream.__func__

    async def from_stream(cls: type[PublishVariableHeader], reader: Any, fixed_header: MQTTFixedHeader) -> Any:
        if reader not in _connections:
            return await original(cls, reader, fixed_header)
        qos, remaining_length = fixed_header.flags >> 1 & 0x03, fixed_header.remaining_length
        if (reason := publish_overrun(remaining_length, None, qos)) is not None:
            raise violation(reader, reason)
        topic_length = struct.unpack("!H", await read_or_raise(reader, 2))[0]
        if (reason := publish_overrun(remaining_length, topic_length, qos)) is not None:
            raise violation(reader, reason)
        topic = utf8_or_violation(reader, await read_or_raise(reader, topic_length), "PUBLISH topic")
        packet_id = await decode_packet_id(reader) if fixed_header.flags & 0x06 else None
        if (reason := publish_violation(topic, packet_id)) is not None:
            raise violation(reader, reason)
        return cls(topic, packet_id)

    replace(PublishVariableHeader, "from_stream", classmethod(from_stream))


def check_subscribe_payloads() -> None:
    """Correct amqtt 0.12.1 ``SubscribePayload.from_stream``, which accepts a SUBSCRIBE without any topic
    filter (MQTT 3.1.1 section 3.8.3), takes invalid UTF-8 as the text ``"b'...'"`` and then miscounts the
    bytes left (section 1.5.3), and takes an empty filter (4.7.3) or a requested QoS above 2 (3.8.3-4).
    Each now closes the connection with its reason logged. Returns amqtt's payload for a valid packet.
    """
    original = SubscribePayload.from_stream.__func__

    async def from_stream(cls: type[SubscribePayload], reader: Any, fixed_header: MQTTFixedHeader,
                          variable_header: Any) -> SubscribePayload:
        if reader not in _connections:
            return await original(cls, reader, fixed_header, variable_header)
        left = fixed_header.remaining_length - variable_header.bytes_length
        filters: list[tuple[str, int]] = []
        while left > 0:
            topic_filter = await _read_utf8(reader, "SUBSCRIBE topic filter")
            qos = (await read_or_raise(reader, 1))[0]
            left -= 2 + len(topic_filter.encode()) + 1
            if not topic_filter:
                raise violation(reader, "SUBSCRIBE with an empty topic filter [MQTT-4.7.3-1]")
            if qos > 2:
                raise violation(reader, f"SUBSCRIBE to {topic_filter!r} with QoS byte {qos} [MQTT-3.8.3-4]")
            filters.append((topic_filter, qos))
        if left < 0:
            raise violation(reader, "SUBSCRIBE whose topic filters overrun its remaining length")
        if not filters:
            raise violation(reader, "SUBSCRIBE without a topic filter [MQTT-3.8.3-3]")
        return cls(filters)

    replace(SubscribePayload, "from_stream", classmethod(from_stream))


def keep_serving_after_reserved_topics() -> None:
    """Correct amqtt 0.12.1 ``Broker._handle_message_delivery``, which ends the client's message loop after
    a PUBLISH to a topic starting with ``$`` (other than ECQ's) while the connection stays open and answers
    PINGREQ: the client's later SUBSCRIBEs were never answered. MQTT 3.1.1 section 4.7.2
    only keeps such topics for the server, so the message is dropped with a log line and the loop goes on.
    """

    def drop_reserved_topics(broker: Broker, session: Any, handler: Any, wait_deliver: Any) -> Result | None:
        message = wait_deliver.result()
        if message is not None and message.topic.startswith("$") and find_target(broker.plugins_manager):
            log.warning("ECQ dropped a PUBLISH of %r to %r: topics starting with $ are the broker's "
                        "(MQTT 3.1.1 section 4.7.2)", session.client_id, message.topic)
            return Result(True)  # the message loop goes on
        return None

    step(Broker, "_handle_message_delivery", before=drop_reserved_topics)


class _AcceptErrorLogLimit(logging.Filter):
    """Lets one asyncio "socket.accept() out of system resource" record through per ``interval_s``,
    without its traceback and with the count of those held back; other records pass unchanged."""

    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self._throttle = LogThrottle(interval_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or not record.msg.startswith(_ACCEPT_ERROR):
            return True
        if (held_back := self._throttle.due()) is None:
            return False
        error = record.exc_info[1] if record.exc_info else None
        record.msg = (f"{_ACCEPT_ERROR}: {error}; new connections wait until descriptors are free "
                      f"({held_back} more such errors since the last report; "
                      f"reported at most every {self._throttle.interval_s:g} s)")
        record.args, record.exc_info, record.exc_text = (), None, None
        return True


def limit_accept_error_log() -> None:
    """Correct the log flood of accept failures: when the process runs out of file descriptors, CPython 3.11's
    ``BaseSelectorEventLoop._accept_connection`` logs "socket.accept() out of system resource" with a traceback
    up to ``backlog`` (100, amqtt's) times per attempt and retries every second, which wrote hundreds of MB.
    Now one line per ``ACCEPT_ERROR_LOG_INTERVAL_S`` is logged."""
    logging.getLogger("asyncio").addFilter(_AcceptErrorLogLimit(ACCEPT_ERROR_LOG_INTERVAL_S))

