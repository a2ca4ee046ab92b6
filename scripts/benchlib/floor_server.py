"""The least a Python MQTT server can do for a connecting device, for the ``floor`` scenario: answer a CONNECT with
CONNACK 0 and a SUBSCRIBE with a SUBACK granting QoS 0, and nothing else (no session, no store, no routing, no
keepalive, no checks). Two shapes of it on asyncio:

- ``protocol``: an ``asyncio.Protocol`` that cuts packets in ``data_received`` (no task per connection);
- ``streams``: ``asyncio.start_server`` with a reader task per connection awaiting ``StreamReader.read``, amqtt's
  structure.

Run as ``python -m benchlib.floor_server protocol|streams PORT``; prints ``ready`` once listening on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import sys

CONNECT, SUBSCRIBE = 1, 8
CONNACK = bytes((0x20, 2, 0, 0))


def answers(data: bytes) -> tuple[bytes, int]:
    """The answers to the whole packets at the start of ``data`` (CONNACK, SUBACK; nothing to any other packet),
    and how many bytes they took."""
    out, start = [], 0
    while (header := _fixed_header(data, start)) is not None:
        kind, body, end = header
        if end > len(data):
            break
        if kind == CONNECT:
            out.append(CONNACK)
        elif kind == SUBSCRIBE:
            out.append(bytes((0x90, 3)) + data[body:body + 2] + b"\x00")
        start = end
    return b"".join(out), start


def _fixed_header(data: bytes, start: int) -> tuple[int, int, int] | None:
    """(packet type, offset of the body, offset of the end) of the packet at ``start``, None while incomplete."""
    length, shift, index = 0, 0, start + 1
    while index < len(data):
        byte = data[index]
        index += 1
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return data[start] >> 4, index, index + length
        shift += 7
    return None


class Answering(asyncio.Protocol):
    """One connection of the ``protocol`` server: what was received and not yet a whole packet, and its transport."""

    __slots__ = ("transport", "pending")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport, self.pending = transport, b""

    def data_received(self, data: bytes) -> None:
        data = self.pending + data if self.pending else data
        out, used = answers(data)
        self.pending = data[used:]
        if out:
            self.transport.write(out)


async def answer_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One connection of the ``streams`` server, until EOF."""
    pending = b""
    while data := await reader.read(65536):
        out, used = answers(pending + data)
        pending = (pending + data)[used:]
        if out:
            writer.write(out)
            await writer.drain()


async def serve(shape: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    if shape == "protocol":
        await loop.create_server(Answering, "127.0.0.1", port, backlog=4096)
    else:
        await asyncio.start_server(answer_stream, "127.0.0.1", port, backlog=4096)
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], int(sys.argv[2])))
