"""A TCP proxy that delays every byte by a fixed time, one way, keeping order: the network between machines of
one zone, on loopback, where `tc netem` is not available (this kernel has no netem qdisc).

Each link ``LISTEN_PORT:TARGET_PORT`` accepts on 127.0.0.1:LISTEN_PORT and, per accepted connection, opens one
to 127.0.0.1:TARGET_PORT; every chunk read on either side is written to the other side ``delay`` seconds
after it was read (so a round trip through it takes two delays). Flow control is passed through (a side that
cannot take more pauses the reading of the other); a close is passed on once what was read before it is
written. All links of a process run on one asyncio event loop, in its own process (so its CPU is measured
apart): ``python -m benchlib.delayproxy --delay-ms 5 PORT:TARGET ...`` prints ``ready`` once every link listens
and runs until SIGTERM or SIGINT.

What it costs: a chunk crosses the proxy with one read and one write system call and one timer; a message of
a few hundred bytes is one chunk, so its CPU grows with messages, not bytes (the netdelay scenario prints it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import select
import signal
import subprocess
import sys
from pathlib import Path

from ecq.testing import wait_until

HOST = "127.0.0.1"
READY_TIMEOUT_S = 10.0


class _Delayed:
    """One direction of one proxied connection: chunks written to ``out`` ``delay`` seconds after :meth:`send`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self._loop, self._delay = loop, delay
        self._pending: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self.out: asyncio.Transport | None = None

    def send(self, data: bytes | None) -> None:
        """Write ``data`` after the delay; None closes ``out`` then (after everything sent before)."""
        self._pending.append((self._loop.time() + self._delay, data))
        if self._timer is None and self.out is not None:
            self._timer = self._loop.call_at(self._pending[0][0], self._flush)

    def connected(self, out: asyncio.Transport) -> None:
        """``out`` is open: what was sent meanwhile goes out at its time."""
        self.out = out
        if self._pending and self._timer is None:
            self._timer = self._loop.call_at(self._pending[0][0], self._flush)

    def _flush(self) -> None:
        self._timer = None
        now = self._loop.time()
        while self._pending and self._pending[0][0] <= now:
            data = self._pending.popleft()[1]
            if data is None:
                self.out.close()
                self._pending.clear()
                return
            self.out.write(data)
        if self._pending:
            self._timer = self._loop.call_at(self._pending[0][0], self._flush)


class _Side(asyncio.Protocol):
    """One socket of a proxied connection: what it reads goes to ``forward``; ``backward`` writes to it."""

    def __init__(self, forward: _Delayed, backward: _Delayed) -> None:
        self.forward, self.backward = forward, backward
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.backward.connected(transport)

    def data_received(self, data: bytes) -> None:
        self.forward.send(data)

    def eof_received(self) -> bool:
        self.forward.send(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.forward.send(None)

    def pause_writing(self) -> None:  # this side's socket is full: stop reading the other side
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None and not self.peer.transport.is_closing():
            self.peer.transport.resume_reading()


def _link_factory(loop: asyncio.AbstractEventLoop, target_port: int, delay: float):
    """The protocol factory of one listening link: each accepted connection opens its own to the target."""
    def accepted() -> _Side:
        up, down = _Delayed(loop, delay), _Delayed(loop, delay)
        client = _Side(forward=up, backward=down)
        upstream = _Side(forward=down, backward=up)
        client.peer, upstream.peer = upstream, client

        async def connect() -> None:
            try:
                await loop.create_connection(lambda: upstream, HOST, target_port)
            except OSError:
                if client.transport is not None:
                    client.transport.close()

        loop.create_task(connect())
        return client
    return accepted


async def serve(links: list[tuple[int, int]], delay: float) -> None:
    """Listen on every ``(listen_port, target_port)`` of ``links``; print ``ready``; run until SIGTERM/SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    servers = [await loop.create_server(_link_factory(loop, target, delay), HOST, listen, backlog=1024)
               for listen, target in links]
    print("ready", flush=True)
    await stop.wait()
    for server in servers:
        server.close()


class ProxyProcess:
    """The proxy as a child process: ``links`` as for :func:`serve`, ``delay_ms`` one way. :meth:`start` returns
    once it listens (RuntimeError if not within READY_TIMEOUT_S); ``pid`` for the CPU sampler."""

    def __init__(self, links: list[tuple[int, int]], delay_ms: float) -> None:
        self.links, self.delay_ms = links, delay_ms
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> ProxyProcess:
        scripts = str(Path(__file__).resolve().parents[1])
        command = [sys.executable, "-m", "benchlib.delayproxy", "--delay-ms", str(self.delay_ms),
                   *(f"{listen}:{target}" for listen, target in self.links)]
        self.proc = subprocess.Popen(command, cwd=scripts, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        said = select.select([self.proc.stdout], [], [], READY_TIMEOUT_S)[0]
        if not said or self.proc.stdout.readline().strip() != "ready":  # printed once listening
            self.stop()
            raise RuntimeError(f"delay proxy did not start (exit {self.proc.returncode})")
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        if not wait_until(lambda: self.proc.poll() is not None, 5.0, 0.05):
            self.proc.kill()
            self.proc.wait(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay, milliseconds")
    parser.add_argument("links", nargs="+", metavar="PORT:TARGET", help="listen on PORT, forward to TARGET")
    args = parser.parse_args()
    links = [tuple(int(p) for p in link.split(":")) for link in args.links]
    asyncio.run(serve(links, args.delay_ms / 1000))


if __name__ == "__main__":
    main()
