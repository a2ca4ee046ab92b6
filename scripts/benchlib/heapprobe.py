"""Where a device's memory goes: one ECQ broker in this process, N raw-socket devices, the heap before and after.

    cd scripts && PYTHONPATH=.. ../.venv/bin/python -m benchlib.heapprobe [--clients 2000] [--trace]

Three phases, each measured from the same baseline (the broker started, nothing connected): N clean-session
devices connected and idle; N persistent consumers (clean session 0, SUBSCRIBE ``$ECQ/<cid>/#`` at QoS 1, queue
empty); the same consumers after DISCONNECT (offline persistent sessions). Per phase it prints the growth of
RSS per device in KiB (``/proc/self/status``, after a full collection and ``malloc_trim``: glibc only) and the
objects per device by type; with ``--trace`` (tracemalloc, 1 frame: RSS is then meaningless) the bytes per
device of the top allocation sites. The devices are blocking sockets of this process's main thread (about 0.3 KiB
of Python objects each, counted in RSS, left out of the traced sites); the broker's loop runs in a second thread.
This is the in-process complement of ``scripts/bench --scenario fleet`` (RSS only, out of process, against
Mosquitto and stock amqtt).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import gc
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

from benchlib.fleetload import connect_packet, subscribe_packet

DISCONNECT = b"\xe0\x00"


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def settle() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


class BrokerThread:
    """The ECQ broker (packaged config, a fresh data dir, a free port) on its own event loop thread."""

    def __init__(self, workdir: str) -> None:
        from ecq.broker.config_file import prepare
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.config = prepare(None, bind=f"127.0.0.1:{self.port}", data_dir=Path(workdir))
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        if not self.started.wait(30):
            raise RuntimeError("broker did not start")

    def _run(self) -> None:
        from amqtt.broker import Broker
        asyncio.set_event_loop(self.loop)
        async def start():
            self.broker = Broker(self.config)
            await self.broker.start()
        self.loop.run_until_complete(start())
        self.started.set()
        self.loop.run_forever()

    def call(self, fn, timeout: float = 60.0):
        """``fn()`` run on the broker's loop, its result returned here."""
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def engine(self):
        """The ECQ plugin's QueueEngine (call on the broker's loop)."""
        from ecq.broker.amqtt_hooks.target import find_target
        return find_target(self.broker.plugins_manager).engine

    def connections(self) -> int:
        """The connections the broker serves now (call on the broker's loop)."""
        from ecq.broker.amqtt_hooks import connection_is_open
        return sum(connection_is_open(handler) for _, handler in self.broker._sessions.values())

    def wait_until(self, predicate, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.call(predicate):
            if time.monotonic() > deadline:
                raise TimeoutError("broker did not settle")
            time.sleep(0.2)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.broker.shutdown(), self.loop).result(120)
        self.loop.call_soon_threadsafe(self.loop.stop)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed by the broker")
        data += chunk
    return data


def open_devices(port: int, prefix: str, count: int, persistent: bool) -> list[socket.socket]:
    socks = []
    for i in range(count):
        cid = f"{prefix}{i}"
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(connect_packet(cid, not persistent, 60, None))
        if recv_exact(sock, 4)[3] != 0:
            raise ConnectionError(f"{cid} refused")
        if persistent:
            sock.sendall(subscribe_packet(1, f"$ECQ/{cid}/#"))
            recv_exact(sock, 5)
        socks.append(sock)
    return socks


def warm_up(broker: BrokerThread) -> None:
    """One persistent device connected, subscribed and gone: what the broker makes once (lazy imports, caches) is
    then not counted per device."""
    for sock in open_devices(broker.port, "warm-up", 1, persistent=True):
        sock.sendall(DISCONNECT)
        sock.close()
    broker.wait_until(lambda: all(s.transitions.state == "disconnected" for s, _ in broker.broker._sessions.values()))


def type_counts() -> collections.Counter:
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


class Measure:
    """The growth between a baseline and now: RSS, objects by type, traced sites, each per device."""

    def __init__(self, trace: bool) -> None:
        self.trace = trace
        settle()
        self.rss, self.types = rss_bytes(), type_counts()
        self.snapshot = tracemalloc.take_snapshot() if trace else None

    def report(self, label: str, devices: int) -> None:
        settle()
        rss = (rss_bytes() - self.rss) / devices / 1024
        grown = type_counts() - self.types
        objects = sum(grown.values()) / devices
        print(f"\n== {label}: {devices} devices")
        if not self.trace:
            print(f"RSS per device {rss:.1f} KiB")
        print(f"objects per device {objects:.0f}: " +
              ", ".join(f"{name} {n / devices:.1f}" for name, n in grown.most_common(14)))
        if self.trace:
            here = tracemalloc.Filter(False, __file__)
            diff = tracemalloc.take_snapshot().filter_traces([here]).compare_to(
                self.snapshot.filter_traces([here]), "lineno")
            total = sum(d.size_diff for d in diff)
            print(f"traced per device {total / devices / 1024:.2f} KiB; top sites (bytes per device):")
            for d in diff[:25]:
                frame = d.traceback[0]
                print(f"  {d.size_diff / devices:8.0f}  {frame.filename.split('site-packages/')[-1]}:{frame.lineno}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=2000)
    parser.add_argument("--trace", action="store_true", help="tracemalloc sites (RSS then not reported)")
    parser.add_argument("--phase", choices=("idle", "persistent"), help="one phase (default: each in its own process)")
    args = parser.parse_args()
    if args.phase is None:
        for phase in ("idle", "persistent"):
            subprocess.run([sys.executable, "-m", "benchlib.heapprobe", *sys.argv[1:], "--phase", phase],
                           check=True, cwd=Path(__file__).resolve().parent.parent)
        return
    with tempfile.TemporaryDirectory() as workdir:
        broker = BrokerThread(workdir)
        warm_up(broker)
        if args.trace:
            tracemalloc.start(1)
        n, base = args.clients, Measure(args.trace)
        if args.phase == "idle":
            devices = open_devices(broker.port, "idle", n, persistent=False)  # kept: a dropped socket closes
            broker.wait_until(lambda: broker.connections() == n)
            base.report("idle connections (clean session)", n)
            assert broker.call(broker.connections) == n, "connections closed while measured"
            del devices
        else:
            tasks = broker.call(lambda: len(asyncio.all_tasks()))
            consumers = open_devices(broker.port, "dev", n, persistent=True)
            base.report("connected consumers (clean session 0, subscribed $ECQ/<cid>/#)", n)
            for sock in consumers:
                sock.sendall(DISCONNECT)
                sock.close()
            broker.wait_until(lambda: len(asyncio.all_tasks()) <= tasks and all(  # every connection's task ended
                s.transitions.state == "disconnected" for s, _ in broker.broker._sessions.values())
                and not broker.engine().consumers)  # and each consumer forgotten (ecq.broker.sessions.disconnected)
            base.report("offline persistent sessions", n)
        broker.stop()


if __name__ == "__main__":
    main()
