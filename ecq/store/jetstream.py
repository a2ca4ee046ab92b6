"""The ECQ tables on NATS JetStream: a :class:`ecq.store.protocol.QueueStore` that many brokers share.

JetStream is the core of the cluster (Raft-replicated streams on the NATS servers); every ECQ broker is a
stateless replicant that reads and writes through it. ``NS`` is ``jetstream_namespace``; ``T(x)`` is one
subject token holding any string: ``x`` then the URL-safe base64 of its UTF-8, unpadded.

==========================  ==================================================================================
ECQ table (ecq.store.leveldb)  on JetStream
==========================  ==================================================================================
index + payload             stream ``NS_Q_<shard>``, one message per entry on ``NS.q.<shard>.T(clientid).T(key)``
                            with header ``Ecq-Ts`` (publish ms), and ``Ecq-Expires`` (expiry ms) for an
                            entry with an expiry of its own (MQTT 5 Message Expiry Interval);
                            ``max_msgs_per_subject: 1``, so JetStream itself deletes a key's older value when
                            a new one is stored (compaction)
seqno                       the stream sequence: a queue's seqnos grow (with gaps: the shard's other queues
                            share the counter) and never repeat, even after every entry expired
state (ack position)        stream ``NS_ACKS``, the last message on ``NS.ack.T(clientid)`` (JSON), read from
                            the stream leader so that a consumer moving to another broker sees its last ack
==========================  ==================================================================================

A queue's shard is CRC32(clientid) modulo ``jetstream_shards``, as the writer pool picks an agent. A PUBACK
to a producer waits for JetStream's publish ack, sent once a quorum of the stream's replicas stored it.
Publishes carry a ``Nats-Msg-Id``, so one retried after a leader change is stored once (JetStream's
duplicate window, 2 min); the write side is ecq.store.jetstream_writes. Each shard stream republishes what
it stored, payload included, on ``NS.appended.<shard>.>`` and the acks stream every saved state on
``NS.acked.>``: every broker learns of every append and ack save, whichever broker took it
(:meth:`JetStreamStore.watch`, ecq.store.jetstream_notices).

Reads (ecq/store/jetstream_reads.py) use JetStream's batched direct get (answered by a current replica) and
ask the stream leader only for what a lagging replica has not yet stored.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import DiscardPolicy, RePublish, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from ecq.store.jsapi import REQUEST_TIMEOUT_S, RETRY_PAUSE_S, JetStreamApi, Retry, token, until
from ecq.store.jetstream_notices import ShardWatch
from ecq.store.jetstream_publish import BatchPublisher
from ecq.store.jetstream_reads import JetStreamReads
from ecq.store.jetstream_writes import JetStreamWrites
from ecq.store.jetstream_health import StreamHealth
from ecq.store.link import NatsLink
from ecq.config import EcqSettings
from ecq.store.protocol import AckState, ExpiredRow, IndexEntry, Message, StoreError, StoreListener

log = logging.getLogger(__name__)
T = TypeVar("T")

DUPLICATE_WINDOW_S = 120.0   # JetStream's de-duplication of a retried publish by Nats-Msg-Id
META_TIMEOUT_S = 30.0        # creating or checking the streams at start-up


class JetStreamStore(JetStreamWrites):
    """ECQ queues in the JetStream streams of ``settings.jetstream_namespace`` (created when missing).

    Raises :class:`ecq.store.link.NatsUnavailable` when no NATS server answers, and StoreError when the
    streams cannot be created or were made with another shard count. Methods block; none may run on the
    link's loop. Writes that fail for lack of NATS set ``write_error`` until the link is back.
    """

    shared = True
    edge_order = "time"  # each shard stream's first and last entry, in append order

    def __init__(self, settings: EcqSettings) -> None:
        self.write_error: str | None = None
        self._settings = settings
        self._ns = settings.jetstream_namespace
        self._shards = settings.jetstream_shards
        self._watch: ShardWatch | None = None
        self.observe_publish: Callable[[float], None] = lambda _seconds: None  # publish-to-ack time, any thread
        self._msg_ids = itertools.count(1)
        self._msg_id_prefix = f"{settings.effective_node_name()}-{uuid.uuid4().hex[:8]}-"
        self._link = NatsLink(settings, on_reconnect=self._reconnected)
        self._publisher = BatchPublisher(self._link, lambda seconds: self.observe_publish(seconds))
        self._js = JetStreamApi(self._link)
        self.reads = JetStreamReads(settings, self._js, self._call, self.shard, self.stream, self._queue_subject,
                                    self._ack_subject)
        self._link.start()
        try:
            self._call(self._ensure_streams(), META_TIMEOUT_S)
        except Exception:
            self._link.close()
            raise

    @property
    def connected(self) -> bool:
        """True while the link to NATS is up."""
        return self._link.connected

    def stream_health(self) -> StreamHealth:
        """A monitor of every ECQ stream over this store's link (not started: see StreamHealth.start)."""
        names = [self.stream(shard) for shard in range(self._shards)] + [f"{self._ns}_ACKS"]
        return StreamHealth(self._link, names, self._settings.jetstream_replicas)

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
                republish=RePublish(src=f"{self._ns}.q.{shard}.>", dest=f"{self._ns}.appended.{shard}.>")))
        await self._ensure(js, StreamConfig(
            name=f"{self._ns}_ACKS", subjects=[f"{self._ns}.ack.>"], max_msgs_per_subject=1, num_replicas=replicas,
            allow_direct=False, storage=StorageType.FILE, discard=DiscardPolicy.OLD,
            duplicate_window=DUPLICATE_WINDOW_S, metadata={"ecq_shards": str(self._shards)},
            republish=RePublish(src=f"{self._ns}.ack.>", dest=f"{self._ns}.acked.>")))

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
        if info.config.num_replicas != config.num_replicas or _republish(info.config) != _republish(config) or (
                config.metadata and not config.metadata.items() <= (info.config.metadata or {}).items()):
            await js.update_stream(config)  # e.g. streams made before notices carried payloads

    # --- notifications ------------------------------------------------------------------------------

    def watch(self, listener: StoreListener) -> None:
        """Tell ``listener`` of every append, deletion and ack save of every broker (ecq.store.jetstream_notices),
        once every shard was read into the map of stored subjects. Raises TimeoutError when NATS does not answer
        within META_TIMEOUT_S."""
        watch = ShardWatch(self._link, self._js, self._ns, self._shards, self.stream, self._queue_subject,
                           self._msg_id_prefix, listener)
        self._call(watch.start(), META_TIMEOUT_S)
        self._watch = watch

    def _reconnected(self) -> None:
        if self._watch is not None:  # notices sent while away are lost: compare every shard with the map now
            self._link.loop.create_task(self._watch.check_logged())

    def read_async(self, func: Callable[..., T], *args: Any) -> asyncio.Future | None:
        """``read_after`` and ``ack_state`` (delivery's reads) on the link's loop without a thread; None for
        the other reads (run them in a reader thread)."""
        if func == self.read_after:
            return self._link.submit(self.reads.read_after_async(*args))
        if func == self.ack_state:
            return self._link.submit(self.reads.ack_state_async(*args))
        return None


    async def _holds_entries(self, clientid: str) -> bool:
        return await self.reads.holds_entries(clientid)

    # --- reads (JetStreamReads) --------------------------------------------------------------------

    def read_after(self, clientid: str, after: int, limit: int, min_ts_ms: int = 0,
                   known_last: int | None = None, lapsed_at_ms: int = 0) -> list[Message]:
        """See :meth:`JetStreamReads.read_after`."""
        return self.reads.read_after(clientid, after, limit, min_ts_ms, known_last, lapsed_at_ms)

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

    def lapsed_step(self, now_ms: int, limit: int, start: bytes | None = None
                    ) -> tuple[dict[str, list[ExpiredRow]], bytes | None]:
        """One GC step over the entries with an expiry of their own, from the watch's map (ShardWatch.lapsed: no
        request to NATS); ``start`` is ``b"<shard>:<seqno>"``. Nothing without a watch (the broker always has one)."""
        if self._watch is None:
            return {}, None
        shard, seq = map(int, start.split(b":")) if start else (0, 0)
        found, seq = self._call(_on_loop(functools.partial(self._watch.lapsed, now_ms, limit, shard, seq)),
                                self._settings.read_timeout)
        if seq is not None:
            return found, f"{shard}:{seq}".encode()
        return found, f"{shard + 1}:0".encode() if shard + 1 < self._shards else None

    def idle_queues(self, cutoff_ms: int) -> list[str]:
        """See :meth:`JetStreamReads.idle_queues`."""
        return self.reads.idle_queues(cutoff_ms)

    def stored_totals(self) -> tuple[int, int]:
        """(entries, payload bytes) stored across every shard, as LevelDB counts them (not JetStream's stored
        bytes, which add subjects, headers and per-message overhead): from the map of stored subjects once
        :meth:`watch` built it, otherwise a scan of every stored entry (O(stored bytes))."""
        if self._watch is not None:
            return self._call(_on_loop(self._watch.totals), self._settings.read_timeout)
        sizes = [size for *_entry, size in self.reads.stored_entries()]
        return len(sizes), sum(sizes)

    async def _shard_infos(self) -> list[Any]:
        js = self._link.nc.jetstream()
        return list(await asyncio.gather(*(js.stream_info(self.stream(s)) for s in range(self._shards))))

    def count_queues(self) -> int:
        """How many queues hold entries now: from the map of stored subjects once :meth:`watch` built it,
        otherwise :meth:`JetStreamReads.count_queues` (a listing of every stored subject, O(keys))."""
        if self._watch is not None:
            return self._call(_on_loop(self._watch.queues), self._settings.read_timeout)
        return self.reads.count_queues()

    def key_bytes(self, clientid: str, key: str) -> int | None:
        """See :meth:`JetStreamReads.key_bytes`."""
        return self.reads.key_bytes(clientid, key)

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
        infos = self._call(self._shard_infos(), self._settings.read_timeout)
        return sum(i.state.messages for i in infos), time.monotonic() - started

    def close(self) -> None:
        """Stop watching and close the link to NATS; everything committed is on the JetStream replicas."""
        if self._watch is not None:
            try:
                self._call(self._watch.stop(), REQUEST_TIMEOUT_S)
            except Exception as exc:
                log.debug("ECQ shard watch not stopped cleanly: %s", exc)
        self._link.close()

    def _call(self, coro: Any, timeout: float) -> Any:
        try:
            return self._link.call(coro, timeout)
        except (NatsTimeout, NoRespondersError, Retry) as exc:
            raise TimeoutError(f"NATS: {exc or type(exc).__name__}") from None


def _republish(config: StreamConfig) -> tuple | None:
    republish = config.republish
    return (republish.src, republish.dest, bool(republish.headers_only)) if republish else None


async def _on_loop(func: Callable[[], T]) -> T:
    return func()
