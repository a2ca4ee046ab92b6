"""Load processes of the fleet scenario: tens of thousands of MQTT 3.1.1 devices, each a raw socket and a few
bytes of state (an aiomqtt client per device would cost the load side more than the broker pays, and measure the
generator). Only what a device does: CONNECT, SUBSCRIBE at QoS 1, PUBACK what arrives, PINGREQ on its keepalive,
DISCONNECT; and one producer connection per process pipelining QoS 1 PUBLISHes (MQTT 3.1.1 sections 3.1-3.14).

The parent (:class:`FleetLoad`) keeps ``procs`` spawned processes; each holds its devices between commands, so
connections stay up while the parent reads the broker's RSS and CPU. Every command carries a deadline and returns
what it reached by then (``timed_out``), never hangs. Devices bind to the given loopback source addresses in turn.
Instants are ``time.monotonic_ns()`` (one clock for every process on the host).
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from benchlib.procpool import ProcessPool

PRODUCER_WINDOW = 100        # QoS 1 PUBLISHes in flight on a producer connection
PING_TICK_S = 1.0            # how often a process looks for devices whose PINGREQ is due
CLOSE_WAIT_S = 10.0          # for the broker to close connections after DISCONNECT
MAX_ERRORS_KEPT = 5

CONNACK, PUBLISH, PUBACK, SUBACK, PINGRESP = 0x20, 0x30, 0x40, 0x90, 0xD0


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("!H", len(data)) + data


def _packet(first_byte: int, body: bytes) -> bytes:
    """A control packet: fixed header (type and flags, Remaining Length as a variable byte integer) and body."""
    length, encoded = len(body), bytearray()
    while True:
        digit, length = length % 128, length // 128
        encoded.append(digit | (0x80 if length else 0))
        if not length:
            return bytes([first_byte]) + bytes(encoded) + body


def connect_packet(clientid: str, clean_session: bool, keepalive_s: int, username: str | None) -> bytes:
    """CONNECT, MQTT 3.1.1 (protocol level 4), section 3.1."""
    flags = (0x02 if clean_session else 0) | (0x80 if username else 0)
    body = _string("MQTT") + bytes([4, flags]) + struct.pack("!H", keepalive_s) + _string(clientid)
    return _packet(0x10, body + (_string(username) if username else b""))


def subscribe_packet(packet_id: int, topic_filter: str) -> bytes:
    """SUBSCRIBE one filter at QoS 1, section 3.8."""
    return _packet(0x82, struct.pack("!H", packet_id) + _string(topic_filter) + b"\x01")


def publish_packet(packet_id: int, topic: str, payload: bytes) -> bytes:
    """PUBLISH at QoS 1, section 3.3."""
    return _packet(0x32, _string(topic) + struct.pack("!H", packet_id) + payload)


PINGREQ = b"\xc0\x00"
DISCONNECT = b"\xe0\x00"


class Device(asyncio.Protocol):
    """One connection: parses what the broker sends, PUBACKs QoS 1 PUBLISHes (counted in ``counts``), resolves
    the one awaited CONNACK or SUBACK, and tells a producer's ``on_puback`` about each PUBACK."""

    __slots__ = ("clientid", "counts", "transport", "buffer", "waiting", "received", "closed", "next_ping",
                 "on_puback")

    def __init__(self, clientid: str, counts: Counts) -> None:
        self.clientid, self.counts = clientid, counts
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.waiting: asyncio.Future | None = None
        self.received = 0
        self.closed = asyncio.get_running_loop().create_future()
        self.next_ping = 0.0
        self.on_puback = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if self.waiting and not self.waiting.done():
            self.waiting.set_exception(ConnectionError("connection closed by the broker"))

    def send(self, data: bytes) -> None:
        if self.transport and not self.transport.is_closing():
            self.transport.write(data)

    def expect(self) -> asyncio.Future:
        """A future for the next CONNACK or SUBACK body (bytes)."""
        self.waiting = asyncio.get_running_loop().create_future()
        return self.waiting

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        while len(buffer) >= 2:
            length, multiplier, at = 0, 1, 1
            while True:
                if at >= len(buffer):
                    self.buffer = buffer
                    return
                digit = buffer[at]
                length += (digit & 0x7F) * multiplier
                multiplier *= 128
                at += 1
                if not digit & 0x80:
                    break
            if len(buffer) < at + length:
                break
            self.handle(buffer[0], buffer[at:at + length])
            buffer = buffer[at + length:]
        self.buffer = buffer

    def handle(self, first_byte: int, body: bytes) -> None:
        kind = first_byte & 0xF0
        if kind == PUBLISH:
            qos = (first_byte >> 1) & 3
            if qos:
                topic_end = 2 + struct.unpack_from("!H", body)[0]
                self.send(b"\x40\x02" + body[topic_end:topic_end + 2])
            self.received += 1
            self.counts.delivered += 1
            self.counts.last_delivery_ns = time.monotonic_ns()
        elif kind == PUBACK:
            if self.on_puback:
                self.on_puback()
        elif kind in (CONNACK, SUBACK):
            if self.waiting and not self.waiting.done():
                self.waiting.set_result(body)

    def close(self) -> None:
        if self.transport:
            self.transport.close()


@dataclass
class Counts:
    """What a process's devices received since the last reset."""

    delivered: int = 0
    last_delivery_ns: int = 0


@dataclass(frozen=True)
class Target:
    """Where and how the devices connect: the broker's host and port, the username they send (stock amqtt keeps
    QoS 1 messages for offline sessions only for authenticated ones), keepalive in seconds, and the loopback
    source addresses they bind to in turn."""

    host: str
    port: int
    sources: tuple[str, ...]
    username: str | None = "bench"
    keepalive_s: int = 60


class Worker:
    """The state of one load process: its devices by clientid, its producer, the errors seen."""

    def __init__(self) -> None:
        self.devices: dict[str, Device] = {}
        self.counts = Counts()
        self.errors: list[str] = []
        self.error_count = 0
        self.next_source = 0
        self.pinger: asyncio.Task | None = None

    def error(self, exc: BaseException) -> None:
        self.error_count += 1
        text = f"{type(exc).__name__}: {exc}"
        if len(self.errors) < MAX_ERRORS_KEPT and text not in self.errors:
            self.errors.append(text)

    async def open(self, target: Target, clientid: str, clean_session: bool) -> tuple[Device, bool]:
        """Connect one device; returns it and CONNACK's session present flag. Raises ConnectionError (refused:
        with the return code) or OSError."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((target.sources[self.next_source % len(target.sources)], 0))
            self.next_source += 1
            await loop.sock_connect(sock, (target.host, target.port))
        except BaseException:
            sock.close()
            raise
        _, device = await loop.create_connection(lambda: Device(clientid, self.counts), sock=sock)
        answer = device.expect()
        device.send(connect_packet(clientid, clean_session, target.keepalive_s, target.username))
        try:
            body = await answer
        except BaseException:
            device.close()
            raise
        if body[1] != 0:
            device.close()
            raise ConnectionError(f"CONNACK return code {body[1]}")
        device.next_ping = time.monotonic() + random.uniform(0.25, 0.75) * target.keepalive_s
        return device, bool(body[0] & 1)

    async def subscribe(self, device: Device, topic_filter: str) -> None:
        """SUBSCRIBE and wait for the SUBACK; raises ConnectionError when the broker refused (0x80)."""
        answer = device.expect()
        device.send(subscribe_packet(1, topic_filter))
        if (await answer)[2] == 0x80:
            raise ConnectionError(f"SUBACK refused {topic_filter!r}")

    async def ping(self, keepalive_s: int) -> None:
        """PINGREQ each device when due: at a random point of its first keepalive interval, then every 3/4 of it,
        so that pings spread over time as a fleet's do."""
        while True:
            await asyncio.sleep(PING_TICK_S)
            now = time.monotonic()
            for device in list(self.devices.values()):
                if device.next_ping <= now:
                    device.send(PINGREQ)
                    device.next_ping = now + 0.75 * keepalive_s

    async def connect(self, target: Target, clientids: list[str], clean_session: bool, topic_format: str | None,
                      deadline_s: float, concurrency: int) -> dict[str, Any]:
        """Connect (and subscribe ``topic_format``, ``{cid}``) each clientid, ``concurrency`` at a time, keeping
        them connected; stops starting new ones at the deadline."""
        if self.pinger is None:
            self.pinger = asyncio.ensure_future(self.ping(target.keepalive_s))
        start_ns = time.monotonic_ns()
        ends = time.monotonic() + deadline_s
        done = {"connected": 0, "session_present": 0, "failed": 0, "end_ns": start_ns}
        gate = asyncio.Semaphore(concurrency)

        async def one(clientid: str) -> None:
            async with gate:
                if time.monotonic() >= ends:
                    return
                try:
                    device, present = await self.open(target, clientid, clean_session)
                    self.devices[clientid] = device
                    if topic_format:
                        await self.subscribe(device, topic_format.format(cid=clientid))
                except (OSError, ConnectionError) as exc:
                    self.error(exc)
                    done["failed"] += 1
                    return
                done["connected"] += 1
                done["session_present"] += present
                done["end_ns"] = time.monotonic_ns()

        jobs = [asyncio.ensure_future(one(clientid)) for clientid in clientids]
        _, pending = await asyncio.wait(jobs, timeout=max(0.0, ends - time.monotonic())) if jobs else ((), ())
        for job in pending:
            job.cancel()
        return {**done, "start_ns": start_ns, "timed_out": bool(pending)}

    async def disconnect(self) -> dict[str, Any]:
        """DISCONNECT every device and wait (at most CLOSE_WAIT_S) until the broker closed them all."""
        devices = list(self.devices.values())
        self.devices.clear()
        for device in devices:
            device.send(DISCONNECT)
        closes = [device.closed for device in devices]
        if closes:
            _, pending = await asyncio.wait(closes, timeout=CLOSE_WAIT_S)
        else:
            pending = set()
        for device in devices:
            device.close()
        return {"disconnected": len(devices), "closed_late": len(pending)}

    async def publish(self, target: Target, topics: list[str], wait_deliveries: int, deadline_s: float,
                      producer_id: str, payload: bytes = b"fleet") -> dict[str, Any]:
        """One producer connection publishes one QoS 1 message with ``payload`` to each topic, PRODUCER_WINDOW in
        flight; waits for every PUBACK and until this process's devices received ``wait_deliveries`` messages, or the
        deadline. Without topics no producer connects: the process only waits for its devices' deliveries (of a write
        another process made)."""
        self.counts = Counts()
        for device in self.devices.values():
            device.counts = self.counts
        producer = (await self.open(target, producer_id, True))[0] if topics else None
        window = asyncio.Semaphore(PRODUCER_WINDOW)
        acked = {"count": 0, "last_ns": 0}

        def on_puback() -> None:
            acked["count"] += 1
            acked["last_ns"] = time.monotonic_ns()
            window.release()

        if producer:
            producer.on_puback = on_puback
        start_ns = time.monotonic_ns()

        async def send_all() -> None:
            for n, topic in enumerate(topics):
                await window.acquire()
                producer.send(publish_packet(n % 65535 + 1, topic, payload))
            while acked["count"] < len(topics) or self.counts.delivered < wait_deliveries:
                await asyncio.sleep(0.005)

        sending = asyncio.ensure_future(send_all())
        done, _ = await asyncio.wait([sending], timeout=deadline_s)
        if not done:
            sending.cancel()
        if producer:
            producer.send(DISCONNECT)
            producer.close()
        return {"published": len(topics), "acked": acked["count"], "acked_end_ns": acked["last_ns"],
                "delivered": self.counts.delivered, "delivered_end_ns": self.counts.last_delivery_ns,
                "start_ns": start_ns, "timed_out": not done}

    async def drain(self, topic_format: str, wait_deliveries: int, deadline_s: float) -> dict[str, Any]:
        """Every device of this process SUBSCRIBEs ``topic_format`` (``{cid}``) and PUBACKs what comes, until they
        received ``wait_deliveries`` together or the deadline; ``start_ns`` is the first SUBSCRIBE."""
        self.counts = Counts()
        for device in self.devices.values():
            device.counts = self.counts
        start_ns, ends = time.monotonic_ns(), time.monotonic() + deadline_s
        try:
            await asyncio.wait_for(asyncio.gather(*(self.subscribe(device, topic_format.format(cid=clientid))
                                                    for clientid, device in self.devices.items())), deadline_s)
        except (OSError, ConnectionError, TimeoutError) as exc:
            self.error(exc)
        while self.counts.delivered < wait_deliveries and time.monotonic() < ends:
            await asyncio.sleep(0.005)
        return {"start_ns": start_ns, "delivered": self.counts.delivered,
                "delivered_end_ns": self.counts.last_delivery_ns, "timed_out": self.counts.delivered < wait_deliveries}

    async def resume(self, target: Target, clientids: list[str], wait_s: float, concurrency: int) -> dict[str, Any]:
        """Persistent devices connect again (clean session 0) WITHOUT subscribing, all at once (``concurrency``
        CONNECTs in flight): how many get session present 1, how many receive a message within ``wait_s`` of the
        first CONNECT, and when the last of them had it (``all_received_s``, None if some never did); then they
        disconnect."""
        started = time.monotonic()
        connected = await self.connect(target, clientids, False, None, wait_s, concurrency)
        ends = started + wait_s
        while time.monotonic() < ends and any(d.received == 0 for d in self.devices.values()):
            await asyncio.sleep(0.05)
        received = sum(1 for d in self.devices.values() if d.received)
        all_received_s = round(time.monotonic() - started, 2) if received == len(clientids) else None
        await self.disconnect()
        return {**connected, "received": received, "all_received_s": all_received_s}


COMMANDS = {"connect": Worker.connect, "disconnect": Worker.disconnect, "drain": Worker.drain,
            "publish": Worker.publish, "resume": Worker.resume}


async def serve(conn) -> None:
    """Run each command received on ``conn`` (name, keyword arguments) and send back its result or its error."""
    worker, loop = Worker(), asyncio.get_running_loop()
    while (command := await loop.run_in_executor(None, conn.recv)) is not None:
        name, kwargs = command
        try:
            result = await COMMANDS[name](worker, **kwargs)
            result.update(errors=list(worker.errors), error_count=worker.error_count)
        except Exception as exc:  # reported to the parent, which decides
            result = {"error": f"{type(exc).__name__}: {exc}"}
        worker.errors, worker.error_count = [], 0
        conn.send(result)


def worker_main(conn) -> None:
    """A fleet load process."""
    asyncio.run(serve(conn))


class FleetLoadTimeout(RuntimeError):
    """A load process gave no answer in time (it was killed; the pool is unusable)."""


class FleetLoad(ProcessPool):
    """``size`` spawned load processes; a command goes to all of them, each with its own arguments."""

    def start(self) -> FleetLoad:
        """Spawn the processes."""
        self._spawn(worker_main, lambda _n, conn: (conn,), "fleet-load")
        return self

    def run(self, name: str, per_process: list[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
        """Send command ``name`` with ``per_process[i]`` to process i; their results in order. A process that does
        not answer within ``timeout_s`` (its own deadline has passed long before) raises FleetLoadTimeout."""
        for conn, kwargs in zip(self._conns, per_process):
            conn.send((name, kwargs))
        deadline, results = time.monotonic() + timeout_s, []
        for conn in self._conns:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise FleetLoadTimeout(f"a fleet load process gave no answer to {name} within {timeout_s:.0f} s")
            results.append(conn.recv())
        return results
