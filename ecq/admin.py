"""Admin HTTP API of a running broker (issue 4), served with aiohttp on ``admin_bind`` (default 127.0.0.1:18083).

All responses are JSON except ``/metrics`` (Prometheus text). With ``admin_token`` set, every request
needs ``Authorization: Bearer <token>``; otherwise 401.

====== ============================ ==================================================================
method path                         answer
====== ============================ ==================================================================
GET    /api/v1/health               ``{"status": "ok"}``; 503 ``{"status": "degraded", "reason": ...}`` while
                                    store writes fail (disk full)
GET    /api/v1/status               queues, messages, bytes, consumers online, first/last index entries
GET    /api/v1/queues/{clientid}    one queue (see ecq.status.queue_info); 404 when unknown
POST   /api/v1/gc                   run GC now: ``{"deleted": rows}``
GET    /api/v1/config?which=W       plugin options, ``origin`` (as given) or ``inuse`` (as parsed)
POST   /api/v1/acl/reload           reload the ACL file: ``{"reloaded": true, "rules": n}``; 400 and the
                                    parse error when the file is bad (the old rules stay)
GET    /metrics                     Prometheus text exposition
====== ============================ ==================================================================
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from aiohttp import web

from ecq.acl import AclError
from ecq.status import broker_status, queue_info

if TYPE_CHECKING:
    from ecq.plugin import EcqPlugin

_PLUGIN = web.AppKey("plugin", object)


def build_app(plugin: EcqPlugin, token: str | None) -> web.Application:
    """The aiohttp application serving the routes above for ``plugin``."""
    app = web.Application(middlewares=[_bearer_auth(token)] if token else [])
    app[_PLUGIN] = plugin
    app.add_routes([
        web.get("/api/v1/health", _health),
        web.get("/api/v1/status", _status),
        web.get("/api/v1/queues/{clientid}", _queue),
        web.post("/api/v1/gc", _gc),
        web.get("/api/v1/config", _config),
        web.post("/api/v1/acl/reload", _acl_reload),
        web.get("/metrics", _metrics),
    ])
    return app


async def serve(plugin: EcqPlugin, host: str, port: int, token: str | None) -> web.AppRunner:
    """Start the API on ``host:port``; returns the runner to ``cleanup()`` on shutdown. Raises OSError."""
    # a running request (a long GC) must not hold the broker's shutdown: cancel it after 2 s
    runner = web.AppRunner(build_app(plugin, token), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def _bearer_auth(token: str):
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def middleware(request: web.Request, handler):
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)
    return middleware


async def _health(request: web.Request) -> web.Response:
    health = request.app[_PLUGIN].health()
    return web.json_response(health, status=200 if health["status"] == "ok" else 503)


async def _status(request: web.Request) -> web.Response:
    plugin = request.app[_PLUGIN]
    status = await plugin.read(broker_status, plugin.store, dict(plugin.consumers), plugin.stored_totals())
    status["events"] = plugin.event_stats()
    return web.json_response(status)


async def _queue(request: web.Request) -> web.Response:
    plugin = request.app[_PLUGIN]
    clientid = request.match_info["clientid"]
    info = await plugin.read(queue_info, plugin.store, clientid, plugin.consumers.get(clientid))
    if info is None:
        return web.json_response({"error": f"no queue for clientid {clientid!r}"}, status=404)
    return web.json_response(info)


async def _gc(request: web.Request) -> web.Response:
    return web.json_response({"deleted": await request.app[_PLUGIN].run_gc()})


async def _config(request: web.Request) -> web.Response:
    which = request.query.get("which", "inuse")
    if which not in ("origin", "inuse"):
        return web.json_response({"error": "which must be 'origin' or 'inuse'"}, status=400)
    return web.json_response(request.app[_PLUGIN].options(which))


async def _acl_reload(request: web.Request) -> web.Response:
    try:
        rules = request.app[_PLUGIN].reload_acl()
    except AclError as exc:
        return web.json_response({"reloaded": False, "error": str(exc)}, status=400)
    return web.json_response({"reloaded": True, "rules": rules})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[_PLUGIN].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
