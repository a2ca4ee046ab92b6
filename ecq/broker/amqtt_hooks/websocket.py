"""WebSocket listeners (``type: ws`` in amqtt's ``listeners``) carry ECQ's packets as TCP listeners do.

amqtt 0.12.1 serves a WebSocket connection through the adapters of amqtt/adapters.py, and corrected here for the
brokers that run the ECQ plugin:

- ``WebSocketsWriter.write()`` only appends to a buffer that ``drain()`` sends (and its ``close()`` waits up to 10 s
  for the client's close frame, which held a persistent session's takeover). ECQ's own packets (write PUBACKs,
  deliveries) are written without a drain (``ecq_paths.send_soon``: one write per connection and event-loop
  iteration), so over WebSocket an ECQ write got no PUBACK and a consumer no delivery, while TCP and TLS worked:
  :func:`correct_websocket_adapters`;
- ``WebSocketsReader`` appends the last message it received again and again when the connection closes in the
  middle of a packet, until the packet is "complete": a write whose connection dropped after part of its payload
  was stored with a payload its publisher never sent (MQTT.js sends each packet in several WebSocket messages):
  :func:`correct_websocket_adapters` too;
- the listener takes at most websockets' default of 1 MiB per incoming message, below the largest packet ECQ
  reads, and closed a larger one without a word: :func:`take_websocket_messages_of_the_largest_packet`.
"""

from __future__ import annotations

import asyncio
import io
import logging
from functools import partial
from typing import Any

import websockets
from amqtt.adapters import WebSocketsReader, WebSocketsWriter
from amqtt.broker import Broker
from amqtt.contexts import ListenerType
from websockets.asyncio.server import ServerConnection, broadcast
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode

from ecq.broker.amqtt_hooks.seam import replace, step
from ecq.broker.amqtt_hooks.target import find_target

log = logging.getLogger(__name__)
_closing: set[asyncio.Task] = set()  # closing handshakes under way (referenced, so that they are not collected)
FIXED_HEADER_MAX_BYTES = 5  # packet type and flags, and a remaining length of up to 4 bytes (MQTT 3.1.1 section 2.2)


class _SendingWebSocketsWriter(WebSocketsWriter):
    """amqtt's WebSocket writer whose ``write()`` sends: each call becomes one binary WebSocket message,
    handed to the socket before it returns (MQTT packets may share or span WebSocket messages, MQTT 3.1.1
    section 6), so writes leave in the order they were made whether or not anyone drains. ``drain()`` waits,
    as a TCP writer's does, while the socket's write buffer is above its high-water mark.

    A write to a connection that is closing or closed is dropped, as on a closed TCP socket (a delivery not
    acked is sent again on reconnect; a write not acked is resent by its publisher, MQTT 3.1.1 section 4.4).
    """

    def write(self, data: bytes) -> None:
        broadcast([self._protocol], data)  # websockets' synchronous send: frames and writes to the transport

    async def drain(self) -> None:
        await self._protocol.drain()

    async def close(self) -> None:
        """Start the closing handshake without waiting for the client's close frame: amqtt's ``close()`` waits for it
        (websockets' ``close_timeout``, 10 s), and a persistent session's takeover held the new connection's CONNACK
        that long; websockets ends the TCP connection itself once the handshake is done or timed out."""
        _closing.add(task := asyncio.ensure_future(self._protocol.close()))
        task.add_done_callback(_closing.discard)


class _WebSocketsReaderEndingAtTheClose(WebSocketsReader):
    """amqtt's WebSocket reader whose stream ends where the connection closed: ``read(n)`` then returns what
    was received, fewer than ``n`` bytes, and amqtt drops the packet cut short (as ``readexactly`` does on TCP)."""

    async def _feed_buffer(self, n: int = 1) -> None:
        buffer = bytearray(self._stream.read())
        while len(buffer) < n:
            try:
                message = await self._protocol.recv()
            except ConnectionClosed:
                break
            buffer.extend(message.encode() if isinstance(message, str) else message)
        self._stream = io.BytesIO(buffer)


def correct_websocket_adapters() -> None:
    """Correct amqtt 0.12.1's WebSocket adapters for a broker that runs the ECQ plugin: ``WebSocketsWriter.write()``
    sends nothing until ``drain()`` (whose send also dropped what was written meanwhile), and
    ``WebSocketsReader._feed_buffer`` keeps the last message it received when ``recv()`` raises ConnectionClosed
    and appends it again until it has the bytes it was asked for. ``Broker._client_connected`` gets a
    :class:`_SendingWebSocketsWriter` and a :class:`_WebSocketsReaderEndingAtTheClose` on the same connection."""

    def adapters(broker: Broker, listener_name: str, reader: Any, writer: Any) -> tuple[Any, ...] | None:
        if find_target(broker.plugins_manager) is None:
            return None
        if type(writer) is WebSocketsWriter:
            writer = _SendingWebSocketsWriter(writer._protocol)
        if type(reader) is WebSocketsReader:
            reader = _WebSocketsReaderEndingAtTheClose(reader._protocol)
        return broker, listener_name, reader, writer

    step(Broker, "_client_connected", before=adapters)


def take_websocket_messages_of_the_largest_packet() -> None:
    """Correct amqtt 0.12.1 ``Broker._create_server_instance``, which opens a ``type: ws`` listener with websockets'
    default ``max_size`` of 1 MiB per incoming WebSocket message: a client that sends an MQTT packet in one message
    (paho does) could not write a payload near ``max_payload_bytes``, and its connection was closed (1009)
    with nothing in the broker's log. For a broker that runs the ECQ plugin a message may hold the largest packet
    the broker reads (``max_packet_bytes`` plus its fixed header, the bound ECQ's packet checks apply to every
    transport); a larger one closes the connection, and that is logged with its size.
    """
    original = Broker._create_server_instance

    async def create_server_instance(broker: Broker, listener_name: str, listener_type: ListenerType,
                                     address: str | None, port: int, ssl_context: Any) -> Any:
        plugin = find_target(broker.plugins_manager)
        if plugin is None or listener_type != ListenerType.WS:
            return await original(broker, listener_name, listener_type, address, port, ssl_context)
        return await websockets.serve(partial(_serve_websocket, broker, listener_name), address, port,
                                      ssl=ssl_context, subprotocols=[websockets.Subprotocol("mqtt")],
                                      max_size=plugin.settings.effective_max_packet_bytes() + FIXED_HEADER_MAX_BYTES)

    replace(Broker, "_create_server_instance", create_server_instance)


async def _serve_websocket(broker: Broker, listener_name: str, websocket: ServerConnection) -> None:
    """Serve one WebSocket connection as amqtt does; log it when websockets closed it for a message over the limit."""
    await broker.ws_connected(websocket, listener_name=listener_name)
    close = websocket.protocol.close_sent
    if close is not None and close.code == CloseCode.MESSAGE_TOO_BIG:
        host, port = websocket.remote_address[:2]
        log.warning("ECQ closed the WebSocket connection of %s:%s: %s (the largest packet the broker reads, "
                    "plus its fixed header)", host, port, close.reason)
