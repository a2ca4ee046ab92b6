"""The ``floor`` scenario: what any Python asyncio MQTT server costs per connecting device on this machine, against
Mosquitto in the same run, so that issue 32's connect and memory targets (0.5x Mosquitto's connect rate, 8 KiB per
idle connection, 12 KiB per consumer) can be read against what Python itself allows.

Each round starts, one after the other on a free loopback port, the two bare servers of
:mod:`benchlib.floor_server` (``protocol``: packets cut in ``data_received``; ``streams``: a reader task per
connection, amqtt's structure) and Mosquitto 2, and connects ``--floor-clients`` raw-socket devices from one load
process (64 CONNECTs in flight, MQTT 3.1.1, keepalive 60 s), each then subscribing to ``dev/<clientid>/#`` when the
kind is ``consumer``. Figures per device: the server's CPU time (``/proc/<pid>/stat``) over the connect phase, and its
RSS growth (``VmRSS``) with every device still connected. The rows' ECQ column is the Python server, the baseline
Mosquitto; the ratio is Mosquitto's CPU over Python's (the connect rate either could reach on one core).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.brokers import MosquittoBroker
from benchlib.fleetload import connect_packet, subscribe_packet
from benchlib.report import Row, ScenarioResult
from benchlib.scenarios import Bench, progress
from ecq.testing import free_port

SHAPES = ("protocol", "streams")
KINDS = ("idle", "consumer")
IN_FLIGHT = 64  # CONNECTs in flight from the load process
PHASE_TIMEOUT_S = 300.0


def floor(bench: Bench, out: ScenarioResult) -> None:
    """The scenario: ``--floor-rounds`` rounds of each kind, each server in turn within a round."""
    args = bench.args
    if not MosquittoBroker.version():
        out.status, out.message = "skipped", "no mosquitto on PATH (scripts/setup bench installs Debian's mosquitto)"
        return
    runs: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.floor_rounds):
        for kind in KINDS:
            for server in (*SHAPES, "mosquitto"):
                progress(f"floor: {args.floor_clients:,} {kind} devices on {server}")
                runs.setdefault(f"{server} {kind}", []).append(measure(server, kind, args.floor_clients))
    out.details.update(clients=args.floor_clients, rounds=args.floor_rounds, runs=runs)
    for kind in KINDS:
        mosquitto = runs[f"mosquitto {kind}"]
        for shape in SHAPES:
            python = runs[f"{shape} {kind}"]
            out.rows.append(Row("floor", f"Mosquitto's CPU per {kind} connect / Python {shape}'s", "x", None,
                                _median(mosquitto, "cpu_us") / _median(python, "cpu_us"), None,
                                note=f"Python {_median(python, 'cpu_us'):.0f} us, Mosquitto "
                                     f"{_median(mosquitto, 'cpu_us'):.0f} us per device (medians of "
                                     f"{args.floor_rounds}); issue 32's connect target: >= 0.5x"))
            out.rows.append(Row("floor", f"RSS per {kind} connection, Python {shape}", "KiB", None,
                                _median(python, "rss_kib"), _median(mosquitto, "rss_kib"),
                                note="baseline: Mosquitto"))


def _median(runs: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(run[key] for run in runs), 2)


def measure(server: str, kind: str, clients: int) -> dict[str, float]:
    """Start ``server``, connect ``clients`` devices of ``kind``, and return its CPU (us) and RSS growth (KiB) per
    device, with the connect phase's wall seconds; the server is stopped afterwards."""
    with tempfile.TemporaryDirectory() as workdir:
        process, port = _start(server, Path(workdir))
        try:
            time.sleep(0.5)  # let it settle before the baseline
            cpu_before, rss_before = _cpu_s(process.pid), _rss_kib(process.pid)
            load = subprocess.Popen([sys.executable, "-m", "benchlib.floor", str(port), str(clients), kind],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    cwd=Path(__file__).resolve().parent.parent)
            try:
                wall_s = float(load.stdout.readline() or "nan")
                cpu_s, rss_kib = _cpu_s(process.pid) - cpu_before, _rss_kib(process.pid) - rss_before
            finally:
                load.stdin.close()
                load.wait(60)
        finally:
            process.kill()
            process.wait(10)
    return {"cpu_us": cpu_s / clients * 1e6, "rss_kib": rss_kib / clients, "wall_s": wall_s}


def _start(server: str, workdir: Path) -> tuple[Any, int]:
    if server == "mosquitto":
        broker = MosquittoBroker(workdir).start()
        return broker.proc, broker.port
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "benchlib.floor_server", server, str(port)],
                               stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the {server} floor server did not start")
    return process, port


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_kib(pid: int) -> int:
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1])


async def _connect_all(port: int, clients: int, kind: str, kept: list[asyncio.StreamWriter]) -> float:
    """Connect ``clients`` devices (``IN_FLIGHT`` at a time) into ``kept``; returns the wall seconds it took."""
    room = asyncio.Semaphore(IN_FLIGHT)

    async def device(number: int) -> None:
        async with room:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(connect_packet(f"dev{number}", kind == "idle", 60, None))
            assert (await reader.readexactly(4))[3] == 0
            if kind == "consumer":
                writer.write(subscribe_packet(1, f"dev/dev{number}/#"))
                await reader.readexactly(5)
            kept.append(writer)

    started = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(device(n) for n in range(clients))), PHASE_TIMEOUT_S)
    return time.monotonic() - started


def _load(port: int, clients: int, kind: str) -> None:
    """The load process: connect, print the connect phase's seconds, hold every device until stdin closes."""
    async def run() -> None:
        kept: list[asyncio.StreamWriter] = []
        print(f"{await _connect_all(port, clients, kind, kept):.3f}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(run())


if __name__ == "__main__":
    _load(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
