"""Load processes for scripts/bench: a pool of spawned processes, each driving many aiomqtt clients.

The parent hands every load process one task per phase (:meth:`LoadPool.run`). A task connects its
clients, meets the others at a barrier, runs its timed part, and returns a JSON-ready dict of counts and
``time.monotonic_ns()`` instants (CLOCK_MONOTONIC is one clock for every process on the host, so the
parent can combine them, and can line them up with the CPU samples of :mod:`benchlib.sampler`).

Payloads carry an identity so that receivers count losses and duplicates: ``<clientid>/<key>|`` then
random padding up to the payload size; in a realtime flow the identity is the send time in ns.
Every wait is bounded: a task that runs past its deadline returns what it got with ``timed_out`` set.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiomqtt

from benchlib.procpool import ProcessPool

CONNECT_CONCURRENCY = 64      # connects in flight per process while setting up (not in a storm)
MIN_EXECUTOR_THREADS = 64     # aiomqtt runs each blocking socket connect() in the loop's default executor:
                              # a task gets a thread per client, so a storm is never queued in this process
RETRY_DELAY_S = 0.5           # a consumer whose connect failed or whose connection dropped tries again after this
SETUP_TIMEOUT_S = 120.0       # connecting and subscribing before the barrier
CLIENT_TIMEOUT_S = 60.0       # aiomqtt's bound on CONNACK, SUBACK and each PUBACK
DISCONNECT_TIMEOUT_S = 30.0   # all clients of one task, together
MAX_ERRORS_KEPT = 5
IDENT_END = b"|"


@dataclass(frozen=True)
class Endpoint:
    """An MQTT listener; ``username`` is sent by every client (stock amqtt keeps offline messages only for
    sessions that authenticated with a username); with ``mqtt5`` the clients speak MQTT 5.0 (Clean Start 1, no
    Session Expiry: producers only), else MQTT 3.1.1."""

    host: str
    port: int
    username: str | None = "bench"
    mqtt5: bool = False


Endpoints = Endpoint | tuple[Endpoint, ...]  # several brokers of one cluster: a task's clients are dealt over them


def endpoint_at(endpoints: Endpoints, n: int) -> Endpoint:
    """The endpoint of a task's n-th client (0-based) of one kind (producers, consumers): with several
    endpoints, clients are dealt round-robin over them."""
    if isinstance(endpoints, Endpoint):
        return endpoints
    return endpoints[n % len(endpoints)]


@dataclass(frozen=True)
class Messages:
    """``len(clientids) * len(keys)`` QoS 1 PUBLISHes of ``size_bytes`` each, key-major order (consecutive
    messages go to different clientids). ``topic_format`` takes ``{cid}`` and ``{key}``."""

    topic_format: str
    clientids: tuple[str, ...]
    keys: tuple[str, ...]
    size_bytes: int

    def build(self) -> list[tuple[str, bytes]]:
        """(topic, payload) pairs; each payload is ``<clientid>/<key>|`` then its own random bytes (so that
        LevelDB's block compression cannot shrink repeated padding)."""
        return [(self.topic_format.format(cid=cid, key=key),
                 identified_payload(f"{cid}/{key}", os.urandom(self.size_bytes)))
                for key in self.keys for cid in self.clientids]


@dataclass(frozen=True)
class PublishTask:
    """Publish ``messages`` from ``connections`` clients (dealt over ``endpoint`` when it holds several),
    ``window`` PUBLISHes in flight per client; the timed part runs from the barrier to the last PUBACK."""

    endpoint: Endpoints
    messages: Messages
    client_prefix: str
    connections: int = 8
    window: int = 32
    deadline_s: float = 120.0


@dataclass(frozen=True)
class ConsumeTask:
    """One client per clientid, each expecting the identities ``<clientid>/<key>`` for ``keys``.

    ``connect_after_start``: connect (and subscribe) only after the barrier, all at once (a reconnect
    storm); otherwise connect before it. ``subscribe_format`` (``{cid}``) is subscribed at QoS 1, before
    the barrier unless ``subscribe_after_start``; None subscribes nothing (a persistent session resuming).
    ``then_publish`` is published from this process after the barrier (the plain pub/sub baseline).
    With no keys the task only connects, subscribes and disconnects (it creates persistent sessions).
    With several endpoints, the consumer of the i-th clientid connects to ``endpoint[i % len(endpoint)]``.
    """

    endpoint: Endpoints
    clientids: tuple[str, ...]
    keys: tuple[str, ...]
    subscribe_format: str | None
    clean_session: bool = True
    connect_after_start: bool = False
    subscribe_after_start: bool = False
    then_publish: PublishTask | None = None
    deadline_s: float = 120.0


@dataclass(frozen=True)
class FlowTask:
    """A paced realtime flow: consumers online on ``subscribe_format``, and ``producers`` clients of this
    process publishing ``rate_per_s`` messages per second (round-robin over this task's clientids, then
    over ``keys`` keys) to ``write_format`` for ``duration_s`` or until the pool's stop event; then at
    most ``grace_s`` for the last deliveries. Worker 0 sets the pool's ``flowing`` event when sending starts.
    With several endpoints, consumer i and producer p connect to ``endpoint[i % n]`` and ``endpoint[p % n]``;
    see :meth:`Flow.producer_for` for which producer sends which write."""

    endpoint: Endpoints
    clientids: tuple[str, ...]
    subscribe_format: str
    write_format: str
    client_prefix: str
    rate_per_s: float
    duration_s: float
    size_bytes: int
    keys: int = 10
    producers: int = 2
    grace_s: float = 10.0


def identified_payload(ident: str, pad: bytes) -> bytes:
    """``ident|`` followed by ``pad`` bytes, cut to ``len(pad)`` bytes in total when ``ident`` fits."""
    head = ident.encode() + IDENT_END
    return head + pad[:max(0, len(pad) - len(head))]


def identity(payload: bytes) -> bytes:
    """The identity a payload starts with (everything before the first ``|``)."""
    return payload.split(IDENT_END, 1)[0]


# --- inside a load process ---------------------------------------------------------------------------


@dataclass
class Sync:
    """What a task shares with the other load processes and the parent: the start barrier, the stop
    event (ends a flow early) and the flowing event (set once a flow sends)."""

    barrier: Any
    stop: Any
    flowing: Any
    worker: int

    async def start(self) -> int:
        """Wait for every load process at the barrier; returns ``time.monotonic_ns()`` when released.

        Raises threading.BrokenBarrierError when another process failed before it (or after the setup timeout).
        """
        await asyncio.get_running_loop().run_in_executor(None, self.barrier.wait, SETUP_TIMEOUT_S)
        return time.monotonic_ns()

    def abort(self) -> None:
        """Release the others from the barrier with an error (this process cannot take part)."""
        self.barrier.abort()


@dataclass
class Tally:
    """Receipts of one process: counts, duplicates by identity, and the last receipt (monotonic ns)."""

    received: int = 0
    duplicates: int = 0
    unexpected: int = 0
    last_ns: int = 0
    errors: list[str] = field(default_factory=list)
    error_count: int = 0

    def error(self, exc: BaseException) -> None:
        """Count an error; keep the text of the first few."""
        self.error_count += 1
        text = f"{type(exc).__name__}: {exc}"
        if len(self.errors) < MAX_ERRORS_KEPT and text not in self.errors:
            self.errors.append(text)


def make_client(endpoint: Endpoint, identifier: str, *, clean_session: bool = True, window: int = 32) -> aiomqtt.Client:
    """An aiomqtt client (MQTT 3.1.1, or MQTT 5.0 with Clean Start 1 when ``endpoint.mqtt5``) allowing ``window``
    QoS 1 PUBLISHes in flight. Raises ValueError for a persistent session over MQTT 5.0 (it would need a Session
    Expiry Interval, MQTT 5.0 section 3.1.2.11.2, which no scenario uses)."""
    if endpoint.mqtt5 and not clean_session:
        raise ValueError("the load processes make MQTT 5.0 clients with Clean Start 1 only")
    session = ({"protocol": aiomqtt.ProtocolVersion.V5, "clean_start": True} if endpoint.mqtt5
               else {"clean_session": clean_session})
    client = aiomqtt.Client(endpoint.host, endpoint.port, identifier=identifier, username=endpoint.username,
                            timeout=CLIENT_TIMEOUT_S, max_inflight_messages=window, **session)
    client.pending_calls_threshold = 1 << 30  # many pending PUBLISHes are the point: no warning for each
    return client


async def bounded_gather(jobs: Iterable[Callable[[], Awaitable[Any]]], limit: int) -> list[Any]:
    """Run the jobs with at most ``limit`` at a time; returns results or exceptions, in order."""
    gate = asyncio.Semaphore(limit)

    async def one(job):
        async with gate:
            return await job()

    return await asyncio.gather(*(one(job) for job in jobs), return_exceptions=True)


async def disconnect_all(clients: Iterable[aiomqtt.Client]) -> None:
    """DISCONNECT every client, concurrently, giving up after DISCONNECT_TIMEOUT_S."""
    async def leave(client):
        try:
            await client.__aexit__(None, None, None)
        except aiomqtt.MqttError:
            pass

    jobs = [asyncio.ensure_future(leave(client)) for client in clients]
    if jobs:
        await asyncio.wait(jobs, timeout=DISCONNECT_TIMEOUT_S)


def raise_first(results: list[Any], what: str) -> None:
    """Raise RuntimeError naming ``what`` and the first exception among ``results``, if any."""
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(results)} {what} failed, first: {failures[0]!r}")


async def publish_window(client: aiomqtt.Client, items: Iterator[tuple[str, bytes]], tally: Tally) -> int:
    """Publish items from a shared iterator one after the other, each awaiting its PUBACK; returns PUBACKs.

    No per-PUBLISH timeout (aiomqtt would start a timer task for each): the task's deadline bounds the wait.
    """
    acked = 0
    for topic, payload in items:
        try:
            await client.publish(topic, payload, qos=1, timeout=math.inf)
            acked += 1
            tally.last_ns = time.monotonic_ns()
        except aiomqtt.MqttError as exc:
            tally.error(exc)
    return acked


async def publish_all(clients: list[aiomqtt.Client], messages: list[tuple[str, bytes]], window: int,
                      tally: Tally) -> int:
    """Spread ``messages`` round-robin over ``clients`` with ``window`` in flight each; returns PUBACKs."""
    shares = [iter(messages[i::len(clients)]) for i in range(len(clients))]
    acked = await asyncio.gather(*(publish_window(client, share, tally)
                                   for client, share in zip(clients, shares) for _ in range(window)))
    return sum(acked)


async def connect_publishers(endpoints: Endpoints, prefix: str, count: int, window: int) -> list[aiomqtt.Client]:
    """Connect ``count`` producer clients named ``<prefix><n>`` (dealt over ``endpoints``); raises RuntimeError
    if any fails."""
    clients = [make_client(endpoint_at(endpoints, n), f"{prefix}{n}", window=window) for n in range(count)]
    results = await bounded_gather([lambda c=c: c.__aenter__() for c in clients], CONNECT_CONCURRENCY)
    raise_first(results, "producer connects")
    return clients


async def run_publish(task: PublishTask, sync: Sync) -> dict:
    """Timed part: from the barrier to the last PUBACK of this process's messages."""
    messages = task.messages.build()
    try:
        clients = await connect_publishers(task.endpoint, f"{task.client_prefix}{sync.worker}-", task.connections,
                                           task.window)
    except BaseException:
        sync.abort()
        raise
    tally = Tally()
    try:
        start_ns = await sync.start()
        sending = asyncio.ensure_future(publish_all(clients, messages, task.window, tally))
        done, _ = await asyncio.wait([sending], timeout=task.deadline_s)
        acked = sending.result() if done else 0
        if not done:
            sending.cancel()
    finally:
        await disconnect_all(clients)
    return {"sent": len(messages), "acked": acked, "start_ns": start_ns, "end_ns": tally.last_ns,
            "timed_out": not done, "errors": tally.errors, "error_count": tally.error_count}


class Receiver:
    """One consumer: receives its expected identities into a shared :class:`Tally`, and, like a device,
    connects again (after RETRY_DELAY_S) whenever connecting fails or the connection drops."""

    def __init__(self, make: Callable[[], aiomqtt.Client], topic: str | None, expected: set[bytes], tally: Tally,
                 seen: set[bytes]) -> None:
        self.make, self.topic = make, topic
        self.client = make()
        self.missing, self.tally, self.seen = set(expected), tally, seen
        self.connect_s: float | None = None   # first attempt to first CONNACK, retries included
        self.connect_failures = 0
        self.reconnects = 0

    async def connect(self) -> None:
        """Connect, retrying with a fresh client until it works (the task's deadline ends the attempts)."""
        started = time.monotonic()
        while True:
            try:
                await self.client.__aenter__()
                break
            except aiomqtt.MqttError as exc:
                self.tally.error(exc)
                self.connect_failures += 1
                self.client = self.make()
                await asyncio.sleep(RETRY_DELAY_S * (1 + random.random()))
        if self.connect_s is None:
            self.connect_s = time.monotonic() - started

    async def run(self, connect: bool, subscribe: bool) -> None:
        """Connect and/or subscribe if asked, then take messages until nothing expected is missing; after a
        dropped connection, connect and subscribe again."""
        while self.missing:
            try:
                if connect:
                    await self.connect()
                if subscribe and self.topic:
                    await self.client.subscribe(self.topic, qos=1)
                await self.take_messages()
            except aiomqtt.MqttError as exc:
                self.tally.error(exc)
                self.reconnects += 1
                self.client = self.make()
                connect = subscribe = True
                await asyncio.sleep(RETRY_DELAY_S)

    async def take_messages(self) -> None:
        """Count each message (duplicate, unexpected, or newly seen); return once nothing is missing."""
        async for message in self.client.messages:
            ident = identity(bytes(message.payload))
            self.tally.received += 1
            self.tally.last_ns = time.monotonic_ns()
            if ident in self.seen:
                self.tally.duplicates += 1
            elif ident not in self.missing:
                self.tally.unexpected += 1
            self.seen.add(ident)
            self.missing.discard(ident)
            if not self.missing:
                return


async def prepare_consumers(task: ConsumeTask, receivers: list[Receiver], worker: int) -> list[aiomqtt.Client]:
    """Before the barrier: connect (and subscribe) what the task wants set up; then the baseline's producers."""
    if not task.connect_after_start:
        results = await bounded_gather([lambda r=r: r.client.__aenter__() for r in receivers], CONNECT_CONCURRENCY)
        raise_first(results, "consumer connects")
        if task.subscribe_format and not task.subscribe_after_start:
            results = await bounded_gather([lambda r=r: r.client.subscribe(r.topic, qos=1) for r in receivers],
                                           CONNECT_CONCURRENCY)
            raise_first(results, "subscribes")
    if not task.then_publish:
        return []
    publish = task.then_publish
    return await connect_publishers(publish.endpoint, f"{publish.client_prefix}{worker}-", publish.connections,
                                    publish.window)


def consumer_factory(task: ConsumeTask, index: int, cid: str) -> Callable[[], aiomqtt.Client]:
    """Makes the client of consumer ``cid``, the task's ``index``-th (a new one for each connection attempt)."""
    endpoint = endpoint_at(task.endpoint, index)
    return lambda: make_client(endpoint, cid, clean_session=task.clean_session)


async def run_consume(task: ConsumeTask, sync: Sync) -> dict:
    """Timed part: from the barrier to the last expected message (or the deadline)."""
    tally, seen = Tally(), set()
    receivers = [Receiver(consumer_factory(task, i, cid),
                          task.subscribe_format and task.subscribe_format.format(cid=cid),
                          {f"{cid}/{key}".encode() for key in task.keys}, tally, seen)
                 for i, cid in enumerate(task.clientids)]
    publishers: list[aiomqtt.Client] = []
    try:
        try:
            publishers = await prepare_consumers(task, receivers, sync.worker)
        except BaseException:
            sync.abort()
            raise
        start_ns = await sync.start()
        subscribe_now = task.connect_after_start or task.subscribe_after_start
        jobs = [asyncio.ensure_future(r.run(task.connect_after_start, subscribe_now)) for r in receivers]
        if publishers:
            messages = task.then_publish.messages.build()
            jobs.append(asyncio.ensure_future(publish_all(publishers, messages, task.then_publish.window, Tally())))
        done, pending = await asyncio.wait(jobs, timeout=task.deadline_s) if jobs else (set(), set())  # no clientid dealt here
        for job in pending:
            job.cancel()
    finally:
        await disconnect_all([r.client for r in receivers] + publishers)
    connect_times = sorted(r.connect_s for r in receivers if r.connect_s is not None)
    return {"clients": len(receivers), "expected": sum(len(task.keys) for _ in receivers),
            "received": tally.received, "unique": len(seen), "duplicates": tally.duplicates,
            "unexpected": tally.unexpected, "missing": sum(len(r.missing) for r in receivers),
            "missing_idents": sorted(i.decode() for r in receivers for i in r.missing),
            "start_ns": start_ns, "end_ns": tally.last_ns, "timed_out": bool(pending),
            "connect_s": connect_times, "connect_failures": sum(r.connect_failures for r in receivers),
            "reconnects": sum(r.reconnects for r in receivers), "errors": tally.errors,
            "error_count": tally.error_count}


class Flow:
    """The sending side of a :class:`FlowTask`: paced PUBLISHes whose identity is their send time in ns."""

    def __init__(self, task: FlowTask, producers: list[aiomqtt.Client], tally: Tally) -> None:
        self.task, self.producers, self.tally = task, producers, tally
        self.pad = os.urandom(task.size_bytes)
        self.sent = 0
        self.in_flight: set[asyncio.Task] = set()

    def topic(self, n: int) -> str:
        """The n-th write's topic: clientids round-robin, then the next key."""
        cids = self.task.clientids
        return self.task.write_format.format(cid=cids[n % len(cids)], key=f"k{(n // len(cids)) % self.task.keys}")

    def producer_for(self, n: int) -> aiomqtt.Client:
        """The producer of the n-th write: the write to the i-th clientid in round r (one round writes every
        clientid once) goes through producer (i + r) mod producers. Consecutive writes alternate producers,
        and each clientid's writes come through every producer in turn, so with producers on different
        nodes a share of every consumer's writes crosses nodes, whatever the count of clientids."""
        cids = len(self.task.clientids)
        return self.producers[(n % cids + n // cids) % len(self.producers)]

    def send_next(self) -> None:
        """Start one PUBLISH (not awaiting its PUBACK, so a slow ack never delays the pace)."""
        payload = identified_payload(str(time.monotonic_ns()), self.pad)
        client = self.producer_for(self.sent)
        job = asyncio.ensure_future(client.publish(self.topic(self.sent), payload, qos=1, timeout=math.inf))
        job.add_done_callback(self.finished)
        self.in_flight.add(job)
        self.sent += 1

    def finished(self, job: asyncio.Task) -> None:
        self.in_flight.discard(job)
        if not job.cancelled() and job.exception():
            self.tally.error(job.exception())

    async def run(self, sync: Sync) -> None:
        """Send at the task's rate from now until ``duration_s`` passed or the stop event is set."""
        started = time.monotonic()
        rate, ends = self.task.rate_per_s, started + self.task.duration_s
        next_stop_check = started
        while (now := time.monotonic()) < ends:
            if now >= next_stop_check:
                if sync.stop.is_set():
                    return
                next_stop_check = now + 0.05
            due = int((now - started) * rate)
            while self.sent < due:
                self.send_next()
            await asyncio.sleep(0.001)


class LatencyReceiver(Receiver):
    """Records (send ns, latency us) of each first receipt; identities are send times in ns."""

    def __init__(self, make: Callable[[], aiomqtt.Client], topic: str, tally: Tally, seen: set[bytes],
                 samples: list[tuple[int, int]]) -> None:
        super().__init__(make, topic, set(), tally, seen)
        self.samples = samples

    async def take_messages(self) -> None:
        """Record each first receipt; a dropped connection ends this consumer (its messages count as lost)."""
        try:
            await self.record_latencies()
        except aiomqtt.MqttError as exc:
            self.tally.error(exc)

    async def record_latencies(self) -> None:
        async for message in self.client.messages:
            now = time.monotonic_ns()
            ident = identity(bytes(message.payload))
            self.tally.received += 1
            self.tally.last_ns = now
            if ident in self.seen:
                self.tally.duplicates += 1
                continue
            self.seen.add(ident)
            sent_ns = int(ident)
            self.samples.append((sent_ns, (now - sent_ns) // 1000))


async def run_flow(task: FlowTask, sync: Sync) -> dict:
    """Timed part: the paced sending, then up to ``grace_s`` until every sent message arrived."""
    tally, seen, samples = Tally(), set(), []
    receivers = [LatencyReceiver(lambda cid=cid, at=endpoint_at(task.endpoint, i): make_client(at, cid),
                                 task.subscribe_format.format(cid=cid), tally, seen, samples)
                 for i, cid in enumerate(task.clientids)]
    producers: list[aiomqtt.Client] = []
    listening: list[asyncio.Future] = []
    try:
        try:
            results = await bounded_gather([lambda r=r: r.client.__aenter__() for r in receivers], CONNECT_CONCURRENCY)
            raise_first(results, "consumer connects")
            results = await bounded_gather([lambda r=r: r.client.subscribe(r.topic, qos=1) for r in receivers],
                                           CONNECT_CONCURRENCY)
            raise_first(results, "subscribes")
            producers = await connect_publishers(task.endpoint, f"{task.client_prefix}{sync.worker}-", task.producers,
                                                 window=1000)
        except BaseException:
            sync.abort()
            raise
        listening = [asyncio.ensure_future(r.take_messages()) for r in receivers]
        start_ns = await sync.start()
        if sync.worker == 0:
            sync.flowing.set()
        flow = Flow(task, producers, tally)
        await flow.run(sync)
        send_end_ns = time.monotonic_ns()
        grace_ends = time.monotonic() + task.grace_s
        while len(seen) < flow.sent and time.monotonic() < grace_ends:
            await asyncio.sleep(0.01)
    finally:
        for job in listening:
            job.cancel()
        await disconnect_all([r.client for r in receivers] + producers)
    return {"sent": flow.sent, "received": tally.received, "unique": len(seen), "duplicates": tally.duplicates,
            "start_ns": start_ns, "send_end_ns": send_end_ns, "end_ns": tally.last_ns,
            "samples": samples, "errors": tally.errors, "error_count": tally.error_count}


RUNNERS: dict[type, Callable[[Any, Sync], Awaitable[dict]]] = {
    PublishTask: run_publish, ConsumeTask: run_consume, FlowTask: run_flow}


def client_count(task: Any) -> int:
    """How many MQTT clients a task runs at most."""
    if isinstance(task, PublishTask):
        return task.connections
    if isinstance(task, FlowTask):
        return len(task.clientids) + task.producers
    return len(task.clientids) + (task.then_publish.connections if task.then_publish else 0)


async def run_task(task: Any, sync: Sync) -> dict:
    """Run one task on a fresh event loop whose default executor has a thread for each client's blocking connect."""
    threads = max(MIN_EXECUTOR_THREADS, client_count(task))
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(threads))
    return await RUNNERS[type(task)](task, sync)


def worker_main(conn, barrier, stop, flowing, worker: int) -> None:
    """A load process: run each task received on ``conn`` and send back its result (or its error)."""
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("mqtt").setLevel(logging.ERROR)  # aiomqtt: "could not gracefully disconnect" of a dead client
    sync = Sync(barrier, stop, flowing, worker)
    while (task := conn.recv()) is not None:
        try:
            result = asyncio.run(run_task(task, sync))
        except BaseException as exc:  # reported to the parent, which decides
            result = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send(result)


# --- in the parent -----------------------------------------------------------------------------------


class LoadTimeout(RuntimeError):
    """A load process did not answer in time; the pool was restarted."""


class LoadPool(ProcessPool):
    """``size`` load processes (multiprocessing, spawn); each phase gives every one of them one task."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.barrier = self._ctx.Barrier(size)
        self.stop = self._ctx.Event()
        self.flowing = self._ctx.Event()

    def start(self) -> LoadPool:
        """Spawn the processes (each imports aiomqtt once)."""
        self._spawn(worker_main, lambda worker, conn: (conn, self.barrier, self.stop, self.flowing, worker),
                    "bench-load")
        return self

    def submit(self, tasks: list[Any]) -> None:
        """Hand task i to load process i (exactly one task each); clears the stop and flowing events."""
        if len(tasks) != self.size:
            raise ValueError(f"{len(tasks)} tasks for {self.size} load processes")
        self.stop.clear()
        self.flowing.clear()
        self.barrier.reset()
        for conn, task in zip(self._conns, tasks):
            conn.send(task)

    def collect(self, timeout_s: float) -> list[dict]:
        """Results of the submitted tasks, in task order. Raises LoadTimeout after ``timeout_s`` seconds
        (and restarts the processes, so that the next phase starts clean)."""
        deadline = time.monotonic() + timeout_s
        results = []
        for conn in self._conns:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.restart()
                raise LoadTimeout(f"a load process gave no result within {timeout_s:.0f} s")
            results.append(conn.recv())
        return results

    def run(self, tasks: list[Any], timeout_s: float) -> list[dict]:
        """:meth:`submit` then :meth:`collect`."""
        self.submit(tasks)
        return self.collect(timeout_s)

    def restart(self) -> None:
        """Kill the processes and spawn fresh ones."""
        self._kill()
        self.barrier = self._ctx.Barrier(self.size)
        self.start()


def split(items: tuple[str, ...] | list[str], parts: int) -> list[tuple[str, ...]]:
    """``items`` dealt into ``parts`` nearly equal contiguous slices."""
    size, extra = divmod(len(items), parts)
    slices, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        slices.append(tuple(items[start:end]))
        start = end
    return slices

