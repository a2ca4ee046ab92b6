"""The ECQ tables on NATS JetStream: a :class:`ecq.store.protocol.QueueStore` that many brokers share.

JetStream is the core of the cluster (Raft-replicated streams on the NATS servers); every ECQ broker is a
stateless replicant that reads and writes through it. ``NS`` is ``jetstream_namespace``; ``T(x)`` is one
subject token holding any string: ``x`` then the URL-safe base64 of its UTF-8, unpadded.

==========================  ==================================================================================
ECQ table (ecq.store.leveldb)  on JetStream
==========================  ==================================================================================
index + payload             stream ``NS_Q_<shard>``, one message per entry on ``NS.q.<shard>.T(clientid).T(key)``
                            with header ``Ecq-Ts`` (publish ms); ``max_msgs_per_subject: 1``, so JetStream
                            itself deletes a key's older value when a new one is stored (compaction)
seqno                       the stream sequence: a queue's seqnos grow (with gaps: the shard's other queues
                            share the counter) and never repeat, even after every entry expired
state (ack position)        stream ``NS_ACKS``, the last message on ``NS.ack.T(clientid)`` (JSON), read from
                            the stream leader so that a consumer moving to another broker sees its last ack
==========================  ==================================================================================

A queue's shard is CRC32(clientid) modulo ``jetstream_shards``, as the writer pool picks an agent. A PUBACK
to a producer waits for JetStream's publish ack, sent once a quorum of the stream's replicas stored it.
Publishes carry a ``Nats-Msg-Id``, so one retried after a leader change is stored once (JetStream's
duplicate window, 2 min). Each shard stream republishes the headers of what it stored on
``NS.appended.<shard>.>``: every broker learns of every append (:meth:`JetStreamStore.watch`), whichever
broker took the write.

Reads (ecq/store/jetstream_reads.py) use JetStream's batched direct get (answered by a current replica) and
ask the stream leader only for what a lagging replica has not yet stored.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import DiscardPolicy, RePublish, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from ecq.store.jsapi import (REQUEST_TIMEOUT_S, RETRY_PAUSE_S, TS_HEADER, JetStreamApi, Retry, queue_subject_parts,
                              stream_ms, token, until)
from ecq.store.jetstream_reads import JetStreamReads
from ecq.store.link import NatsLink
from ecq.config import EcqSettings
from ecq.store.protocol import (AckState, Append, Appended, CommitResult, Expire, ExpiredRow, ForgetQueue, IndexEntry,
                             Message, Op, SaveAck, StoreError)

log = logging.getLogger(__name__)
T = TypeVar("T")

DUPLICATE_WINDOW_S = 120.0   # JetStream's de-duplication of a retried publish by Nats-Msg-Id
META_TIMEOUT_S = 30.0        # creating or checking the streams at start-up


class JetStreamStore:
    """ECQ queues in the JetStream streams of ``settings.jetstream_namespace`` (created when missing).

    Raises :class:`ecq.store.link.NatsUnavailable` when no NATS server answers, and StoreError when the
    streams cannot be created or were made with another shard count. Methods block; none may run on the
    link's loop. Writes that fail for lack of NATS set ``write_error`` until the link is back.
    """

    shared = True

    def __init__(self, settings: EcqSettings) -> None:
        self.write_error: str | None = None
        self._settings = settings
        self._ns = settings.jetstream_namespace
        self._shards = settings.jetstream_shards
        self._notify: Callable[[str, int, str], None] | None = None
        self.observe_publish: Callable[[float], None] = lambda _seconds: None  # publish-to-ack time, any thread
        self._msg_ids = itertools.count(1)
        self._msg_id_prefix = f"{settings.effective_node_name()}-{uuid.uuid4().hex[:8]}-"
        self._link = NatsLink(settings, on_reconnect=self._reconnected)
        self._js = JetStreamApi(self._link)
        self.reads = JetStreamReads(settings, self._js, self._call, self.shard, self.stream, self._queue_subject,
                                    self._ack_subject)
        self._link.start()
        self._on_reconnect: Callable[[], None] = lambda: None
        try:
            self._call(self._ensure_streams(), META_TIMEOUT_S)
        except Exception:
            self._link.close()
            raise

    @property
    def connected(self) -> bool:
        """True while the link to NATS is up."""
        return self._link.connected

    # --- layout -------------------------------------------------------------------------------------

    def shard(self, clientid: str) -> int:
        """The shard (stream number) holding the queue of ``clientid``."""
        return zlib.crc32(clientid.encode()) % self._shards

    def stream(self, shard: int) -> str:
        """Name of the stream of ``shard``."""
        return f"{self._ns}_Q_{shard}"

    def _queue_subject(self, clientid: str, key: str | None = None) -> str:
        base = f"{self._ns}.q.{self.shard(clientid)}.{token(clientid)}"
        return f"{base}.>" if key is None else f"{base}.{token(key)}"

    def _ack_subject(self, clientid: str) -> str:
        return f"{self._ns}.ack.{token(clientid)}"

    async def _ensure_streams(self) -> None:
        """Create the missing streams; the acks stream, made last, records the shard count (``ecq_shards`` in its
        metadata). Raises StoreError for another shard count, or when a recorded cluster's shard streams are
        still not all there after META_TIMEOUT_S (NATS servers that are restarting list them one by one)."""
        js = self._link.nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        wanted = {self.stream(shard) for shard in range(self._shards)}
        deadline = time.monotonic() + META_TIMEOUT_S
        while True:
            recorded, existing = await until(deadline, lambda: self._layout(js))
            if (recorded or self._shards) != self._shards or existing - wanted:
                raise StoreError(f"JetStream holds {recorded or len(existing)} ECQ shard streams of namespace "
                                 f"{self._ns!r}, but jetstream_shards is {self._shards}: use the same value on every "
                                 f"node (queues are placed by it)")
            if recorded is None or existing == wanted:
                break
            if time.monotonic() > deadline:
                raise StoreError(f"JetStream lists {len(existing)} of the {self._shards} ECQ shard streams of "
                                 f"namespace {self._ns!r}: are all NATS servers up?")
            await asyncio.sleep(RETRY_PAUSE_S)
        replicas = self._settings.jetstream_replicas
        for shard in range(self._shards):
            await self._ensure(js, StreamConfig(
                name=self.stream(shard), subjects=[f"{self._ns}.q.{shard}.>"], max_msgs_per_subject=1,
                num_replicas=replicas, allow_direct=True, storage=StorageType.FILE, discard=DiscardPolicy.OLD,
                duplicate_window=DUPLICATE_WINDOW_S,
                republish=RePublish(src=f"{self._ns}.q.{shard}.>", dest=f"{self._ns}.appended.{shard}.>",
                                    headers_only=True)))
        await self._ensure(js, StreamConfig(
            name=f"{self._ns}_ACKS", subjects=[f"{self._ns}.ack.>"], max_msgs_per_subject=1, num_replicas=replicas,
            allow_direct=False, storage=StorageType.FILE, discard=DiscardPolicy.OLD,
            duplicate_window=DUPLICATE_WINDOW_S, metadata={"ecq_shards": str(self._shards)}))
        await self._link.nc.subscribe(f"{self._ns}.appended.>", cb=self._appended)

    async def _layout(self, js: Any) -> tuple[int | None, set[str]]:
        """(shard count recorded by the acks stream or None, names of the shard streams JetStream lists)."""
        try:
            infos = await js.streams_info()
        except APIError as exc:
            raise Retry(f"JetStream stream list: {exc.description}") from None  # e.g. no meta leader yet
        recorded = None
        for info in infos:
            if info.config.name == f"{self._ns}_ACKS" and (info.config.metadata or {}).get("ecq_shards"):
                recorded = int(info.config.metadata["ecq_shards"])
        return recorded, {info.config.name for info in infos if info.config.name.startswith(f"{self._ns}_Q_")}

    @staticmethod
    async def _ensure(js: Any, config: StreamConfig) -> None:
        try:
            info = await js.stream_info(config.name)
        except NotFoundError:
            try:
                await js.add_stream(config)
            except APIError as exc:
                raise StoreError(f"cannot create JetStream stream {config.name}: {exc.description} "
                                 f"(jetstream_replicas {config.num_replicas} needs as many NATS servers)") from None
            return
        if info.config.num_replicas != config.num_replicas or (
                config.metadata and not config.metadata.items() <= (info.config.metadata or {}).items()):
            await js.update_stream(config)

    # --- notifications ------------------------------------------------------------------------------

    def watch(self, notify: Callable[[str, int, str], None], on_reconnect: Callable[[], None]) -> None:
        """Call ``notify(clientid, seqno, key)`` for every entry stored by any broker, and ``on_reconnect()``
        after the link to NATS came back (notifications sent meanwhile are lost: poll the online consumers).
        Both run on the link's thread and must hand over to their own loop."""
        self._notify, self._on_reconnect = notify, on_reconnect

    async def _appended(self, msg: Any) -> None:
        if self._notify is None or not msg.headers:
            return
        try:
            clientid, key = queue_subject_parts(msg.headers["Nats-Subject"])
            self._notify(clientid, int(msg.headers["Nats-Sequence"]), key)
        except (KeyError, ValueError) as exc:
            log.warning("ECQ: ignored a malformed append notice on %s: %s", msg.subject, exc)

    def _reconnected(self) -> None:
        self._on_reconnect()

    # --- writes -------------------------------------------------------------------------------------

    def commits_without_waiting(self) -> bool:
        """Never: every commit waits on the network."""
        return False

    def commit_async(self, ops: Sequence[Op]) -> asyncio.Future:
        """:meth:`commit` on the link's loop, awaited from the caller's loop without a thread in between."""
        return self._link.submit(self._commit_or_raise(ops))

    def read_async(self, func: Callable[..., T], *args: Any) -> asyncio.Future | None:
        """``read_after`` and ``ack_state`` (delivery's reads) on the link's loop without a thread; None for
        the other reads (run them in a reader thread)."""
        if func == self.read_after:
            return self._link.submit(self.reads.read_after_async(*args))
        if func == self.ack_state:
            return self._link.submit(self.reads.ack_state_async(*args))
        return None

    def commit(self, ops: Sequence[Op]) -> list[CommitResult]:
        """Apply ``ops`` in order (QueueStore.commit). Not atomic across ops: each is stored on a quorum or
        not at all, and a failed batch may have stored its first ops (their writers get no PUBACK and the
        producer sends them again). Raises StoreError after ``write_timeout`` without NATS."""
        return self._call(self._commit_or_raise(ops), self._settings.write_timeout + REQUEST_TIMEOUT_S)

    async def _commit_or_raise(self, ops: Sequence[Op]) -> list[CommitResult]:
        try:
            return await self._commit(ops, time.monotonic() + self._settings.write_timeout)
        except (TimeoutError, NatsTimeout, NoRespondersError, ConnectionError, Retry) as exc:
            if not self._link.connected:
                self.write_error = "NATS unreachable"
                self._link.note_outage()
            raise StoreError(f"JetStream commit failed: {exc or type(exc).__name__}") from None

    async def _commit(self, ops: Sequence[Op], deadline: float) -> list[CommitResult]:
        appends = [op for op in ops if isinstance(op, Append)]
        looked_up = iter(await asyncio.gather(*(until(deadline, lambda op=op: self._last_of_key(op))
                                                for op in appends)))
        # tasks created in order: nats-py writes their requests to its one connection in this order
        done = await asyncio.gather(*[asyncio.ensure_future(self._apply(op, deadline)) for op in ops])
        latest: dict[tuple[str, str], tuple[int, int]] = {}  # a key written twice in this batch
        results: list[CommitResult] = []
        for op, result in zip(ops, done, strict=True):
            if not isinstance(op, Append):
                results.append(result)
                continue
            old = latest.get((op.clientid, op.key), next(looked_up))
            latest[(op.clientid, op.key)] = (result, len(op.payload))
            results.append(Appended(result, (old[0],), old[1]) if old else Appended(result))
        return results

    async def _apply(self, op: Op, deadline: float) -> Any:
        if isinstance(op, Append):
            headers = {TS_HEADER: str(op.ts_ms), "Nats-Msg-Id": self._msg_id_prefix + str(next(self._msg_ids))}
            ack = await self._publish(self._queue_subject(op.clientid, op.key), op.payload, headers, deadline)
            return ack["seq"]
        if isinstance(op, SaveAck):
            state = op.state
            above = sorted(seqno for seqno in state.above if seqno > state.acked)
            body = json.dumps({"acked": state.acked, "last_ack_ms": state.last_ack_ms, "above": above})
            await self._publish(self._ack_subject(op.clientid), body.encode(),
                                {"Nats-Msg-Id": self._msg_id_prefix + str(next(self._msg_ids))}, deadline)
            return None
        if isinstance(op, ForgetQueue):
            return await self._forget(op)
        return await self._expire(op)

    async def _publish(self, subject: str, payload: bytes, headers: dict[str, str], deadline: float) -> dict:
        """Publish to JetStream until stored or ``deadline`` (time.monotonic()); the same Nats-Msg-Id on every
        try, so a try whose ack was lost is not stored twice. Raises TimeoutError at the deadline."""
        started = time.monotonic()

        async def attempt() -> dict:
            reply = await self._link.nc.request(subject, payload, headers=headers,
                                                timeout=min(REQUEST_TIMEOUT_S, max(0.05, deadline - time.monotonic())))
            answer = json.loads(reply.data)
            if "error" in answer:  # e.g. 503 while the stream elects a leader
                raise Retry(f"JetStream did not store {subject}: {answer['error'].get('description')}")
            return answer

        answer = await until(deadline, attempt)
        self.observe_publish(time.monotonic() - started)
        return answer

    async def _last_of_key(self, op: Append) -> tuple[int, int] | None:
        """(seqno, payload bytes) of the value ``op`` will replace, or None (compaction events and counts)."""
        reply = await self._js.direct(self.stream(self.shard(op.clientid)),
                                      {"last_by_subj": self._queue_subject(op.clientid, op.key)})
        if not reply:
            return None
        return int(reply[0].headers["Nats-Sequence"]), len(reply[0].data)

    async def _expire(self, op: Expire) -> tuple[ExpiredRow, ...]:
        stream = self.stream(self.shard(op.clientid))
        answers = await asyncio.gather(*(self._js.api(f"STREAM.MSG.DELETE.{stream}",
                                                      {"seq": row.seqno, "no_erase": True}) for row in op.rows))
        return tuple(row for row, answer in zip(op.rows, answers, strict=True) if answer.get("success"))

    async def _forget(self, op: ForgetQueue) -> bool:
        """Purge the ack state of an empty queue saved before ``op.cutoff_ms``: only that message (a purge of
        the subject below the next sequence), so a state saved meanwhile stays. A queue's seqnos are stream
        sequences, which never restart: an entry written after the purge is above anything acked before it."""
        subject = self._ack_subject(op.clientid)
        answer = await self._js.api(f"STREAM.MSG.GET.{self._ns}_ACKS", {"last_by_subj": subject})
        if "message" not in answer:
            return False
        saved = answer["message"]
        body = json.loads(base64.b64decode(saved["data"]))
        if max(body["last_ack_ms"], stream_ms(saved["time"])) >= op.cutoff_ms or await self._holds_entries(op.clientid):
            return False
        purged = await self._js.api(f"STREAM.PURGE.{self._ns}_ACKS", {"filter": subject, "seq": saved["seq"] + 1})
        return bool(purged.get("purged"))

    async def _holds_entries(self, clientid: str) -> bool:
        return await self.reads.holds_entries(clientid)

    # --- reads (JetStreamReads) --------------------------------------------------------------------

    def read_after(self, clientid: str, after: int, limit: int, min_ts_ms: int = 0,
                   known_last: int | None = None) -> list[Message]:
        """See :meth:`JetStreamReads.read_after`."""
        return self.reads.read_after(clientid, after, limit, min_ts_ms, known_last)

    def ack_state(self, clientid: str) -> AckState:
        """See :meth:`JetStreamReads.ack_state`."""
        return self.reads.ack_state(clientid)

    def ack_states(self) -> Iterator[tuple[str, AckState]]:
        """See :meth:`JetStreamReads.ack_states`."""
        return self.reads.ack_states()

    def expired_step(self, cutoff_ms: int, limit: int, start: bytes | None = None
                     ) -> tuple[dict[str, list[ExpiredRow]], bytes | None]:
        """See :meth:`JetStreamReads.expired_step`."""
        return self.reads.expired_step(cutoff_ms, limit, start)

    def idle_queues(self, cutoff_ms: int) -> list[str]:
        """See :meth:`JetStreamReads.idle_queues`."""
        return self.reads.idle_queues(cutoff_ms)

    def stored_totals(self) -> tuple[int, int]:
        """(entries, bytes) stored across every shard, from the streams' state: bytes are JetStream's stored
        bytes (payload, subject and headers), the same figure on every broker."""
        infos = self._call(self._shard_infos(), self._settings.read_timeout)
        return sum(i.state.messages for i in infos), sum(i.state.bytes for i in infos)

    async def _shard_infos(self) -> list[Any]:
        js = self._link.nc.jetstream()
        return list(await asyncio.gather(*(js.stream_info(self.stream(s)) for s in range(self._shards))))

    def count_queues(self) -> int:
        """See :meth:`JetStreamReads.count_queues`."""
        return self.reads.count_queues()

    def last_seqno(self, clientid: str) -> int:
        """See :meth:`JetStreamReads.last_seqno`."""
        return self.reads.last_seqno(clientid)

    def seqnos(self, clientid: str) -> Iterator[int]:
        """See :meth:`JetStreamReads.seqnos`."""
        return self.reads.seqnos(clientid)

    def queue_range(self, clientid: str) -> tuple[int, int, int] | None:
        """See :meth:`JetStreamReads.queue_range`."""
        return self.reads.queue_range(clientid)

    def edge_index_entries(self) -> tuple[IndexEntry | None, IndexEntry | None]:
        """See :meth:`JetStreamReads.edge_index_entries`."""
        return self.reads.edge_index_entries()

    def stored_entries(self, clientid: str | None = None, after: int = 0) -> Iterator[tuple[str, int, int, int]]:
        """See :meth:`JetStreamReads.stored_entries`."""
        return self.reads.stored_entries(clientid, after)

    # --- lifecycle ----------------------------------------------------------------------------------

    def run(self, func: Callable[..., T], *args: Any) -> T:
        """``func(*args)``: nothing here is reopened under a read."""
        return func(*args)

    def reopen_if_space(self) -> bool:
        """After failed commits: True (and commits accepted again) once the link to NATS is back."""
        if self._link.connected:
            self.write_error = None
            return True
        self._link.note_outage()
        return False

    def verify(self) -> tuple[int, float]:
        """Check that every shard stream answers; returns (entries, seconds)."""
        started = time.monotonic()
        entries, _bytes = self.stored_totals()
        return entries, time.monotonic() - started

    def close(self) -> None:
        """Close the link to NATS; everything committed is on the JetStream replicas."""
        self._link.close()

    def _call(self, coro: Any, timeout: float) -> Any:
        try:
            return self._link.call(coro, timeout)
        except (NatsTimeout, NoRespondersError, Retry) as exc:
            raise TimeoutError(f"NATS: {exc or type(exc).__name__}") from None

