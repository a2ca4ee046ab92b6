"""What draining a node (``ecq drain``, :mod:`ecq.broker.drain`) needs of amqtt 0.12.1's broker: its listening
servers, its live connections and their sockets. amqtt has no public way to stop accepting while it keeps
running (its listeners close only in ``Broker.shutdown``, together with every session), to list the
connections, or to stop reading one while its acknowledgements are still to be sent."""

from __future__ import annotations

import array
import fcntl
import termios

from amqtt.adapters import StreamReaderAdapter, StreamWriterAdapter
from amqtt.broker import BrokerContext
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

from ecq.broker.amqtt_hooks.ecq_paths import connection_is_open


def close_listeners(context: BrokerContext) -> int:
    """Stop accepting connections on every MQTT listener of the broker (TCP, TLS and WebSocket); returns how
    many were closed. A client connecting afterwards is refused by the kernel (ECONNREFUSED) and tries another
    node. Connections already accepted stay (close them with :func:`ecq.broker.amqtt_hooks.close_connection`).
    amqtt keeps each listener's server in ``Broker._servers``; its ``shutdown`` closes them again, harmlessly."""
    closed = 0
    for server in context._broker_instance._servers.values():
        if server.instance is not None:  # amqtt's ExternalServer (connections handed in by the host) has none
            server.instance.close()
            closed += 1
    return closed


def open_connections(context: BrokerContext) -> list[BrokerProtocolHandler]:
    """The handler of every client connection still open (amqtt keeps them in ``Broker._sessions``)."""
    return [handler for _session, handler in list(context._broker_instance._sessions.values())
            if connection_is_open(handler)]


def stop_reading(handler: BrokerProtocolHandler) -> bool:
    """Stop reading the socket of a TCP or TLS connection (its transport paused) while it stays open for what ECQ
    still sends; returns True while bytes received before the pause remain for the connection's reader (ECQ's
    framer or amqtt's) to take: call it again until it returns False. asyncio's StreamReader resumes a transport
    it paused itself once its buffer drains, so each call pauses it again. False at once for a connection whose
    socket cannot be paused (WebSocket): that one is only closed."""
    reader, writer = handler.reader, handler.writer
    if not isinstance(reader, StreamReaderAdapter) or not isinstance(writer, StreamWriterAdapter) or writer.is_closed:
        return False
    transport = writer._writer.transport
    if transport.is_closing():
        return False
    was_reading = transport.is_reading()
    transport.pause_reading()
    return was_reading or bool(reader._reader._buffer)


def received_unread(handler: BrokerProtocolHandler) -> bool:
    """True while bytes the client sent wait for the connection's reader: in the kernel's socket buffer
    (FIONREAD) or in asyncio's StreamReader buffer. A connection closed for a takeover from another node is
    first read to here, so that PUBACKs the client sent just before it left count (they are acks it made, and
    its queue must never deliver them again). False for a connection that is not TCP/TLS or already closed."""
    reader, writer = handler.reader, handler.writer
    if not isinstance(reader, StreamReaderAdapter) or not isinstance(writer, StreamWriterAdapter) or writer.is_closed:
        return False
    if reader._reader._buffer:
        return True
    sock = writer._writer.transport.get_extra_info("socket")
    if sock is None or sock.fileno() < 0:
        return False
    pending = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, pending)
    except OSError:
        return False
    return pending[0] > 0
