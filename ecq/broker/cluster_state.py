"""Ordinary MQTT state that follows a client across the brokers of a cluster (``backend: jetstream``), kept in two
JetStream KV buckets of ``jetstream_replicas`` copies (``NS`` being ``jetstream_namespace``, ``T(x)`` the subject
token of :func:`ecq.store.jsapi.token`):

- ``NS_retained``: key T(topic), value one byte of QoS (3: none given) then the payload; for an MQTT 5.0 message
  with properties or an expiry, that byte has bit 0x80 set and is followed by the 4-byte length (big-endian) of its
  :func:`ecq.broker.amqtt_hooks.cluster_form`, the form (ASCII), then the payload. One entry per topic, an
  empty retained payload deletes it (MQTT 3.1.1 section 3.3.1.3). Every broker watches the bucket and keeps amqtt's
  retained table in step with it; a broker that starts loads every entry before its listeners open.
- ``NS_sessions``: key T(clientid), value the JSON object ``{"username": owner or null, "subscriptions": [[filter,
  qos], ...]}`` of a persistent session, an MQTT 5.0 subscription's entry followed by its options
  (:func:`subscriptions_value`), written on each SUBSCRIBE, UNSUBSCRIBE and disconnect (a broker of an earlier
  version wrote the list of subscriptions alone: read as a session of no known owner); entries expire
  ``session_expiry`` after their last write (MQTT 3.1.1 section 3.1.2.4 leaves session lifetime to the server).
  Read by a broker where the clientid reconnects when the broker that held it does not answer (it died).

And one stream, ``NS_SESSIONS`` (at most ``session_max_queued`` messages per subject, the oldest dropped, kept
``session_expiry``; headers ``Ecq-Topic`` T(topic), ``Ecq-Qos``, and ``Ecq-Mqtt5`` the cluster form of an MQTT 5.0
message), two subjects per persistent session:

- ``NS.sq.T(clientid)``: the QoS 1/2 messages queued for it while offline, purged when its queue is taken for
  sending or the session is discarded.
- ``NS.ss.T(clientid)``: the QoS 1/2 messages of ordinary topics sent to it while connected and not yet
  acknowledged (``amqtt_hooks.stored_sends``), its stream sequence the key: stored before the publisher's PUBACK
  (:meth:`ClusterState.store_sends`, the messages of one fan-out published together and their acks awaited
  together), deleted by sequence at the client's PUBACK (a QoS 2 one's PUBCOMP; :meth:`ClusterState.settle_sends`,
  those of one event-loop turn in one ordered write), and written there too when a session's queue is taken for
  sending (:meth:`ClusterState.take_queue`, which then purges the queue and the session's older sends).

The broker that holds a session hands its messages over in the takeover's answer (:class:`SessionState`,
:mod:`ecq.broker.bus`); the stream is read (its sends first, then its queue) only when that broker does not answer
(it died, a ``kill -9`` included, or it restarted): that reconnect gets what its client had not acknowledged.

Writes here are ordered and asynchronous, and a failed write is logged, not retried: a retained PUBLISH is PUBACKed
before its KV write is acknowledged. The sends are the exception: the fan-out waits for their store (at most
``REQUEST_TIMEOUT_S``), and sends them unstored, logged, when it failed or NATS is unreachable (then at once).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from ecq.broker.amqtt_hooks import PersistentSession, cluster_form, from_cluster_form
from ecq.broker.session_state import (SessionState, TurnBatch, retained_message, retained_value,  # noqa: F401
                                      subscriptions_value)  # SessionState, subscriptions_value: for bus, tests
from ecq.config import EcqSettings
from ecq.store.jetstream_publish import BatchPublisher, Publish
from ecq.store.jsapi import REQUEST_TIMEOUT_S, JetStreamApi, Retry, token, until, untoken
from ecq.store.link import NatsLink
from ecq.store.protocol import StoreError

log = logging.getLogger(__name__)

MQTT5_HEADER = "Ecq-Mqtt5"  # the NATS header of an MQTT 5.0 message's cluster form (here and on the bus)
LOAD_TIMEOUT_S = 10.0      # how long a starting broker waits for the retained messages and buckets
CLOSE_TIMEOUT_S = 5.0      # how long a stopping broker waits for its last writes
SETTLE_TIMEOUT_S = 1.0     # how long a takeover's answer waits for this broker's pending writes
LEADER_READ_TIMEOUT_S = 2.0  # a read of a stored session retried through a leader election
KV_OPERATION = b"KV-Operation"  # the header of a KV delete or purge marker
TAKE_TIMEOUT_S = 5.0       # how long a resumed session's queue waits for its store before it is sent unstored
NO_MESSAGE = 10057         # JetStream's err_code of a delete that found no message at the sequence (deleted already)


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
        self._js: Any = None
        self._api = JetStreamApi(link)
        self._queues = f"{settings.jetstream_namespace}_SESSIONS"  # the stream of offline sessions' queues
        self._writes: asyncio.Queue | None = None  # (coroutine function, args) run in order on the link's loop
        self._settling = TurnBatch(self._delete_settled)  # sequences of settled sends, deleted at the next turn
        self._publisher = BatchPublisher(link, observe=lambda _seconds: None)  # the sends to connected sessions
        self._ids, self._sent = uuid.uuid4().hex, itertools.count()  # their Nats-Msg-Id: a retry is stored once
        self._delete_replies: str | None = None  # the subject of the answers to deletes of settled sends
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Open the buckets and apply every retained message stored (blocking: call it off the broker loop)."""
        self._link.call(self._open(), LOAD_TIMEOUT_S)

    async def _open(self) -> None:
        js = self._link.nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        namespace, replicas = self._settings.jetstream_namespace, self._settings.jetstream_replicas
        self._retained = await _bucket(js, f"{namespace}_retained", replicas, None)
        self._sessions = await _bucket(js, f"{namespace}_sessions", replicas, self._settings.session_expiry)
        await _stream(js, StreamConfig(
            name=self._queues, subjects=[f"{namespace}.sq.>", f"{namespace}.ss.>"],
            max_msgs_per_subject=self._settings.session_max_queued, max_age=self._settings.session_expiry,
            num_replicas=replicas, allow_direct=True, storage=StorageType.FILE, discard=DiscardPolicy.OLD))
        self._js = js
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
                continue
            try:
                data, qos = retained_message(entry.value)
            except ValueError as exc:
                log.warning("ECQ ignored the retained entry of %r: %s", topic, exc)
                continue
            self._loop.call_soon_threadsafe(self._apply_retained, topic, data, qos)

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
            value = retained_value(payload, qos)
            self._enqueue(self._put_retained, f"retained message of {topic!r}", token(topic), value)
        else:
            self._enqueue(self._delete_retained, f"cleared retained message of {topic!r}", token(topic))

    async def _put_retained(self, _what: str, key: str, value: bytes) -> None:
        await self._retained.put(key, value)

    async def _delete_retained(self, _what: str, key: str) -> None:
        await self._retained.delete(key)

    # --- persistent sessions' subscriptions ---------------------------------------------------------------

    def save_session(self, clientid: str, session: PersistentSession) -> bool:
        """Store the owner and subscriptions of ``clientid``'s persistent session (returns True at once; written in
        call order)."""
        value = {"username": session.username, "subscriptions": subscriptions_value(session.subscriptions)}
        self._enqueue(self._put_session, f"session of {clientid!r}", token(clientid), json.dumps(value).encode())
        return True

    def forget_session(self, clientid: str) -> None:
        """Delete ``clientid``'s stored session and queue (a clean-session CONNECT, or an MQTT 5 session's expiry;
        returns at once, written in call order)."""
        self._enqueue(self._delete_session, f"end of the session of {clientid!r}", token(clientid))
        self.drop_queue(clientid)

    def queue_message(self, clientid: str, topic: str, qos: int, payload: bytes) -> None:
        """Store a message queued for ``clientid``'s offline persistent session (returns at once; call order)."""
        self._enqueue(self._publish_queued, f"message queued for {clientid!r}", self._queue_subject(clientid),
                      payload, _headers(topic, qos, payload))

    def drop_queue(self, clientid: str) -> None:
        """Delete the stored queue and sends of ``clientid``, in one purge (returns at once; call order)."""
        self._enqueue(self._purge_queue, f"cleared queue of {clientid!r}", self._session_subjects(clientid))

    async def _publish_queued(self, _what: str, subject: str, payload: bytes, headers: dict[str, str]) -> None:
        await self._js.publish(subject, payload, headers=headers)

    async def _purge_queue(self, _what: str, subject: str, before: int | None = None) -> None:
        await self._js.purge_stream(self._queues, subject=subject, seq=before)

    # --- sends to connected sessions, stored until acknowledged ------------------------------------------

    async def store_sends(self, sends: list[tuple[str, str, int, bytes]]) -> list[int | None]:
        """Store each ``(clientid, topic, QoS, payload)``, a message of an ordinary topic about to be sent to a
        connected persistent session (run on the link's loop, by the fan-out, before the publisher's PUBACK): all
        pipelined on one reply subscription (``jetstream_publish.BatchPublisher``, each with a ``Nats-Msg-Id``), their
        acks awaited together, at most ``REQUEST_TIMEOUT_S``. Returns the stream sequence of each, for
        :meth:`settle_sends`, or Nones when they are not all stored (logged): NATS unreachable (at once, its outage
        logged) or the publishes not acknowledged in time."""
        if not self._link.connected:
            self._link.note_outage()
            return [None] * len(sends)
        messages = [Publish(self._sends_subject(clientid), payload,
                            {**_headers(topic, qos, payload), "Nats-Msg-Id": f"{self._ids}.{next(self._sent)}"})
                    for clientid, topic, qos, payload in sends]
        try:
            acks = await self._publisher.publish(messages, time.monotonic() + REQUEST_TIMEOUT_S)
        except Exception as exc:  # some not stored in time: those stored are purged at the session's next take
            log.warning("ECQ could not store %d messages sent to persistent sessions in the cluster (a crash of this "
                        "broker before their acknowledgement loses them): %s", len(sends), exc or type(exc).__name__)
            return [None] * len(sends)
        return [ack["seq"] for ack in acks]

    def settle_sends(self, keys: list[int]) -> None:
        """Delete the stored copies of messages sent (sequences from :meth:`store_sends` or :meth:`take_queue`):
        acknowledged, or dropped from the session's memory. Those settled in one turn of the broker's loop are
        deleted together, in call order with the other writes (returns at once); one JetStream dropped already
        (``session_max_queued``) is no error, another refusal is logged. A broker killed before the deletes landed
        sends them once more (QoS 1 allows it)."""
        self._settling.add(keys)

    def _delete_settled(self, keys: list[int]) -> None:
        self._enqueue(self._delete_sends, f"the deletes of {len(keys)} acknowledged messages", keys)

    async def _delete_sends(self, _what: str, keys: list[int]) -> None:
        """Ask JetStream to delete the messages of ``keys``, pipelined, their answers to one subscription
        (:meth:`_delete_answered`): a request and a future each cost the node more than the delete itself."""
        nc = self._link.nc
        if self._delete_replies is None:
            self._delete_replies = nc.new_inbox()
            await nc.subscribe(self._delete_replies, cb=self._delete_answered)
        subject = f"$JS.API.STREAM.MSG.DELETE.{self._queues}"
        for key in keys:
            await nc.publish(subject, b'{"seq":%d,"no_erase":true}' % key, reply=self._delete_replies)

    async def _delete_answered(self, msg: Any) -> None:
        error = json.loads(msg.data or b"{}").get("error")
        if error is not None and error.get("err_code") != NO_MESSAGE:
            log.warning("ECQ could not delete the stored copy of an acknowledged message in the cluster (a crash of "
                        "this broker sends it once more): %s", error.get("description"))

    async def take_queue(self, clientid: str, messages: list[tuple[str, int, bytes]],
                         kept: frozenset[int]) -> list[int | None]:
        """``clientid``'s queued ``messages`` ``[(topic, QoS, payload)]`` are being sent (run on the broker's loop):
        they are stored as its sends, then its queue is purged and, unless it holds sends of ``kept`` sequences
        (not yet acknowledged), its older sends too (those a broker that died or handed it over stored), all in
        call order with the other writes (at most ``REQUEST_TIMEOUT_S`` each). Returns their sequences, for
        :meth:`settle_sends`, or Nones when they could not be stored (logged; then nothing is purged)."""
        if not self._link.connected:
            self._link.note_outage()
            self._enqueue(self._purge_queue, f"queue of {clientid!r}", self._queue_subject(clientid))
            return [None] * len(messages)
        taken: concurrent.futures.Future = concurrent.futures.Future()
        self._enqueue(self._take, f"sent queue of {clientid!r}", clientid, messages, kept, taken)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(taken), TAKE_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("ECQ: the sent queue of %r not stored in the cluster within %.0f s", clientid, TAKE_TIMEOUT_S)
            return [None] * len(messages)

    async def _take(self, what: str, clientid: str, messages: list[tuple[str, int, bytes]], kept: frozenset[int],
                    taken: concurrent.futures.Future) -> None:
        keys: list[int | None] = [None] * len(messages)
        try:
            keys = await self.store_sends([(clientid, topic, qos, payload) for topic, qos, payload in messages])
            if None in keys:
                return
            if kept:  # sends not acknowledged, kept: the queue alone
                await self._purge_queue(what, self._queue_subject(clientid))
            else:  # the queue and the older sends, in one purge
                await self._purge_queue(what, self._session_subjects(clientid), min(keys, default=None))
        finally:
            taken.set_result(keys)

    async def _load_queue(self, subject: str) -> list[tuple[str, int, bytes]]:
        """The messages of ``subject`` (a session's queue or sends), oldest first, as the stream leader has them."""
        stream = self._queues
        newest = await self._from_leader(stream, subject)
        if newest is None:
            return []
        request = {"seq": 1, "next_by_subj": subject, "batch": self._settings.session_max_queued}

        async def caught_up() -> list[Any]:  # the replica answering a direct get may lag the leader
            replies = await self._api.direct(stream, request)
            if not replies or int(replies[-1].headers["Nats-Sequence"]) < newest["seq"]:
                raise Retry(f"the replica answering for {stream} has not caught up with seqno {newest['seq']}")
            return replies

        replies = await until(time.monotonic() + LEADER_READ_TIMEOUT_S, caught_up)
        return [(untoken(r.headers["Ecq-Topic"]), int(r.headers["Ecq-Qos"]),
                 from_cluster_form(bytes(r.data), r.headers.get(MQTT5_HEADER))) for r in replies]

    async def _from_leader(self, stream: str, subject: str) -> dict | None:
        """The newest message of ``subject`` as the stream leader has it (JetStream's stored-message JSON), or None."""
        answer = await until(time.monotonic() + LEADER_READ_TIMEOUT_S,
                             lambda: self._api.api(f"STREAM.MSG.GET.{stream}", {"last_by_subj": subject}))
        if "message" in answer:
            return answer["message"]
        if answer.get("error", {}).get("code") == 404:
            return None
        raise StoreError(f"reading {subject} from {stream}: {answer.get('error')}")

    def _queue_subject(self, clientid: str) -> str:
        return f"{self._settings.jetstream_namespace}.sq.{token(clientid)}"

    def _sends_subject(self, clientid: str) -> str:
        return f"{self._settings.jetstream_namespace}.ss.{token(clientid)}"

    def _session_subjects(self, clientid: str) -> str:
        """The filter of both subjects of ``clientid``'s session, its queue's and its sends'."""
        return f"{self._settings.jetstream_namespace}.*.{token(clientid)}"

    async def _put_session(self, _what: str, key: str, value: bytes) -> None:
        await self._sessions.put(key, value)

    async def _delete_session(self, _what: str, key: str) -> None:
        await self._sessions.delete(key)

    async def load_session(self, clientid: str) -> SessionState:
        """The stored owner, subscriptions and queued messages of ``clientid`` (run on the link's loop); not present
        when none are stored or they cannot be read (logged)."""
        bucket = f"{self._settings.jetstream_namespace}_sessions"
        try:  # from the leader: a replica may not hold the subscriptions written just before their broker died
            entry = await self._from_leader(f"KV_{bucket}", f"$KV.{bucket}.{token(clientid)}")
            if entry is None or KV_OPERATION in base64.b64decode(entry.get("hdrs") or ""):  # none, or deleted
                return SessionState(False)
            stored = SessionState.from_kv(base64.b64decode(entry["data"]))
            stored.messages = [*await self._load_queue(self._sends_subject(clientid)),
                               *await self._load_queue(self._queue_subject(clientid))]
            return stored
        except Exception as exc:
            log.warning("ECQ could not read the stored session of %r: %s", clientid, exc or type(exc).__name__)
            return SessionState(False)

    async def settle(self) -> None:
        """Wait (on the link's loop, at most ``SETTLE_TIMEOUT_S``) until the writes asked for so far are done: a
        broker handing a session over lets its queued messages land before the new holder may purge them."""
        try:
            await asyncio.wait_for(asyncio.shield(self._writes.join()), SETTLE_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("ECQ: writes to the cluster still pending after %.0f s", SETTLE_TIMEOUT_S)

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


def _headers(topic: str, qos: int, payload: bytes) -> dict[str, str]:
    """The headers of a stored message of a persistent session (see the module's docstring)."""
    headers = {"Ecq-Topic": token(topic), "Ecq-Qos": str(qos)}
    if (form := cluster_form(payload)) is not None:
        headers[MQTT5_HEADER] = form
    return headers


async def _bucket(js: Any, name: str, replicas: int, ttl: float | None) -> Any:
    """The KV bucket ``name``, created when missing (one value per key)."""
    try:
        return await js.key_value(name)
    except Exception:  # nats-py's BucketNotFoundError, or NotFoundError from the stream info
        return await js.create_key_value(bucket=name, history=1, replicas=replicas, ttl=ttl)


async def _stream(js: Any, config: StreamConfig) -> None:
    """Create the stream ``config`` describes, or bring an existing one to it."""
    try:
        await js.add_stream(config)
    except BadRequestError:  # it exists with another configuration (session_max_queued or session_expiry changed)
        await js.update_stream(config)
