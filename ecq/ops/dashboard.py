"""The live dashboard of the admin API: a page at ``/`` and the JSON it polls, ``GET /api/v1/dashboard``.

The page (``ecq/ops/static/``: one HTML shell, one small script and one stylesheet of our own, no framework,
nothing from a CDN) holds no data, so it and its two files are served without a token (:data:`PUBLIC_PATHS`);
the JSON is behind the API's token rules like every other answer. The page polls the JSON every 2 s.

The JSON reuses what the API already computes: the lag index's top answer (``/api/v1/top``), the engine's
totals (the Prometheus gauges, the same figures ``/api/v1/status`` gives on LevelDB), the event recorder's stats
and the cluster's stream report; rates come from :class:`ecq.ops.history.History`, a ring buffer of counter
samples of the last 10 minutes kept by the admin app while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from importlib import resources
from typing import Any

from aiohttp import web

from ecq.ops.history import History, read_counters
from ecq.ops.metrics import EcqMetrics
from ecq.queue.clock import now_ms
from ecq.queue.engine import QueueEngine

TOP_N = 10                                  # queues listed in each of the two lag tables, SCQs in the SCQ panel
SLOWEST_READERS = 3                         # an SCQ's slowest readers named in the SCQ panel
STATIC = {                                  # path -> (file in ecq/ops/static, content type)
    "/": ("dashboard.html", "text/html"),
    "/dashboard.js": ("dashboard.js", "text/javascript"),
    "/dashboard.css": ("dashboard.css", "text/css"),
}
PUBLIC_PATHS = frozenset(STATIC)            # served without a token: they hold no data
# the page loads only its own files and fetches only this API; no frame may show it (clickjacking)
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; form-action 'none'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

_HISTORY = web.AppKey("dashboard_history", History)
_CONTROLS = web.AppKey("dashboard_controls", object)


def add_dashboard(app: web.Application, engine: QueueEngine, controls: Any, metrics: EcqMetrics,
                  token_required: bool) -> None:
    """Serve the page and its JSON from ``app``, and sample the counters while ``app`` runs.

    ``controls`` is the API's BrokerControls (event_stats, cluster_status, health, ready); ``token_required``
    (``admin_token`` is set) makes the page ask for the token before its first request."""
    settings = engine.settings
    store_dir = settings.queues_dir() if settings.backend == "leveldb" else None
    history = History(engine, metrics, controls.event_stats, store_dir)
    app[_HISTORY], app[_CONTROLS] = history, controls
    for path, (name, content_type) in STATIC.items():
        body = resources.files("ecq.ops").joinpath("static", name).read_bytes()
        if token_required:
            body = body.replace(b'data-auth="open"', b'data-auth="token"')
        app.router.add_get(path, _static_handler(body, content_type))
    app.router.add_get("/api/v1/dashboard", _dashboard)
    app.cleanup_ctx.append(_sampling)


async def _sampling(app: web.Application):
    task = asyncio.create_task(app[_HISTORY].run(), name="ecq-dashboard-history")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _static_handler(body: bytes, content_type: str):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type, charset="utf-8", headers=SECURITY_HEADERS)
    return handler


async def _dashboard(request: web.Request) -> web.Response:
    history, controls = request.app[_HISTORY], request.app[_CONTROLS]
    return web.json_response(await dashboard_data(history, controls), headers={"Cache-Control": "no-store"})


async def dashboard_data(history: History, controls: Any) -> dict[str, Any]:
    """Everything the page shows, read now. Keys:

    - ``at_ms`` (ms since the epoch), ``node`` (node name), ``backend`` (``leveldb`` or ``jetstream``);
    - ``health`` (``/api/v1/health``'s answer) and ``ready`` (``{"ready": bool, "reason": str | None}``);
    - ``store``: queues, messages (entries stored), bytes (their payload bytes), inflight, consumers_online (the
      engine's totals, as in ``/api/v1/status``), disk_bytes (LevelDB's files; None on a cluster);
    - ``lag``: ``/api/v1/top?n=10`` (pending, lagging, oldest_pending_age_s, queues) and ``oldest``: the 10 queues
      with the oldest pending entry (``by=age``);
    - ``rates``: per second over the last minute (``window_s``, shorter right after start) of writes, deliveries,
      redeliveries, acks, compactions, evictions, gc_deleted, events_recorded, events_exported and
      ``refused:<reason>``; ``totals``: the same counters since broker start;
    - ``history``: :meth:`History.series` (10 minutes of 2 s samples), ``interval_s``;
    - ``gc``: :meth:`History.gc`; ``events``: the event buffer and lake counters (``{}`` when events are off);
    - ``scq``: the 10 SCQs with the most pending entries over their readers followed here, each with its readers
      count, pending, lagging readers, oldest pending age and its 3 slowest readers (``/api/v1/top?scq=Q``'s rows;
      :meth:`ecq.queue.lag.LagIndex.scq_summary`);
    - ``cluster``: the stream report (connected, writable, problems, leaders per NATS server, streams), or None.
    """
    engine = history.engine
    events = controls.event_stats()
    counters, at_ms = read_counters(history.metrics, events), now_ms()  # first: the lag below is never older
    lag, oldest = await engine.lag.report(TOP_N, "pending"), await engine.lag.report(TOP_N, "age")
    scq = engine.lag.scq_summary(TOP_N, SLOWEST_READERS)  # of the index the reports above refreshed
    totals = engine.totals()
    ready, reason = controls.ready()
    return {
        "at_ms": at_ms, "node": engine.settings.effective_node_name(), "backend": engine.settings.backend,
        "health": controls.health(), "ready": {"ready": ready, "reason": reason},
        "store": {"queues": totals.queues, "messages": totals.stored_entries, "bytes": totals.stored_bytes,
                  "inflight": totals.inflight, "consumers_online": totals.online, "disk_bytes": history.disk},
        "lag": lag, "oldest": oldest["queues"],
        "rates": history.rates_now(counters, at_ms), "totals": counters,
        "history": history.series(), "interval_s": history.interval_s,
        "gc": history.gc(counters), "events": events, "cluster": controls.cluster_status(), "scq": scq,
    }
