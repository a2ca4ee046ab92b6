"""The brokers a benchmark run talks to: `ecq broker` (amqtt 0.12.1 + ECQ) and stock amqtt 0.12.1 without
ECQ for the baselines, each in its own process on free loopback ports, or brokers already running elsewhere.

Every broker here has an ``endpoint`` for the load processes and a ``pid`` (None when not started by us)
for CPU and RSS sampling.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from benchlib.loadgen import Endpoint
from ecq.testing import BrokerProcess, free_port, port_open, wait_until

READY_TIMEOUT_S = 300.0   # a broker counting 1M stored entries at start-up takes a while
STOP_TIMEOUT_S = 60.0     # a clean stop commits what is queued and closes LevelDB
STOCK_AMQTT = Path(__file__).with_name("stock_amqtt.py")

# Options that differ from BrokerProcess's test defaults: measure the product defaults (heartbeat 5 s).
ECQ_BENCH_OPTIONS = {"heartbeat_interval": "5s"}
# Logged when a readiness probe (a bare TCP connect) closes without sending CONNECT: harmless.
PROBE_NOISE = ("No data to decode MQTT packet fixed header", "Failed to initialize client session")
LOG_PATTERNS_KEPT = 8
MOSQUITTO_AS_ROOT = "should not be run as root"   # its warning for `user root`, which the benchmark asks for


def exit_text(code: int) -> str:
    """``exit code 0``, or for a death by signal e.g. ``exit code -11 (SIGSEGV)``."""
    if code < 0:
        return f"exit code {code} ({signal.Signals(-code).name})"
    return f"exit code {code}"


def log_problems(text: str) -> dict[str, int]:
    """WARNING and ERROR lines of a broker log, and ECQ's INFO lines about deliveries that stopped or were
    sent again, with numbers (ids, packet ids) replaced by N, counted; the most frequent LOG_PATTERNS_KEPT
    patterns. Readiness-probe noise is left out."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        match = re.search(r" (WARNING|ERROR|CRITICAL|INFO(?= ecq\.delivery)) (.*)", line)
        if not match or any(noise in line for noise in PROBE_NOISE):
            continue
        pattern = re.sub(r"\d+", "N", f"{match.group(1)} {match.group(2)}")[:160]
        counts[pattern] = counts.get(pattern, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1])[:LOG_PATTERNS_KEPT])


class EcqBroker:
    """`ecq broker` in a child process with its data dir at ``workdir/data``; ``options`` are ECQ plugin options."""

    name = "ECQ (amqtt 0.12.1 + ECQ plugin)"

    def __init__(self, workdir: Path, **options) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.process = BrokerProcess(workdir, **{**ECQ_BENCH_OPTIONS, **options})
        self.endpoint = Endpoint("127.0.0.1", self.process.port)
        self.data_dir = self.process.data_dir
        self.queues_dir = self.process.queues_dir
        self.log_path = self.process.log_path
        self.admin_url = f"http://127.0.0.1:{self.process.admin_port}"
        self.pid: int | None = None

    def start(self) -> EcqBroker:
        """Start and wait until the admin API answers (ECQ's start-up work is done then); returns self.

        Raises RuntimeError (with the broker's log) when it does not come up within READY_TIMEOUT_S.
        """
        self.process.start()
        self.pid = self.process.proc.pid
        if not wait_until(self._healthy, READY_TIMEOUT_S, 0.2):
            self.process.kill()
            raise RuntimeError(f"ECQ admin API did not answer within {READY_TIMEOUT_S:.0f} s:\n{self.process.log()[-3000:]}")
        return self

    def _healthy(self) -> bool:
        try:
            return self.admin("GET", "/api/v1/health", timeout_s=2)["status"] == "ok"
        except OSError:
            return False

    def admin(self, method: str, path: str, timeout_s: float = 30.0) -> dict:
        """Call the admin API; returns the JSON answer. Raises OSError (urllib) on failure."""
        request = urllib.request.Request(self.admin_url + path, method=method)
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return json.loads(answer.read())

    def metric(self, name: str) -> float:
        """The value of one unlabelled Prometheus metric from /metrics (0 when absent)."""
        with urllib.request.urlopen(self.admin_url + "/metrics", timeout=30) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0

    def stop(self) -> str:
        """SIGTERM and wait for the clean exit (kill -9 after STOP_TIMEOUT_S); returns how it ended."""
        try:
            return exit_text(self.process.stop(STOP_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            self.process.kill()
            return f"KILLED: still running {STOP_TIMEOUT_S:.0f} s after SIGTERM"

    def config_in_use(self) -> dict:
        """The plugin options as parsed by the running broker (admin API), or {"error": ...}."""
        try:
            return self.admin("GET", "/api/v1/config?which=inuse")
        except OSError as exc:
            return {"error": str(exc)}

    def problems(self) -> dict[str, int]:
        """Counted WARNING/ERROR patterns of this broker's log so far (see log_problems)."""
        return log_problems(self.process.log())



class StockBroker:
    """Stock amqtt 0.12.1 without ECQ, in a child process, with only AnonymousAuthPlugin.

    ``allow_anonymous: false``: clients must send a username (they all send ``bench``); only then does
    amqtt keep QoS 1 messages for an offline persistent session (it drops them for anonymous sessions).
    """

    name = "stock amqtt 0.12.1 (AnonymousAuthPlugin only, no ECQ)"

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.endpoint = Endpoint("127.0.0.1", self.port)
        self.config_path = workdir / "stock-amqtt.yaml"
        self.log_path = workdir / "stock-amqtt.log"
        self.config_path.write_text(yaml.safe_dump({
            "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{self.port}"}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": False}},
        }))
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None

    def config_in_use(self) -> dict:
        """The YAML configuration it was started with."""
        return yaml.safe_load(self.config_path.read_text())

    def start(self) -> StockBroker:
        """Start and wait until the port accepts connections; raises RuntimeError with the log if not."""
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen([sys.executable, str(STOCK_AMQTT), str(self.config_path)],
                                         stdout=log, stderr=log)
        self.pid = self.proc.pid
        if not wait_until(lambda: self.proc.poll() is None and port_open(self.port), 20.0, 0.05):
            self.proc.kill()
            raise RuntimeError(f"stock amqtt did not start:\n{self.log_path.read_text()[-3000:]}")
        return self

    def problems(self) -> dict[str, int]:
        """Counted WARNING/ERROR patterns of this broker's log so far (see log_problems)."""
        return log_problems(self.log_path.read_text()) if self.log_path.exists() else {}

    def stop(self) -> str:
        """SIGTERM, then kill -9 if it has not exited within 15 s; returns how it ended."""
        if not self.proc or self.proc.poll() is not None:
            return "not running"
        self.proc.send_signal(signal.SIGTERM)
        try:
            return exit_text(self.proc.wait(15))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            return "KILLED: still running 15 s after SIGTERM"



class MosquittoBroker:
    """Mosquitto 2 (Debian's ``mosquitto``) in a child process on a free loopback port, anonymous clients allowed,
    with ``persistence true`` in ``workdir`` (sessions and their queued QoS 1 messages are written at SIGTERM and
    read at start, as Mosquitto documents), so a restart keeps persistent sessions. It stays root (``user root``)
    so that it can write its persistence file and inherits the benchmark's file descriptor limit."""

    name = "Mosquitto"

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.endpoint = Endpoint("127.0.0.1", self.port)
        self.config_path = workdir / "mosquitto.conf"
        self.log_path = workdir / "mosquitto.log"
        self.config_path.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\nuser root\npersistence true\n"
            f"persistence_location {workdir}/\nlog_dest stderr\nlog_type error\nlog_type warning\n")
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None

    @staticmethod
    def version() -> str | None:
        """``mosquitto version 2.0.11`` as ``2.0.11``; None when there is no mosquitto on PATH."""
        try:
            out = subprocess.run(["mosquitto", "-h"], capture_output=True, text=True, timeout=10).stdout
        except OSError:
            return None
        match = re.search(r"mosquitto version (\S+)", out)
        return match.group(1) if match else "unknown"

    def config_in_use(self) -> dict:
        """The configuration file it was started with, as lines."""
        return {"mosquitto.conf": self.config_path.read_text().splitlines()}

    def start(self) -> MosquittoBroker:
        """Start and wait until the port accepts connections; raises RuntimeError with the log if not."""
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(["mosquitto", "-c", str(self.config_path)], stdout=log, stderr=log)
        self.pid = self.proc.pid
        if not wait_until(lambda: self.proc.poll() is None and port_open(self.port), 20.0, 0.05):
            self.proc.kill()
            raise RuntimeError(f"mosquitto did not start:\n{self.log_path.read_text()[-3000:]}")
        return self

    def problems(self) -> dict[str, int]:
        """Counted error and warning lines of its log (numbers as N)."""
        counts: dict[str, int] = {}
        text = self.log_path.read_text() if self.log_path.exists() else ""
        for line in text.splitlines():
            if MOSQUITTO_AS_ROOT in line:
                continue
            pattern = re.sub(r"\d+", "N", line.split(": ", 1)[-1])[:160]
            counts[pattern] = counts.get(pattern, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: -item[1])[:LOG_PATTERNS_KEPT])

    def stop(self) -> str:
        """SIGTERM (Mosquitto then writes its persistence file), kill -9 after STOP_TIMEOUT_S; returns how it ended."""
        if not self.proc or self.proc.poll() is not None:
            return "not running"
        self.proc.send_signal(signal.SIGTERM)
        try:
            return exit_text(self.proc.wait(STOP_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            return f"KILLED: still running {STOP_TIMEOUT_S:.0f} s after SIGTERM"


class ExternalBroker:
    """A broker started by someone else at ``host:port`` (no pid: no CPU or RSS figures for it)."""

    def __init__(self, name: str, host: str, port: int) -> None:
        self.name = name
        self.endpoint = Endpoint(host, port)
        self.pid = None
        self.log_path = None

    def start(self) -> ExternalBroker:
        """Nothing to start: it runs already."""
        return self

    def stop(self) -> str:
        """Nothing to stop: it is not ours."""
        return "not ours"

    def config_in_use(self) -> dict:
        """Unknown."""
        return {}

    def problems(self) -> dict[str, int]:
        """Nothing known: its log is not ours to read."""
        return {}


def elapsed_s(started: float) -> float:
    """Seconds since ``started`` (a time.monotonic() value), rounded to ms."""
    return round(time.monotonic() - started, 3)
