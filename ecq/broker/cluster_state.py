"""Ordinary MQTT state that follows a client across the brokers of a cluster (``backend: jetstream``), kept in two
JetStream KV buckets of ``jetstream_replicas`` copies (``NS`` being ``jetstream_namespace``, ``T(x)`` the subject
token of :func:`ecq.store.jsapi.token`):

- ``NS_retained``: key T(topic), value one byte of QoS (3: none given) then the payload; one entry per topic, an
  empty retained payload deletes it (MQTT 3.1.1 section 3.3.1.3). Every broker watches the bucket and keeps amqtt's
  retained table in step with it; a broker that starts loads every entry before its listeners open.
- ``NS_sessions``: key T(clientid), value the JSON list of a persistent session's subscriptions
  ``[[filter, qos], ...]``, written on each SUBSCRIBE, UNSUBSCRIBE and disconnect; entries expire
  ``session_expiry`` after their last write (MQTT 3.1.1 section 3.1.2.4 leaves session lifetime to the server).
  Read by a broker where the clientid reconnects when the broker that held it does not answer (it died).

The messages queued for an offline session are not stored here: they go from broker to broker in the takeover's
answer (:class:`SessionState`, :mod:`ecq.broker.bus`). Writes here are ordered and asynchronous: a retained
PUBLISH is PUBACKed before its KV write is acknowledged, and a failed write is logged, not retried.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.js.errors import KeyNotFoundError

from ecq.config import EcqSettings
from ecq.store.jsapi import REQUEST_TIMEOUT_S, token, untoken
from ecq.store.link import NatsLink

log = logging.getLogger(__name__)

NO_QOS = 3                 # the QoS byte of a retained message stored without a QoS (amqtt's ``qos=None``)
LOAD_TIMEOUT_S = 10.0      # how long a starting broker waits for the retained messages and buckets
CLOSE_TIMEOUT_S = 5.0      # how long a stopping broker waits for its last writes


@dataclass
class SessionState:
    """A persistent session as one broker hands it to another: ``subscriptions`` ``[(filter, granted QoS)]`` and
    ``messages`` ``[(topic, QoS, payload)]`` queued for it, oldest first; ``present`` False when there is none."""

    present: bool
    subscriptions: list[tuple[str, int]] = field(default_factory=list)
    messages: list[tuple[str, int, bytes]] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        """JSON, payloads in base64."""
        return json.dumps({"present": self.present, "subscriptions": self.subscriptions,
                           "messages": [[t, q, base64.b64encode(d).decode()] for t, q, d in self.messages]}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> SessionState:
        """Inverse of :meth:`to_bytes`. Raises ValueError (or KeyError, TypeError) for anything else."""
        raw = json.loads(data)
        return cls(bool(raw["present"]), [(str(f), int(q)) for f, q in raw["subscriptions"]],
                   [(str(t), int(q), base64.b64decode(d)) for t, q, d in raw["messages"]])


class ClusterState:
    """Retained messages and persistent sessions' subscriptions in the cluster's KV buckets, over ``link`` (the bus's).

    ``apply_retained(topic, payload or None, qos or None)`` is called on the broker loop ``loop`` for every change
    of the retained bucket, this broker's own included (None: deleted). Raises from :meth:`start` what NATS raised
    when the buckets cannot be opened, or TimeoutError.
    """

    def __init__(self, settings: EcqSettings, link: NatsLink, loop: asyncio.AbstractEventLoop,
                 apply_retained: Callable[[str, bytes | None, int | None], None]) -> None:
        self._settings, self._link, self._loop = settings, link, loop
        self._apply_retained = apply_retained
        self._retained: Any = None
        self._sessions: Any = None
        self._writes: asyncio.Queue | None = None  # (coroutine function, args) run in order on the link's loop
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Open the buckets and apply every retained message stored (blocking: call it off the broker loop)."""
        self._link.call(self._open(), LOAD_TIMEOUT_S)

    async def _open(self) -> None:
        js = self._link.nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        namespace, replicas = self._settings.jetstream_namespace, self._settings.jetstream_replicas
        self._retained = await _bucket(js, f"{namespace}_retained", replicas, None)
        self._sessions = await _bucket(js, f"{namespace}_sessions", replicas, self._settings.session_expiry)
        watcher = await self._retained.watch(">")
        loaded = asyncio.get_running_loop().create_future()
        self._writes = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._follow(watcher, loaded)), asyncio.ensure_future(self._write())]
        await loaded

    async def _follow(self, watcher: Any, loaded: asyncio.Future) -> None:
        async for entry in watcher:
            if entry is None:  # nats-py's marker: the entries stored before the watch are all delivered
                loaded.set_result(None)
                continue
            try:
                topic = untoken(entry.key)
            except ValueError as exc:
                log.warning("ECQ ignored a retained entry it did not write (key %r): %s", entry.key, exc)
                continue
            if entry.operation is not None or not entry.value:  # DEL or PURGE
                self._loop.call_soon_threadsafe(self._apply_retained, topic, None, None)
            else:
                qos = None if entry.value[0] == NO_QOS else entry.value[0]
                self._loop.call_soon_threadsafe(self._apply_retained, topic, bytes(entry.value[1:]), qos)

    async def _write(self) -> None:
        while True:
            what, args = await self._writes.get()
            try:
                await what(*args)
            except Exception as exc:  # NATS away or the bucket gone: the state stays on this broker
                log.warning("ECQ could not store %s in the cluster: %s", args[0], exc or type(exc).__name__)
            finally:
                self._writes.task_done()

    def _enqueue(self, what: Callable, *args: Any) -> None:
        self._link.loop.call_soon_threadsafe(self._writes.put_nowait, (what, args))

    # --- retained messages ------------------------------------------------------------------------------

    def retain(self, topic: str, payload: bytes, qos: int | None) -> None:
        """Store the retained message of ``topic`` for the whole cluster; an empty ``payload`` deletes it (returns at
        once; written in call order)."""
        if payload:
            value = bytes([NO_QOS if qos is None else qos]) + payload
            self._enqueue(self._put_retained, f"retained message of {topic!r}", token(topic), value)
        else:
            self._enqueue(self._delete_retained, f"cleared retained message of {topic!r}", token(topic))

    async def _put_retained(self, _what: str, key: str, value: bytes) -> None:
        await self._retained.put(key, value)

    async def _delete_retained(self, _what: str, key: str) -> None:
        await self._retained.delete(key)

    # --- persistent sessions' subscriptions ---------------------------------------------------------------

    def save_subscriptions(self, clientid: str, subscriptions: list[tuple[str, int]]) -> None:
        """Store the subscriptions of ``clientid``'s persistent session (returns at once; written in call order)."""
        self._enqueue(self._put_session, f"session of {clientid!r}", token(clientid),
                      json.dumps(subscriptions).encode())

    def forget_session(self, clientid: str) -> None:
        """Delete ``clientid``'s stored session (a clean-session CONNECT; returns at once, written in call order)."""
        self._enqueue(self._delete_session, f"end of the session of {clientid!r}", token(clientid))

    async def _put_session(self, _what: str, key: str, value: bytes) -> None:
        await self._sessions.put(key, value)

    async def _delete_session(self, _what: str, key: str) -> None:
        await self._sessions.delete(key)

    async def load_session(self, clientid: str) -> SessionState:
        """The stored subscriptions of ``clientid`` (run on the link's loop); not present when none are stored or
        the bucket cannot be read (logged)."""
        try:
            entry = await self._sessions.get(token(clientid))
            return SessionState(True, [(str(f), int(q)) for f, q in json.loads(entry.value)])
        except KeyNotFoundError:  # also KeyDeletedError
            return SessionState(False)
        except Exception as exc:
            log.warning("ECQ could not read the stored session of %r: %s", clientid, exc or type(exc).__name__)
            return SessionState(False)

    def close(self) -> None:
        """Finish the writes asked for (at most ``CLOSE_TIMEOUT_S``), then stop watching and writing (blocking; call
        before the link closes)."""
        if self._writes is not None:
            try:
                self._link.call(self._writes.join(), CLOSE_TIMEOUT_S)
            except Exception as exc:
                log.warning("ECQ: %d writes of retained messages or sessions not stored at close: %s",
                            self._writes.qsize(), exc)
        for task in self._tasks:
            self._link.loop.call_soon_threadsafe(task.cancel)


async def _bucket(js: Any, name: str, replicas: int, ttl: float | None) -> Any:
    """The KV bucket ``name``, created when missing (one value per key)."""
    try:
        return await js.key_value(name)
    except Exception:  # nats-py's BucketNotFoundError, or NotFoundError from the stream info
        return await js.create_key_value(bucket=name, history=1, replicas=replicas, ttl=ttl)
