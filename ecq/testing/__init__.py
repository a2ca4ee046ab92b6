"""Run `ecq broker` as a child process on a free loopback port: used by the tests and scripts/bench.

Every wait is bounded; a broker that does not come up raises RuntimeError with its log.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

ECQ = str(Path(sys.executable).with_name("ecq"))
START_TIMEOUT_S = 20.0
ANONYMOUS_AUTH = {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}


LOWEST_TEST_PORT = 10000
_handed_out: set[int] = set()
_rng = random.Random()  # its own: hypothesis seeds the module-level one inside its tests


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range and not handed out before by
    this process.

    Not ``bind(("127.0.0.1", 0))``: that picks from the ephemeral range, where the source port of any outgoing
    connection (a client's, a broker's to NATS) can take the port before the broker binds it, as a CI run
    once saw ("address already in use" on an admin port). Raises RuntimeError when no port is free.
    """
    return free_port_range(1)


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive ports that are free as free_port() says; the whole range is handed out.

    Under pytest-xdist each worker draws from its own slice of the range (:func:`_worker_ports`): a port handed out
    in one worker and not bound yet would look free to the other.
    """
    low, below = _worker_ports()
    for _ in range(1000):
        first = _rng.randrange(low, below - count)
        ports = range(first, first + count)
        if not any(port in _handed_out or _bound(port) for port in ports):
            _handed_out.update(ports)
            return first
    raise RuntimeError(f"no {count} free consecutive ports in {low}-{below - 1}")


def _worker_ports() -> tuple[int, int]:
    """(lowest, one past the highest) test port of this process: the whole range, or this pytest-xdist worker's
    slice of it (PYTEST_XDIST_WORKER ``gw<i>`` of PYTEST_XDIST_WORKER_COUNT)."""
    low, below = LOWEST_TEST_PORT, _ephemeral_low()
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return low, below
    width = (below - low) // count
    low += int(worker[2:]) * width
    return low, low + width


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (net.ipv4.ip_local_port_range), 32768 where unreadable."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bound(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def port_open(port: int) -> bool:
    """True when something accepts TCP connections on 127.0.0.1:``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class BrokerProcess:
    """`ecq broker` in a subprocess with its config, data dir (``workdir/data``, its LevelDB in ``queues_dir``,
    see ecq.store.layout) and log file under ``workdir``.

    ``plugin_options`` are ECQ plugin options (see ecq.config.EcqSettings); ``heartbeat_interval``
    defaults to 1 s here so that tests never wait long on a missed wake-up, and the admin API gets a
    free port of its own (``admin_port``). ``max_open_files``, when given, is the broker's file
    descriptor limit (``ulimit -n``, set with util-linux ``prlimit``). ``listeners`` are more amqtt listeners
    (name -> listener mapping, e.g. ``{"ws": {"type": "ws", "bind": "127.0.0.1:PORT"}}``) beside the default
    TCP one on ``port`` (opened before it: once ``port`` accepts, they do too).
    """

    def __init__(self, workdir: Path, *, max_open_files: int | None = None, listeners: dict | None = None,
                 **plugin_options) -> None:
        self.workdir = workdir
        self.max_open_files = max_open_files
        self.data_dir = workdir / "data"
        self.queues_dir = self.data_dir / "queues"
        self.port = free_port()
        self.log_path = workdir / "broker.log"
        self.config_path = workdir / "broker.yaml"
        self.admin_port = free_port()
        self.options = options = {"data_dir": str(self.data_dir), "heartbeat_interval": "1s",
                                  "admin_bind": f"127.0.0.1:{self.admin_port}", **plugin_options}
        config = {
            "listeners": {**(listeners or {}), "default": {"type": "tcp", "bind": f"127.0.0.1:{self.port}"}},
            "plugins": {**ANONYMOUS_AUTH, "ecq.broker.plugin.EcqPlugin": options},
        }
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))  # listeners open in this order
        self.proc: subprocess.Popen | None = None

    def start(self) -> BrokerProcess:
        """Start the broker and wait until its port accepts connections (raises RuntimeError if not)."""
        log = self.log_path.open("a")
        command = [ECQ, "broker", "-c", str(self.config_path)]
        if self.max_open_files is not None:  # prlimit execs the broker: the pid stays the broker's
            command = ["prlimit", f"--nofile={self.max_open_files}", *command]
        self.proc = subprocess.Popen(command, stdout=log, stderr=log, cwd=self.workdir)
        log.close()
        if not wait_until(self._accepting, START_TIMEOUT_S, 0.05):
            self.kill()
            raise RuntimeError(f"broker did not start:\n{self.log()}")
        return self

    def _accepting(self) -> bool:
        if self.proc and self.proc.poll() is not None:
            raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{self.log()}")
        return port_open(self.port)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait for a clean exit; returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL (kill -9): no chance to flush or close anything."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def open_store(self):
        """The broker's queue store, opened from its options as the broker opens it: LevelDB in its data dir
        (stop the broker first: LevelDB takes a lock) or its JetStream streams. Close it after use."""
        from ecq.config import EcqSettings
        from ecq.store.backends import open_store
        return open_store(EcqSettings(**self.options))

    def log(self) -> str:
        """Everything the broker wrote to stderr so far."""
        return self.log_path.read_text() if self.log_path.exists() else ""
