"""JetStream's API as the ECQ store uses it: subject tokens for any text, retries until a deadline, direct
gets (any current replica, single or batched), the JSON API (``$JS.API.*``) and the decoding of stored
messages. Everything here runs on the NATS link's event loop (ecq/store/link.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from ecq.store.link import ConnectionDropped, NatsLink
from ecq.store.protocol import IndexEntry, Message, StoreError

TS_HEADER = "Ecq-Ts"         # the publish time in ms, as the broker that took the write stamped it
EXPIRES_HEADER = "Ecq-Expires"  # the entry's own expiry time in ms (MQTT 5 Message Expiry); absent: none
REQUEST_TIMEOUT_S = 2.0      # one NATS request; a commit retries within write_timeout
DIRECT_TIMEOUT_S = 0.5       # one direct get: any replica answers it in ms, but one sent to a server that was just
                             # killed never is answered, and a write waited out the full REQUEST_TIMEOUT_S for it
RETRY_PAUSE_S = 0.1          # between two tries of a request during a leader election or an outage


def token(text: str) -> str:
    """``text`` as one NATS subject token (any characters): ``x`` + unpadded URL-safe base64 of its UTF-8."""
    return "x" + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def untoken(tok: str) -> str:
    """Inverse of :func:`token`. Raises ValueError for a token it did not make."""
    if not tok.startswith("x"):
        raise ValueError(f"not an ECQ subject token: {tok!r}")
    body = tok[1:]
    return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode()


class Retry(Exception):
    """A NATS request that may succeed when tried again (no responders, timeout, leader election)."""


async def until(deadline: float, attempt: Callable[[], Any]) -> Any:
    """``await attempt()`` until it does not raise a retryable error or ``deadline`` (time.monotonic()) comes;
    raises TimeoutError with the last reason then."""
    while True:
        try:
            return await attempt()
        except (Retry, NatsTimeout, NoRespondersError, asyncio.TimeoutError, ConnectionDropped) as exc:
            reason = str(exc) or type(exc).__name__
        if time.monotonic() + RETRY_PAUSE_S >= deadline:
            raise TimeoutError(reason)
        await asyncio.sleep(RETRY_PAUSE_S)


async def collect(sub: Any) -> list[Any]:
    """The messages of a batched direct get, up to its end-of-batch (or not-found) status message."""
    replies = []
    while True:
        msg = await sub.next_msg(timeout=REQUEST_TIMEOUT_S)
        if status_of(msg):
            return stored_messages(replies + [msg])
        replies.append(msg)


def status_of(msg: Any) -> str | None:
    """The ``Status`` header of a JetStream answer (``204``, ``404``, ``503``...), None on a stored message."""
    return msg.headers.get("Status") if msg.headers else None


def stored_messages(messages: list[Any]) -> list[Any]:
    """The stored messages of a direct get answer; raises Retry (503 no current replica, 408 timeout) or
    StoreError for a failure status. 404 (none matched) and 204 (end of batch) just end the answer."""
    last = messages[-1] if messages else None
    status = status_of(last) if last is not None else None
    if status in ("503", "408"):
        raise Retry(f"JetStream direct get: {status} {last.headers.get('Description', '')}")
    if status and status not in ("404", "204"):
        raise StoreError(f"JetStream direct get failed: {status} {last.headers.get('Description', '')}")
    return messages[:-1] if status else messages


def queue_subject_parts(subject: str) -> tuple[str, str]:
    """(clientid, key) of a queue entry's subject ``NS.q.<shard>.T(clientid).T(key)``. Raises ValueError for
    another subject."""
    _ns, _q, _shard, clientid, key = subject.split(".", 4)
    return untoken(clientid), untoken(key)


def message_of(reply: Any) -> Message:
    """The queue entry in a direct get answer (subject ``NS.q.<shard>.T(clientid).T(key)``)."""
    headers = reply.headers
    _clientid, key = queue_subject_parts(headers["Nats-Subject"])
    ts_ms = int(headers[TS_HEADER]) if TS_HEADER in headers else stream_ms(headers["Nats-Time-Stamp"])
    return Message(int(headers["Nats-Sequence"]), key, reply.data, ts_ms, int(headers.get(EXPIRES_HEADER, 0)))


def stored_message_of(answer: dict) -> Message:
    """The queue entry in the ``message`` of a ``STREAM.MSG.GET`` answer (JSON: ``subject``, ``seq``, base64
    ``hdrs`` in NATS header format and ``data``, RFC 3339 ``time``)."""
    _clientid, key = queue_subject_parts(answer["subject"])
    headers = dict(line.split(": ", 1) for line in base64.b64decode(answer.get("hdrs") or b"").decode().split("\r\n")
                   if ": " in line)
    ts_ms = int(headers[TS_HEADER]) if TS_HEADER in headers else stream_ms(answer["time"])
    return Message(answer["seq"], key, base64.b64decode(answer.get("data") or b""), ts_ms,
                   int(headers.get(EXPIRES_HEADER, 0)))


def index_entry_of(reply: Any) -> IndexEntry:
    """Where a direct get answer sits: clientid, seqno, key, publish ms."""
    message = message_of(reply)
    clientid, _key = queue_subject_parts(reply.headers["Nats-Subject"])
    return IndexEntry(clientid, message.seqno, message.key, message.ts_ms)


def stream_ms(rfc3339: str) -> int:
    """JetStream's ``Nats-Time-Stamp`` (RFC 3339, nanoseconds) as ms since the epoch."""
    return int(datetime.fromisoformat(rfc3339[:26].rstrip("Z") + "+00:00").timestamp() * 1000)


class JetStreamApi:
    """The requests the store makes, over ``link``'s connection (call on the link's loop)."""

    def __init__(self, link: NatsLink) -> None:
        self._link = link

    async def direct(self, stream: str, request: dict) -> list[Any]:
        """JetStream direct get (one current replica answers): the messages answered, [] when none matched;
        with ``batch`` in ``request``, up to that many in one request (NATS 2.11+, ended by a 204 status)."""
        if "batch" in request:
            return await self._direct_batch(stream, request)
        return await self._direct_one(stream, request)

    async def _direct_one(self, stream: str, request: dict) -> list[Any]:
        reply = await self._link.request(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(),
                                         timeout=DIRECT_TIMEOUT_S)
        return stored_messages([reply])

    async def _direct_batch(self, stream: str, request: dict) -> list[Any]:
        nc = self._link.nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            await nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox)
            return await collect(sub)
        finally:
            await sub.unsubscribe()

    async def api(self, path: str, request: dict) -> dict:
        reply = await self._link.request(f"$JS.API.{path}", json.dumps(request).encode(), timeout=REQUEST_TIMEOUT_S)
        answer = json.loads(reply.data)
        if answer.get("error", {}).get("code") == 503:  # no stream leader yet
            raise Retry(f"JetStream {path}: {answer['error'].get('description')}")
        return answer

    async def subjects(self, stream: str, subject_filter: str) -> dict[str, int]:
        """Every stored subject of ``stream`` matching ``subject_filter`` with its message count, read page by
        page (JetStream answers at most 100,000 subjects per stream info request)."""
        subjects: dict[str, int] = {}
        while True:
            answer = await self.api(f"STREAM.INFO.{stream}", {"subjects_filter": subject_filter,
                                                                "offset": len(subjects)})
            if "error" in answer:
                raise StoreError(f"JetStream stream info of {stream}: {answer['error'].get('description')}")
            page = answer.get("state", {}).get("subjects") or {}
            subjects.update(page)
            if not page or len(subjects) >= answer.get("total", 0):
                return subjects
