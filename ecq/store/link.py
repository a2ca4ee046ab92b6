"""One connection to the NATS cluster, run on its own thread and event loop.

The queue store's methods block (the engine calls them from reader and writer threads), and the broker's
event loop must never wait on NATS: so the nats-py client lives on a loop of its own, and both sides hand it
coroutines (:meth:`NatsLink.call` from threads, :meth:`NatsLink.submit` from the broker loop). nats-py
reconnects by itself, forever, to any server of the list; while it is away, requests wait in its pending
buffer until their timeout, and the outage is logged when it starts, every ``OUTAGE_LOG_INTERVAL_S`` while it
lasts, and when it ends (not once per request).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NatsClient

from ecq.config import EcqSettings

log = logging.getLogger(__name__)
T = TypeVar("T")

CONNECT_TIMEOUT_S = 10.0       # at start-up: how long to try the servers before giving up
OUTAGE_LOG_INTERVAL_S = 30.0   # while NATS is unreachable, how often to say so again
RECONNECT_WAIT_S = 0.5         # between two reconnect attempts to one server
PING_INTERVAL_S = 2.0          # a server that stops answering (a partition, a hung host) is left after 2 unanswered
MAX_OUTSTANDING_PINGS = 2      # pings, ~4-6 s, and the client reconnects to another (nats-py's default: 2 min)


class NatsUnavailable(ConnectionError):
    """No NATS server of ``nats_servers`` could be reached (at start-up, or within a request's time)."""


class NatsRefused(NatsUnavailable):
    """A NATS server answered but refused ECQ: wrong credentials or a TLS handshake that failed. Retrying
    cannot help, so start-up stops at the first such answer."""


def tls_context(settings: EcqSettings) -> ssl.SSLContext | None:
    """The TLS context for NATS from ``nats_tls_ca`` (the CAs to verify servers against; the system's when
    unset) and ``nats_tls_cert``/``nats_tls_key`` (a client certificate); None when TLS is not wanted (see
    EcqSettings.nats_tls_wanted). Raises ssl.SSLError or OSError for a file that is not a PEM of its kind."""
    if not settings.nats_tls_wanted():
        return None
    context = ssl.create_default_context(cafile=str(settings.nats_tls_ca) if settings.nats_tls_ca else None)
    if settings.nats_tls_cert and settings.nats_tls_key:
        context.load_cert_chain(str(settings.nats_tls_cert), str(settings.nats_tls_key))
    return context


def _refusal(exc: BaseException) -> str | None:
    """Why a failed connect cannot succeed by retrying (credentials or TLS), or None."""
    if isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower():
        return ("the server refused ECQ's credentials (nats_user/nats_password or nats_token): "
                f"{exc or 'Authorization Violation'}")
    if isinstance(exc, ssl.SSLError | nats.errors.SecureConnRequiredError | nats.errors.SecureConnWantedError):
        return (f"TLS to the server failed ({exc or type(exc).__name__}); check nats_tls_ca (the CA that signed the "
                "server's certificate), nats_tls_cert/nats_tls_key, and tls:// in nats_servers")
    return None


class ConnectionDropped(ConnectionError):
    """The connection a request was sent on dropped before its answer came: the answer never will (send it again)."""


class NatsLink:
    """A nats-py connection to ``settings.nats_servers`` on a daemon thread named ``ecq-nats``.

    ``on_reconnect()`` runs on the link's loop after each reconnect (subscriptions are restored by nats-py;
    the caller may have missed core-NATS messages meanwhile). Raises :class:`NatsUnavailable` from
    :meth:`start` when no server answers within ``CONNECT_TIMEOUT_S``.
    """

    def __init__(self, settings: EcqSettings, on_reconnect: Callable[[], None] = lambda: None,
                 report_outages: bool = True) -> None:
        self._settings = settings
        self._report_outages = report_outages
        self._on_reconnect = on_reconnect
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="ecq-nats", daemon=True)
        self.nc: NatsClient | None = None
        self.outage_since: float | None = None  # time.monotonic() of the disconnect; None while connected
        self._outage_logged = 0.0
        self._closing = False
        self._refused: asyncio.Future[str] | None = None  # at start-up: why a server refused ECQ
        self._refusal_logged = 0.0
        self._dropped: asyncio.Event | None = None  # set when the current connection drops (link loop only)

    @property
    def connected(self) -> bool:
        """True while the client holds a connection to a NATS server."""
        return self.nc is not None and self.nc.is_connected

    def start(self) -> None:
        """Start the thread and connect. Raises NatsUnavailable naming the servers and the reason."""
        self._thread.start()
        servers = ", ".join(self._settings.nats_servers)
        try:
            self.nc = self.call(self._connect(), CONNECT_TIMEOUT_S + 1)
        except NatsRefused as exc:
            self.close()
            raise NatsRefused(f"cannot use NATS at {servers}: {exc}") from None
        except Exception as exc:
            self.close()
            raise NatsUnavailable(f"cannot reach NATS at {servers}: {exc or type(exc).__name__}") from None

    async def _connect(self) -> NatsClient:
        """Connect within CONNECT_TIMEOUT_S; raises NatsRefused at the first refusal (credentials or TLS: nats-py
        would retry those for ever, telling only its error callback), TimeoutError when no server answers."""
        settings = self._settings
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        self._refused = asyncio.get_running_loop().create_future()
        while True:
            connecting = asyncio.ensure_future(nats.connect(
                settings.nats_servers, name=f"ecq {settings.effective_node_name()}",
                user=settings.nats_user,
                password=settings.nats_password.get_secret_value() if settings.nats_password else None,
                token=settings.nats_token.get_secret_value() if settings.nats_token else None,
                tls=tls_context(settings), connect_timeout=2, allow_reconnect=True, max_reconnect_attempts=-1,
                reconnect_time_wait=RECONNECT_WAIT_S, ping_interval=PING_INTERVAL_S,
                max_outstanding_pings=MAX_OUTSTANDING_PINGS, disconnected_cb=self._disconnected,
                reconnected_cb=self._reconnected, error_cb=self._error))
            await asyncio.wait({connecting, self._refused}, timeout=max(0.0, deadline - time.monotonic()),
                                return_when=asyncio.FIRST_COMPLETED)
            if connecting.done() and not connecting.exception():
                return connecting.result()
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            if self._refused.done():
                raise NatsRefused(self._refused.result())
            if time.monotonic() > deadline:
                raise TimeoutError(f"no server answered within {CONNECT_TIMEOUT_S:g} s")
            await asyncio.sleep(RECONNECT_WAIT_S)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the link's loop and wait for it from another thread (never from the link's loop).

        Raises what ``coro`` raised, or TimeoutError after ``timeout`` seconds (the coroutine is cancelled).
        """
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"NATS request did not finish within {timeout:g} s") from None

    async def request(self, subject: str, payload: bytes, timeout: float,
                      headers: dict[str, str] | None = None) -> Any:
        """A NATS request (on the link's loop) given up as soon as the connection it went out on drops: a request
        sent to a server that was just killed gets no answer, and waiting out ``timeout`` for it delayed the
        retry of a write by up to REQUEST_TIMEOUT_S. Raises ConnectionDropped then, or what nc.request raises
        (nats.errors.TimeoutError after ``timeout`` seconds, NoRespondersError)."""
        dropped = self.drop_event()
        answer = asyncio.ensure_future(self.nc.request(subject, payload, timeout=timeout, headers=headers))
        drop = asyncio.ensure_future(dropped.wait())
        await asyncio.wait((answer, drop), return_when=asyncio.FIRST_COMPLETED)
        drop.cancel()
        if answer.done():
            return answer.result()
        answer.cancel()
        raise ConnectionDropped(f"the NATS connection dropped before the answer to {subject}")

    def drop_event(self) -> asyncio.Event:
        """The event set when the current connection drops (on the link's loop; a new one after each drop)."""
        if self._dropped is None:
            self._dropped = asyncio.Event()
        return self._dropped

    def submit(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future:
        """Run ``coro`` on the link's loop; returns a future of the calling (running) event loop."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        """Drain and close the connection, then stop the thread (bounded: at most a few seconds)."""
        self._closing = True
        if self.nc is not None and not self.nc.is_closed:
            try:
                self.call(self.nc.close(), 5.0)
            except Exception as exc:
                log.warning("closing the NATS connection: %s", exc)
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5.0)

    def note_outage(self) -> None:
        """Log that NATS is unreachable, at most once per ``OUTAGE_LOG_INTERVAL_S`` (callers may call it per
        failed request)."""
        now = time.monotonic()
        if self.outage_since is None:
            self.outage_since = now
        if self._report_outages and now - self._outage_logged >= OUTAGE_LOG_INTERVAL_S:
            self._outage_logged = now
            log.error("ECQ: NATS unreachable for %.0f s (servers %s): writes get no PUBACK and ack positions are "
                      "not saved until it is back", now - self.outage_since, ", ".join(self._settings.nats_servers))

    async def _disconnected(self) -> None:
        dropped, self._dropped = self.drop_event(), asyncio.Event()  # requests sent from now on wait for the next
        dropped.set()
        if not self._closing:
            self.note_outage()

    async def _reconnected(self) -> None:
        since = self.outage_since
        self.outage_since, self._outage_logged = None, 0.0
        url = self.nc.connected_url.netloc if self.nc and self.nc.connected_url else "?"
        if self._report_outages:
            log.warning("ECQ: NATS connection back (%s) after %.1f s", url, time.monotonic() - since if since else 0.0)
        self._on_reconnect()

    async def _error(self, exc: Exception) -> None:
        refusal = _refusal(exc)
        if refusal is None:
            log.debug("NATS client error: %s", exc)
        elif self._refused is not None and not self._refused.done():
            self._refused.set_result(refusal)  # start-up stops at once (see _connect)
        elif self._report_outages and time.monotonic() - self._refusal_logged >= OUTAGE_LOG_INTERVAL_S:
            self._refusal_logged = time.monotonic()  # refused on a reconnect: credentials or certificates changed
            log.error("ECQ: NATS refuses the connection: %s", refusal)
