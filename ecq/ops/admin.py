"""Admin HTTP API of a running broker, served with aiohttp on ``admin_bind`` (default 127.0.0.1:18083).

All responses are JSON except ``/metrics`` (Prometheus text) and the dashboard's page (``/``, ecq.ops.dashboard).
With ``admin_token`` set, every request needs ``Authorization: Bearer <token>``; otherwise 401. Only the
dashboard's page and its script and stylesheet (``dashboard.PUBLIC_PATHS``, which hold no data) are served
without it: the page asks for the token and sends it with each of its requests. No answer shows the token
(``**********``).

Every request that is not GET or HEAD must come with a ``Host`` header naming this API's address, and its
``Origin`` header, when present, must be ``http://`` and such a host; otherwise 403 with the reason. This
stops a web page in the operator's browser from running GC or reloading the ACL: through DNS rebinding
(its Host is the attacker's name) or a cross-site form POST (its Origin is the attacker's site). The
accepted hosts are ``<admin_bind host>:<port>``, and when it is a loopback or wildcard address also
``127.0.0.1:<port>``, ``localhost:<port>`` and ``[::1]:<port>`` (the port may be left out when it is 80).

====== ============================ ==================================================================
method path                         answer
====== ============================ ==================================================================
GET    /api/v1/health               ``{"status": "ok"}``; 503 ``{"status": "degraded", "reason": ..., "problems":
                                    [...]}`` while store writes fail (disk full), and in a cluster within 2 s of
                                    the node losing NATS, of an ECQ stream losing its leader or running below its
                                    replica count (stream and server names given)
GET    /api/v1/ready                for a load balancer: 200 ``{"ready": true}`` when a write would be stored now
                                    and the node is not draining; else 503 ``{"ready": false, "reason": ...}``
GET    /api/v1/status               queues, messages, bytes, consumers online, first/last index entries; in a
                                    cluster ``cluster``: leaders per server, each stream's replicas
POST   /api/v1/cluster/rebalance    spread the stream leaders over the NATS servers: ``{"moved": [{"stream",
                                    "from", "to"}], "leaders": {server: count}}``; 409 without a cluster, 503
                                    when NATS does not answer
GET    /api/v1/queues/{clientid}    one queue (see ecq.ops.status.queue_info); 404 when unknown
POST   /api/v1/gc                   run GC now: ``{"deleted": rows}``
POST   /api/v1/queues/{clientid}/   rewind the queue (``to``: ``N``, ``earliest``, ``latest`` or ``since:<unix ms>``):
       rewind?to=POINT              ``{"clientid": ..., "acked": N}`` once stored (the next delivery is the
                                    first stored entry above N); 400 for a bad ``to`` or a seqno above the
                                    queue's last one, 404 for a queue with no seqno and no consumer state
                                    (nothing is created), 503 when it cannot be stored now
POST   /api/v1/scq/{queue}/readers/ rewind the position of the reader (a client id) in the SCQ ``queue``, as
       {reader}/rewind?to=POINT     above: ``{"scq": ..., "reader": ..., "acked": N}``; 400 for a bad queue
                                    name, 404 for a reader with no stored position and no consumer here
POST   /api/v1/queues/{clientid}/   write a tombstone for KEY through the normal write path:
       delete?key=KEY               ``{"clientid": ..., "key": ..., "seqno": N}`` once committed; 400 without a
       [&stored_only=1]             key, 409 with ``tombstones: false``, 503 when it cannot be stored now; with
                                    ``stored_only=1`` (``ecq delete`` without ``--force``), 404 and nothing
                                    written when the queue stores no value of KEY
GET    /api/v1/scq/{queue}          one SCQ and its readers (see ecq.ops.status.scq_info); 400 for a bad name,
                                    404 when unknown
POST   /api/v1/scq/{queue}/delete?  a tombstone for KEY in the SCQ, as for a queue above: ``{"scq": ..., "key":
       key=KEY[&stored_only=1]      ..., "seqno": N}``
POST   /api/v1/queues/{clientid}/   delete every stored entry of the queue (seqno counter and acked position
       purge                        stay): ``{"clientid": ..., "purged": n}``; 503 when it cannot be done now
GET    /api/v1/top?n=N&by=K         the N (1..1000, default 20) queues with the most pending entries (K
       [&scq=Q]                     ``pending``, the default), the oldest pending entry (``age``) or the most
                                    pending payload bytes (``bytes``), from the engine's lag index (see
                                    ecq.queue.lag.top_report), an SCQ reader's position as a row of kind
                                    ``scq``; with Q (an SCQ's name) the slowest readers of that SCQ only; 400
                                    for a bad N, K or Q
GET    /api/v1/config?which=W       plugin options, ``origin`` (as given) or ``inuse`` (in effect: computed values
                                    such as ``max_packet_bytes`` and ``node_name`` resolved)
POST   /api/v1/acl/reload           reload the ACL file: ``{"reloaded": true, "rules": n}``; 400 and the
                                    parse error when the file is bad (the old rules stay)
POST   /api/v1/drain                drain the node before stopping it (ecq.broker.drain): listeners closed,
                                    clients closed, writes in flight settled, consumers' acks saved; answers
                                    the report once done (``{"drained": true, ...}``), 503 with it when writes
                                    were left unsettled
GET    /metrics                     Prometheus text exposition
GET    /                            the live dashboard (HTML; its script polls ``/api/v1/dashboard``)
GET    /api/v1/dashboard            what the dashboard shows (see ecq.ops.dashboard.dashboard_data)
====== ============================ ==================================================================
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from typing import Any, Protocol

from aiohttp import hdrs, web

from ecq.config import is_loopback
from ecq.ops.dashboard import PUBLIC_PATHS, add_dashboard
from ecq.ops.metrics import EcqMetrics
from ecq.ops.status import broker_status, queue_info, scq_info, with_live_consumers
from ecq.queue.engine import QueueEngine
from ecq.queue.lag import check_top
from ecq.queue.rewind import UnknownQueue
from ecq.store.protocol import StoreError
from ecq.queue.tombstones import TombstonesOff
from ecq.queue.topics import (RESERVED_CLIENTIDS, BadWrite, check_scq_name, parse_rewind_point, parse_write,
                              position_id, scq_queue_id)
from ecq.queue.writer import PoolClosed

log = logging.getLogger(__name__)


class BrokerControls(Protocol):
    """What the admin API asks of the broker beyond its queues (the ECQ plugin implements it)."""

    def options(self, which: str) -> dict[str, Any]:
        """Plugin options: ``origin`` as given, ``inuse`` as parsed; secrets redacted."""

    def reload_acl(self) -> int:
        """Read the ACL file again; returns its rule count. Raises ValueError (the parse error) for a bad file."""

    def event_stats(self) -> dict[str, Any]:
        """The queue event recorder's counters (empty when events are off)."""

    async def drain(self) -> dict[str, Any]:
        """Drain the node (see ecq.broker.drain); returns its report, ``drained`` True when nothing is pending."""

    draining: bool
    """True while the node drains (``ecq drain``): not ready, whatever its store says."""

    def health(self) -> dict[str, Any]:
        """``{"status": "ok"}`` or ``{"status": "degraded", "reason": ..., "problems": [...]}``."""

    def ready(self) -> tuple[bool, str | None]:
        """(would a write be stored now and the node is not draining, why not)."""

    def cluster_status(self) -> dict[str, Any] | None:
        """The stream health report (leaders per server, replicas per stream); None without a cluster."""

    async def rebalance(self) -> dict[str, Any] | None:
        """Spread the stream leaders; None without a cluster."""


_ENGINE = web.AppKey("engine", QueueEngine)
_CONTROLS = web.AppKey("controls", object)
_METRICS = web.AppKey("metrics", EcqMetrics)
_READ_ONLY_METHODS = frozenset({"GET", "HEAD"})
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def build_app(engine: QueueEngine, controls: BrokerControls, metrics: EcqMetrics, host: str, port: int,
              token: str | None) -> web.Application:
    """The aiohttp application serving the routes above for ``engine`` and ``controls``, bound to ``host:port``."""
    middlewares = [_same_site_writes(accepted_hosts(host, port))]
    if token:
        middlewares.append(_bearer_auth(token))
    app = web.Application(middlewares=middlewares)
    app[_ENGINE], app[_CONTROLS], app[_METRICS] = engine, controls, metrics
    app.add_routes([
        web.get("/api/v1/health", _health),
        web.get("/api/v1/ready", _ready),
        web.get("/api/v1/status", _status),
        web.post("/api/v1/cluster/rebalance", _rebalance),
        web.get("/api/v1/queues/{clientid}", _queue),
        web.post("/api/v1/gc", _gc),
        web.post("/api/v1/queues/{clientid}/rewind", _rewind),
        web.post("/api/v1/scq/{queue}/readers/{reader}/rewind", _rewind_reader),
        web.get("/api/v1/scq/{queue}", _scq),
        web.post("/api/v1/scq/{queue}/delete", _scq_delete),
        web.post("/api/v1/queues/{clientid}/delete", _delete),
        web.post("/api/v1/queues/{clientid}/purge", _purge),
        web.get("/api/v1/top", _top),
        web.get("/api/v1/config", _config),
        web.post("/api/v1/acl/reload", _acl_reload),
        web.post("/api/v1/drain", _drain),
        web.get("/metrics", _metrics),
    ])
    add_dashboard(app, engine, controls, metrics, bool(token))
    return app


async def serve(engine: QueueEngine, controls: BrokerControls, metrics: EcqMetrics, host: str, port: int,
                token: str | None) -> web.AppRunner:
    """Start the API on ``host:port``; returns the runner to ``cleanup()`` on shutdown. Raises OSError."""
    # a running request (a long GC) must not hold the broker's shutdown: cancel it after 2 s
    runner = web.AppRunner(build_app(engine, controls, metrics, host, port, token), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def accepted_hosts(host: str, port: int) -> frozenset[str]:
    """The ``Host`` header values, lower case, that name an API bound to ``host`` (no brackets) and ``port``."""
    names = {f"[{host}]" if ":" in host else host}
    if is_loopback(host) or _is_wildcard(host):
        names.update(_LOOPBACK_HOSTS)
    hosts = {f"{name}:{port}".lower() for name in names}
    if port == 80:
        hosts.update(name.lower() for name in names)
    return frozenset(hosts)


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _same_site_writes(hosts: frozenset[str]):
    origins = frozenset(f"http://{host}" for host in hosts)

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.method not in _READ_ONLY_METHODS:
            problem = _cross_site_problem(request.headers, hosts, origins)
            if problem is not None:
                reason = f"refused {request.method} {request.path}: {problem}"
                log.warning("ECQ admin API %s (from %s)", reason, request.remote)
                return web.json_response({"error": reason}, status=403)
        return await handler(request)
    return middleware


def _cross_site_problem(headers, hosts: frozenset[str], origins: frozenset[str]) -> str | None:
    host, origin = headers.get(hdrs.HOST), headers.get(hdrs.ORIGIN)
    if host is None or host.lower() not in hosts:
        return (f"Host header {host!r} is not this admin API's address {sorted(hosts)} "
                f"(protection against DNS rebinding)")
    if origin is not None and origin.lower() not in origins:
        return f"Origin {origin!r} is not this admin API (protection against cross-site requests)"
    return None


def _bearer_auth(token: str):
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def middleware(request: web.Request, handler):
        given = request.headers.get("Authorization", "").encode()
        public = request.method in _READ_ONLY_METHODS and request.path in PUBLIC_PATHS
        if not public and not hmac.compare_digest(given, expected):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)
    return middleware


async def _health(request: web.Request) -> web.Response:
    health = request.app[_CONTROLS].health()
    return web.json_response(health, status=200 if health["status"] == "ok" else 503)


async def _ready(request: web.Request) -> web.Response:
    ready, reason = request.app[_CONTROLS].ready()
    if ready:
        return web.json_response({"ready": True})
    return web.json_response({"ready": False, "reason": reason}, status=503)


async def _rebalance(request: web.Request) -> web.Response:
    try:
        moved = await request.app[_CONTROLS].rebalance()
    except Exception as exc:  # NATS did not answer: nothing is lost, the leaders stay where they are
        return web.json_response({"error": f"rebalance failed: {exc or type(exc).__name__}"}, status=503)
    if moved is None:
        return web.json_response({"error": "no cluster: backend is not jetstream"}, status=409)
    return web.json_response(moved)


async def _status(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE]
    status = with_live_consumers(await engine.read(broker_status, engine.store, engine.readers_snapshot()),
                                 engine.consumer_snapshot)
    status["events"] = request.app[_CONTROLS].event_stats()
    if (cluster := request.app[_CONTROLS].cluster_status()) is not None:
        status["cluster"] = cluster
    return web.json_response(status)


async def _queue(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE]
    clientid = request.match_info["clientid"]
    info = await engine.read(queue_info, engine.store, clientid, engine.consumer_snapshot(clientid))
    if info is None:
        return web.json_response({"error": f"no queue for clientid {clientid!r}"}, status=404)
    return web.json_response(info)


async def _scq(request: web.Request) -> web.Response:
    engine, queue = request.app[_ENGINE], request.match_info["queue"]
    try:
        check_scq_name(queue)
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    info = await engine.read(scq_info, engine.store, queue, engine.reader_snapshots(scq_queue_id(queue)))
    if info is None:
        return web.json_response({"error": f"no SCQ {queue!r}"}, status=404)
    return web.json_response(info)


async def _gc(request: web.Request) -> web.Response:
    return web.json_response({"deleted": await request.app[_ENGINE].run_gc()})


async def _rewind(request: web.Request) -> web.Response:
    clientid = request.match_info["clientid"]
    if clientid in RESERVED_CLIENTIDS:
        return web.json_response({"error": f"{clientid!r} cannot own a queue"}, status=400)
    return await _rewound(request, clientid, {"clientid": clientid})


async def _rewind_reader(request: web.Request) -> web.Response:
    queue, reader = request.match_info["queue"], request.match_info["reader"]
    try:
        check_scq_name(queue)
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    return await _rewound(request, position_id(scq_queue_id(queue), reader), {"scq": queue, "reader": reader})


async def _rewound(request: web.Request, clientid: str, named: dict[str, str]) -> web.Response:
    """Rewind the queue (or SCQ reader's position) ``clientid`` to the request's ``to``; ``named`` heads the answer."""
    try:
        point = parse_rewind_point(request.query.get("to", ""))
    except BadWrite as exc:
        return web.json_response({"error": str(exc)}, status=400)
    try:
        acked = await request.app[_ENGINE].rewind(clientid, point, must_exist=True)
    except UnknownQueue as exc:
        return web.json_response({"error": str(exc)}, status=404)
    except BadWrite as exc:
        log.warning("ECQ admin API %s", exc)
        return web.json_response({"error": str(exc)}, status=400)
    except (TimeoutError, StoreError, PoolClosed) as exc:
        return web.json_response({"error": f"rewind of {clientid!r} not stored: {exc or type(exc).__name__}"},
                                 status=503)
    return web.json_response({**named, "acked": acked})


async def _delete(request: web.Request) -> web.Response:
    clientid = request.match_info["clientid"]
    return await _tombstone(request, f"$ECQ/w/{clientid}/", clientid, {"clientid": clientid})


async def _scq_delete(request: web.Request) -> web.Response:
    queue = request.match_info["queue"]
    return await _tombstone(request, f"$SCQ/w/{queue}/", queue, {"scq": queue})


async def _tombstone(request: web.Request, prefix: str, clientid: str, named: dict[str, str]) -> web.Response:
    """Write a tombstone for the request's ``key`` as a write to ``prefix<key>`` would (``clientid``: the queue's
    name in that topic); ``named`` heads the answer."""
    key = request.query.get("key", "")
    try:
        write = parse_write(f"{prefix}{key}", 0, 0)
        if write.key != key:
            raise BadWrite("bad_clientid", "a clientid with '/' cannot be written to")
        appended = await request.app[_ENGINE].delete(write.clientid, write.key,
                                                     stored_only=request.query.get("stored_only") == "1")
    except BadWrite as exc:
        return web.json_response({"error": f"cannot delete {key!r} of {clientid!r}: {exc}"}, status=400)
    except TombstonesOff as exc:
        return web.json_response({"error": str(exc)}, status=409)
    except (TimeoutError, StoreError, PoolClosed) as exc:
        return web.json_response({"error": f"tombstone for {key!r} of {clientid!r} not stored: "
                                           f"{exc or type(exc).__name__}"}, status=503)
    if appended is None:
        return web.json_response({"error": f"the queue of {clientid!r} stores no value of key {key!r} (never "
                                           f"written, or deleted or expired since): nothing deleted"}, status=404)
    return web.json_response({**named, "key": key, "seqno": appended.seqno})


async def _purge(request: web.Request) -> web.Response:
    clientid = request.match_info["clientid"]
    try:
        purged = await request.app[_ENGINE].purge(clientid)
    except (TimeoutError, StoreError, PoolClosed) as exc:
        return web.json_response({"error": f"purge of {clientid!r} not done: {exc or type(exc).__name__}"},
                                 status=503)
    return web.json_response({"clientid": clientid, "purged": purged})


async def _top(request: web.Request) -> web.Response:
    by = request.query.get("by", "pending")
    try:
        n = int(request.query.get("n", "20"))
        check_top(n, by)
        scq = request.query.get("scq")
        if scq is not None:
            check_scq_name(scq)
    except ValueError as exc:
        return web.json_response({"error": f"bad top request: {exc}"}, status=400)
    return web.json_response(await request.app[_ENGINE].lag.report(n, by, scq))


async def _config(request: web.Request) -> web.Response:
    which = request.query.get("which", "inuse")
    if which not in ("origin", "inuse"):
        return web.json_response({"error": "which must be 'origin' or 'inuse'"}, status=400)
    return web.json_response(request.app[_CONTROLS].options(which))


async def _acl_reload(request: web.Request) -> web.Response:
    try:
        rules = request.app[_CONTROLS].reload_acl()
    except ValueError as exc:  # the ACL parse error
        return web.json_response({"reloaded": False, "error": str(exc)}, status=400)
    return web.json_response({"reloaded": True, "rules": rules})


async def _drain(request: web.Request) -> web.Response:
    report = await request.app[_CONTROLS].drain()
    return web.json_response(report, status=200 if report["drained"] else 503)


async def _metrics(request: web.Request) -> web.Response:
    await request.app[_ENGINE].lag.refresh()  # the oldest pending entries of dirty queues, for the age gauge
    body = request.app[_METRICS].exposition()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
