"""The ECQ amqtt broker plugin: enable it by listing ``ecq.broker.plugin.EcqPlugin`` under ``plugins:``.

It stores ``$ECQ/w/<clientid>/<key>`` writes in LevelDB with compaction by key, delivers each queue at
QoS 1 to the one client ``<clientid>`` subscribed to ``$ECQ/<clientid>/#``, and garbage-collects
entries older than ``data_retention`` (SPEC.md section 1). Around that: the ACL file (it is also the
broker's topic filter for every other topic), the admin HTTP API with Prometheus metrics, and the queue
event stream to the Parquet lake (issues 4 and 6). Options: :class:`ecq.config.EcqSettings`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from amqtt.broker import BrokerContext
from amqtt.contexts import Action
from amqtt.errors import AMQTTError
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.publish import PublishPacket
from amqtt.plugins.base import BaseTopicPlugin
from amqtt.session import Session

from ecq.ops import admin
from ecq.broker import amqtt_hooks as hooks
from ecq.broker.acl import Acl, ClientInfo, Decision, load_acl
from ecq.config import EcqSettings, split_host_port
from ecq.queue.deadlines import SharedDeadline
from ecq.queue.delivery import Consumer, now_ms
from ecq.ops.metrics import EcqMetrics
from ecq.queue.readers import BatchedReader
from ecq.queue.store import Append, Appended, Expire, ExpiredRow, Message, Op, Store, StoreError, StoreReadError
from ecq.queue.topics import BadWrite, is_ecq_topic, parse_target, parse_write, queue_filter
from ecq.queue.writer import PoolClosed, WriterPool

log = logging.getLogger(__name__)

PLUGIN_PATH = "ecq.broker.plugin.EcqPlugin"
SECRET_OPTIONS = frozenset({"admin_token"})  # never shown by options(); pydantic's SecretStr hides them in inuse
REDACTED = "**********"                      # what pydantic's SecretStr shows
GC_EVENTS_PENDING = 2048     # GC waits while more events than this wait for the recorder's thread
GC_EVENTS_WAIT_S = 0.02
STORE_RECOVERY_INTERVAL_S = 1.0  # after a failed commit, how often to look for free space and reopen LevelDB


class EcqPlugin(BaseTopicPlugin):
    """amqtt broker plugin for exclusive compacted queues.

    Raises (through amqtt's PluginInitError) pydantic.ValidationError for a bad option,
    ecq.queue.store.StoreError when the data directory cannot be opened, ecq.broker.acl.AclError for a bad ACL file.
    """

    # amqtt fills this dataclass from the YAML mapping (and refuses unknown keys); EcqSettings validates it.
    Config = dataclasses.make_dataclass(
        "Config", [(name, Any, dataclasses.field(default=None)) for name in EcqSettings.model_fields])

    def __init__(self, context: BrokerContext) -> None:
        super().__init__(context)
        self._origin = {k: v for k, v in dataclasses.asdict(self.config).items() if v is not None}
        self.settings = EcqSettings(**self._origin)
        self.acl: Acl | None = load_acl(self.settings.acl_file) if self.settings.acl_file else None
        self.store = Store(self.settings.data_dir, sync=self.settings.sync_writes)
        rows, seconds = self.store.verify()
        log.info("ECQ store checked: %d rows read with checksums in %.2f s", rows, seconds)
        self.pool = WriterPool(self.store, self.settings.effective_pool_size(), self._on_commit,
                               on_error=self._commit_failed)
        self.start_error: Exception | None = None  # raised by ecq.broker.amqtt_hooks from Broker.start
        self.consumers: dict[str, Consumer] = {}
        self.events = self._open_events() if self.settings.events else None
        self.metrics = EcqMetrics({
            "ecq_queues": lambda: self._queues,
            "ecq_stored_messages": lambda: self._stored_entries,
            "ecq_stored_bytes": lambda: self._stored_bytes,
            "ecq_inflight": lambda: sum(len(c.inflight) for c in self.consumers.values()),
            "ecq_consumers_online": lambda: sum(1 for c in self.consumers.values() if c.online),
            "ecq_events_dropped": lambda: self.event_stats().get("dropped_items", 0),
        })
        self._queues = self._stored_entries = self._stored_bytes = 0
        self._connections: dict[str, BrokerProtocolHandler] = {}
        self._tasks: list[asyncio.Task] = []
        self._admin: Any = None
        self._closing = False
        self._gc_lock = asyncio.Lock()
        self._session_dropped = 0
        self._traffic = 0  # appends and PUBACKs so far: GC paces itself slower while it grows
        self._reader = BatchedReader(threads=4)
        self._read_deadline = SharedDeadline(self.settings.read_timeout, "ECQ store read")
        self._write_deadline = SharedDeadline(self.settings.write_timeout, "ECQ write commit")
        hooks.install(EcqPlugin)
        hooks.set_session_expiry(context, self.settings.session_expiry)
        log.info("ECQ plugin: data_dir=%s, %d writer agents", self.settings.data_dir, self.settings.effective_pool_size())

    # --- lifecycle ----------------------------------------------------------------------------------

    def _open_events(self):
        from ecq.events import EventRecorder, LakeExporter  # pyarrow is imported only when events are on

        recorder = EventRecorder(self.settings.data_dir / "events", max_buffer_bytes=self.settings.events_max_bytes)
        self._exporter = LakeExporter(recorder, self.settings.effective_lake_dir(),
                                      interval_s=self.settings.export_interval)
        return recorder

    async def on_broker_pre_start(self) -> None:
        """Count what is stored, start the writer agents, GC, heartbeat, event export and the admin API.

        amqtt awaits this before it opens its listeners, so once the MQTT port accepts, ECQ is ready.
        amqtt 0.12.1 runs it in a task and ignores its exception, so a failure (the store cannot be read,
        the admin address is taken) is kept in ``start_error``; ecq.broker.amqtt_hooks raises it from Broker.start.
        """
        try:
            await self._start()
        except Exception as exc:
            self.start_error = exc

    async def _start(self) -> None:
        self._queues = await self.read(self.store.count_queues)
        self._stored_entries, self._stored_bytes = await self.read(self.store.stored_totals)
        self.pool.start()
        self._tasks = [asyncio.create_task(self._every(self.settings.gc_interval, self.run_gc), name="ecq-gc"),
                       asyncio.create_task(self._every(self.settings.heartbeat_interval, self._heartbeat),
                                           name="ecq-heartbeat"),
                       asyncio.create_task(self._every(STORE_RECOVERY_INTERVAL_S, self._recover_store),
                                           name="ecq-store-recovery")]
        if self.events:
            await self._start_events()
        if self.settings.admin_bind:
            host, port = split_host_port(self.settings.admin_bind)
            try:
                self._admin = await admin.serve(self, host, port, self.settings.admin_token_value())
            except OSError as exc:  # another broker's API there would answer `ecq status` for this one
                raise OSError(f"cannot serve the admin API on {self.settings.admin_bind}: {exc.strerror or exc}") from None
            log.info("ECQ admin API on http://%s/ (metrics at /metrics)", self.settings.admin_bind)

    async def on_broker_post_start(self) -> None:
        """Widen the MQTT listeners' accept queue to ``listen_backlog`` once amqtt opened them."""
        changed = hooks.set_listen_backlog(self.context, self.settings.listen_backlog)
        log.info("ECQ: listen backlog %d on %d MQTT listener socket(s)", self.settings.listen_backlog, changed)

    async def _start_events(self) -> None:
        """Start recording and exporting; on failure log it and run without events (writes must not stop)."""
        try:
            await self.events.start()
            await self._exporter.start()
        except Exception as exc:
            log.error("ECQ queue events disabled: cannot start the event buffer or lake export: %s", exc)
            self.events = None

    async def on_broker_pre_shutdown(self) -> None:
        """Stop delivering and end a running GC pass; unacked messages stay stored for the next run."""
        self._closing = True
        for consumer in self.consumers.values():
            consumer.detach()

    async def close(self) -> None:
        """Commit every queued write, flush events, then close LevelDB (amqtt calls this last on shutdown)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._admin:
            await self._admin.cleanup()
        await self._settle_ack_saves()
        await self.pool.close()
        if self.events:
            await self._exporter.close()
            await self.events.close()
        self._reader.shutdown()  # reads still running in threads must end before LevelDB closes
        self.store.close()
        log.info("ECQ plugin: store closed")

    async def _settle_ack_saves(self, timeout_s: float = 5.0) -> None:
        """Wait (at most ``timeout_s``) until every consumer's latest ack state went to the writer pool."""
        deadline = time.monotonic() + timeout_s
        while any(c.saving for c in self.consumers.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    # --- operations (admin API, SIGHUP) -----------------------------------------------------------------

    def options(self, which: str) -> dict[str, Any]:
        """Plugin options: ``origin`` as given in the config, ``inuse`` as parsed (durations in seconds).

        Secrets (``admin_token``) are replaced by ``**********`` in both.
        """
        if which == "origin":
            return {k: REDACTED if k in SECRET_OPTIONS else v for k, v in self._origin.items()}
        return self.settings.model_dump(mode="json")

    def reload_acl(self) -> int:
        """Read the ACL file again; returns its rule count. Raises AclError and keeps the old rules."""
        if not self.settings.acl_file:
            return 0
        self.acl = load_acl(self.settings.acl_file)
        log.info("ECQ ACL reloaded from %s: %d rules", self.settings.acl_file, len(self.acl.rules))
        return len(self.acl.rules)

    async def read(self, func, *args):
        """Run a blocking store read ``func(*args)`` in the plugin's reader threads (drained before the store closes)."""
        return await self._read_soon(func, *args)

    def _read_soon(self, func, *args) -> asyncio.Future:
        """A future of ``func(*args)`` run in a reader thread while the store cannot be reopened under it;
        a StoreReadError (damaged block) is counted as ``ecq_store_errors_total{op="read"}``."""
        future = self._reader.read(self.store.run, func, *args)
        future.add_done_callback(self._count_read_error)
        return future

    def _count_read_error(self, future: asyncio.Future) -> None:
        if not future.cancelled() and isinstance(future.exception(), StoreReadError):
            self.metrics.store_errors.labels("read").inc()

    def _commit_failed(self, _exc: Exception) -> None:
        self.metrics.store_errors.labels("write").inc()

    def health(self) -> dict[str, str]:
        """``{"status": "ok"}``, or ``{"status": "degraded", "reason": ...}`` while commits to the store fail
        (writes get no PUBACK, ack positions are not saved)."""
        if self.store.write_error:
            return {"status": "degraded", "reason": f"store writes fail: {self.store.write_error}"}
        return {"status": "ok"}

    async def _recover_store(self) -> None:
        """After a failed commit, reopen LevelDB once the disk has room again (see Store.reopen_if_space)."""
        reason = self.store.write_error
        if not reason:
            return
        try:
            reopened = await asyncio.get_running_loop().run_in_executor(None, self.store.reopen_if_space)
        except StoreError as exc:
            log.error("ECQ store reopen failed, retrying in %.0f s: %s", STORE_RECOVERY_INTERVAL_S, exc)
            return
        if reopened:
            log.warning("ECQ store reopened after failed writes (%s); writes are accepted again", reason)

    def stored_totals(self) -> tuple[int, int]:
        """(entries, payload bytes) stored, as counted by this broker since start."""
        return self._stored_entries, self._stored_bytes

    def event_stats(self) -> dict[str, Any]:
        """The event recorder's counters (empty when events are off)."""
        return self.events.stats() if self.events else {}

    @staticmethod
    async def _every(interval_s: float, job) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await job()
            except Exception:
                log.exception("ECQ periodic %s failed", job.__name__)

    # --- writes ---------------------------------------------------------------------------------------

    async def handle_ecq_publish(self, handler: BrokerProtocolHandler, packet: PublishPacket) -> None:
        """Take a PUBLISH under ``$ECQ/``: store a valid write, then acknowledge it; refuse the rest.

        A refused PUBLISH is logged with its reason and still acknowledged at its QoS, so the publisher
        stays connected (MQTT 3.1.1 has no negative PUBACK). A write that cannot be stored within
        ``write_timeout`` is not acknowledged; the publisher's connection is closed so it sends it again.
        """
        topic, payload = packet.topic_name, bytes(packet.data)
        qos, packet_id = packet.qos, packet.packet_id
        received = time.monotonic()
        try:
            write = parse_write(topic, len(payload), self.settings.max_payload_bytes)
            self._authorize_write(handler.session, topic)
            future = self.pool.submit(write.clientid, Append(write.clientid, write.key, payload, now_ms()))
        except BadWrite as exc:
            self._refuse(handler, topic, exc)
            await hooks.acknowledge(handler, qos, packet_id)
            return
        except PoolClosed:
            log.warning("ECQ write to %r not taken: broker is shutting down", topic)
            return
        try:
            await self._write_deadline.watch(future)
            self.metrics.append_latency.observe(time.monotonic() - received)
        except Exception as exc:
            log.error("ECQ write to %r failed (%s); closing publisher %s so it resends",
                      topic, exc or type(exc).__name__, hooks.client_id(handler))
            await hooks.close_connection(handler)
            return
        try:
            await hooks.acknowledge(handler, qos, packet_id)
        except (OSError, AMQTTError, TimeoutError) as exc:  # stored; the publisher resends if it reconnects
            log.info("ECQ could not acknowledge a stored write to %r: %s", topic, exc or type(exc).__name__)

    def _authorize_write(self, session: Session, topic: str) -> None:
        if not self._acl_allows(session, "publish", topic):
            raise BadWrite("acl_denied", f"refused write to {topic!r}: denied by the ACL")

    def _refuse(self, handler: BrokerProtocolHandler, topic: str, exc: BadWrite) -> None:
        self.metrics.writes_refused.labels(exc.reason).inc()
        log.warning("ECQ %s (publisher %s, reason %s)", exc, hooks.client_id(handler), exc.reason)
        clientid = parse_target(topic)
        self._event("refused", clientid=clientid, reason=exc.reason, topic=topic)

    def _on_commit(self, ops: Sequence[Op], results: Sequence[object]) -> None:
        for op, result in zip(ops, results, strict=True):
            if isinstance(op, Append):
                self._appended(op, result)
            elif isinstance(op, Expire):
                self._expired(op, result)

    def _appended(self, op: Append, result: Appended) -> None:
        size = len(op.payload)
        self.metrics.writes_accepted.inc()
        self.metrics.compactions.inc(len(result.replaced))
        self._queues += result.seqno == 1
        self._traffic += 1
        self._stored_entries += 1 - len(result.replaced)
        self._stored_bytes += size - result.replaced_bytes
        self._event("appended", clientid=op.clientid, key=op.key, seqno=result.seqno, publish_ts_ms=op.ts_ms,
                    payload_bytes=size)
        for old in result.replaced:
            self._event("compacted", clientid=op.clientid, key=op.key, seqno=result.seqno, publish_ts_ms=op.ts_ms,
                        replaced_seqno=old)
        if (consumer := self.consumers.get(op.clientid)) and consumer.online:
            consumer.appended(result.seqno, result.replaced)

    def _expired(self, op: Expire, deleted: tuple[ExpiredRow, ...]) -> None:
        self.metrics.gc_deleted.inc(len(deleted))
        self._stored_entries -= len(deleted)
        self._stored_bytes -= sum(row.size for row in deleted)
        if self.events:  # one event per row; GC makes them by the million, so without _event's per-call overhead
            record, ts_ms, clientid = self.events.record, now_ms(), op.clientid
            for seqno, key, publish_ts_ms, size in deleted:
                record("expired", ts_ms=ts_ms, clientid=clientid, key=key, seqno=seqno, publish_ts_ms=publish_ts_ms,
                       payload_bytes=size)

    def _event(self, event_type: str, **fields: Any) -> None:
        if self.events:
            self.events.record(event_type, ts_ms=now_ms(), **fields)

    # --- delivery observer (ecq.queue.delivery.DeliveryObserver) ---------------------------------------------

    def delivered(self, clientid: str, message: Message, attempt: int) -> None:
        """Count a send and record a ``delivered`` event."""
        (self.metrics.deliveries if attempt == 1 else self.metrics.redeliveries).inc()
        self._event("delivered", clientid=clientid, key=message.key, seqno=message.seqno,
                    publish_ts_ms=message.ts_ms, payload_bytes=len(message.payload), attempt=attempt)

    def acked(self, clientid: str, message: Message, sent_monotonic: float) -> None:
        """Count a PUBACK, observe its round trip and record an ``acked`` event."""
        self.metrics.acks.inc()
        self._traffic += 1
        self.metrics.delivery_latency.observe(time.monotonic() - sent_monotonic)
        self._event("acked", clientid=clientid, key=message.key, seqno=message.seqno, publish_ts_ms=message.ts_ms,
                    payload_bytes=len(message.payload))

    def session_message_dropped(self, clientid: str, topic: str, reason: str) -> None:
        """Count a message of an ordinary topic dropped from ``clientid``'s persistent session because a bound
        was reached (``reason``: ``queue_full`` or ``inflight_full``); logs the 1st, 2nd, 4th, 8th... drop."""
        self.metrics.session_dropped.labels(reason).inc()
        self._session_dropped += 1
        if self._session_dropped & (self._session_dropped - 1) == 0:
            log.warning("ECQ dropped a message to %r for session %s (%s; %d dropped since start)",
                        topic, clientid, reason, self._session_dropped)

    # --- subscriptions and connections --------------------------------------------------------------

    def grant_subscription(self, clientid: str, topic_filter: str, qos: int) -> int | None:
        """QoS to grant for a SUBSCRIBE to an ``$ECQ/`` filter, or None to refuse it (SUBACK 0x80).

        Only ``<clientid>`` may subscribe to ``$ECQ/<clientid>/#``; QoS 0 is refused, QoS 2 is granted as
        QoS 1 (SPEC.md section 1, "Access control"; MQTT 3.1.1 section 3.9.3).
        """
        if topic_filter != queue_filter(clientid):
            log.warning("ECQ refused SUBSCRIBE of %s to %r: a client may only read its own queue %r",
                        clientid, topic_filter, queue_filter(clientid))
            return None
        if qos == 0:
            log.warning("ECQ refused QoS 0 SUBSCRIBE of %s to %r: ECQ queues are read at QoS 1", clientid, topic_filter)
            return None
        return 1

    def will_refusal(self, session: Session) -> str | None:
        """Why a CONNECT carrying a Will must be refused (CONNACK 0x05), or None to accept it.

        Nothing may reach ``$ECQ/<clientid>/...`` except ECQ's delivery, so a Will topic under ``$ECQ/`` is
        always refused; any other Will topic must be allowed for publish by the ACL, checked with the
        CONNECT's clientid, username and address (EMQX checks the Will when it is published; ECQ refuses at
        CONNECT, so the client learns of it). The refusal is logged with the reason.
        """
        topic = session.will_topic or ""
        if is_ecq_topic(topic):
            reason = f"Will topic {topic!r} is under $ECQ/, where only ECQ delivers"
        elif not self._acl_allows(session, "publish", topic):
            reason = f"Will topic {topic!r} is denied for publish by the ACL"
        else:
            return None
        log.warning("ECQ refused CONNECT of %r from %s: %s", session.client_id, session.remote_address, reason)
        return reason

    async def topic_filtering(self, *, session: Session | None = None, topic: str | None = None,
                              action: Action | None = None) -> bool:
        """amqtt's topic filter hook: apply the ACL file to PUBLISH and SUBSCRIBE (RECEIVE is not filtered).

        A denied PUBLISH is dropped by amqtt with the publisher kept; a denied SUBSCRIBE gets SUBACK 0x80.
        """
        if session is None or topic is None or action not in (Action.PUBLISH, Action.SUBSCRIBE):
            return True
        return self._acl_allows(session, action.value, topic)

    def _acl_allows(self, session: Session, action: str, topic: str) -> bool:
        if self.acl is None:
            return True
        client = ClientInfo(session.client_id or "", session.username, session.remote_address)
        rule = self.acl.first_match(client, action, topic)
        if rule is None:
            return self.settings.acl_nomatch == "allow"
        if rule.permission is Decision.DENY:
            log.info("ECQ ACL: %s of %s to %r denied by %s", action, client.clientid, topic, rule.location)
        return rule.permission is Decision.ALLOW

    async def on_broker_client_connected(self, client_id: str, client_session: Session) -> None:
        """Enforce takeover (MQTT 3.1.1 section 3.1.4) and resume a persistent session's queue.

        A persistent session keeps its ``$ECQ/<clientid>/#`` subscription across disconnects (until
        ``session_expiry``; see ``amqtt_hooks._keep_persistent_sessions``), so its reconnect resumes delivery
        (SPEC.md section 1, Delivery; MQTT 3.1.1 section 3.1.2.4). A clean session has none.
        """
        live = hooks.live_connection(self.context, client_id)
        previous = self._connections.get(client_id)
        if previous is not None and previous is not live and hooks.connection_is_open(previous):
            log.info("ECQ takeover: closing the older connection of %s", client_id)
            await hooks.close_connection(previous)
        if live is not None:
            self._connections[client_id] = live
        if self._holds_queue_subscription(client_id):
            await self._attach(client_id, live)
        elif (consumer := self.consumers.get(client_id)) and consumer.connection is not live:
            consumer.detach()

    async def on_broker_client_subscribed(self, client_id: str, topic: str, qos: int) -> None:
        """Start delivering once the SUBACK for ``$ECQ/<clientid>/#`` went out."""
        if topic == queue_filter(client_id):
            await self._attach(client_id, hooks.live_connection(self.context, client_id))

    async def on_broker_client_unsubscribed(self, client_id: str, topic: str) -> None:
        """Stop delivering when the consumer unsubscribes from its queue."""
        if topic == queue_filter(client_id):
            if consumer := self.consumers.get(client_id):
                consumer.detach()

    async def on_broker_client_disconnected(self, client_id: str, client_session: Session) -> None:
        """Detach a consumer whose connection closed; a newer connection (takeover) keeps or gets it."""
        if self._connections.get(client_id) is not None and not hooks.connection_is_open(self._connections[client_id]):
            del self._connections[client_id]
        consumer = self.consumers.get(client_id)
        if consumer is None or hooks.connection_is_open(consumer.connection):
            return
        consumer.detach()
        live = hooks.live_connection(self.context, client_id)
        if hooks.connection_is_open(live) and self._holds_queue_subscription(client_id):
            await self._attach(client_id, live)

    def _holds_queue_subscription(self, clientid: str) -> bool:
        holders = self.context.subscriptions.get(queue_filter(clientid), [])
        return any(session.client_id == clientid for session, _qos in holders)

    async def _attach(self, clientid: str, connection: BrokerProtocolHandler | None) -> None:
        if self._closing:
            return
        if clientid not in self.consumers:
            state = await self.read(self.store.ack_state, clientid)
            self.consumers.setdefault(clientid, Consumer(
                clientid, state, store=self.store, pool=self.pool, publish=hooks.publish_qos1, observer=self,
                read=self._read_soon,
                window=self.settings.reader_batch_size, read_deadline=self._read_deadline,
                retention_s=self.settings.data_retention))
        # checked after the await: an UNSUBSCRIBE, disconnect, takeover or shutdown may have happened meanwhile
        if (not self._closing and hooks.connection_is_open(connection) and connection is hooks.live_connection(self.context, clientid)
                and self._holds_queue_subscription(clientid)):
            self.consumers[clientid].attach(connection)

    async def _heartbeat(self) -> None:
        """Re-poll idle online consumers that may have unread appends (a lost wake-up delays, never loses)
        and forget idle offline ones. Waking every idle consumer cost one store read each: with 1,000
        consumers that stalled delivery for ~400 ms every heartbeat (issue 5, latency)."""
        for clientid, consumer in list(self.consumers.items()):
            if consumer.online and not consumer.inflight and consumer.behind:
                consumer.wake()
            elif not consumer.online and not consumer.saving and not consumer.attempts:
                del self.consumers[clientid]

    # --- garbage collection ---------------------------------------------------------------------------

    async def run_gc(self) -> int:
        """Delete every entry published more than ``data_retention`` ago (SPEC.md section 1, GC).

        Returns the number of entries deleted. It goes through the index table in steps: each step is
        read in a reader thread, then deleted through the writer agents of the queues it touched
        (serialized with their appends), and records one ``expired`` event per deleted row. GC is
        throttled so that delivery keeps its latency (issue 5): see :class:`GcPacer`. A pass that is
        asked for while one runs starts after it; a broker shutdown ends the pass.
        """
        async with self._gc_lock:
            self.metrics.gc_runs.inc()
            cutoff_ms = now_ms() - int(self.settings.data_retention * 1000)
            pacer = GcPacer()
            deleted, cursor = 0, None
            while not self._closing:
                started = time.monotonic()
                found, cursor = await self.read(self.store.expired_step, cutoff_ms, pacer.rows, cursor)
                deletions = [self.pool.submit(cid, Expire(cid, tuple(rows))) for cid, rows in found.items()]
                deleted += sum(map(len, await asyncio.gather(*deletions)))
                if cursor is None:
                    break
                pacer.note_traffic(self._traffic, time.monotonic())
                await asyncio.sleep(pacer.pause_after(time.monotonic() - started))
                await self._events_caught_up()
            if deleted:
                log.info("ECQ GC deleted %d entries published before %d ms", deleted, cutoff_ms)
            return deleted

    async def _events_caught_up(self) -> None:
        """Wait (while the broker runs) until the event recorder has buffered the events GC made so far.

        One ``expired`` event per deleted row must reach the event buffer: GC may not outrun the
        recorder's in-memory deque (it drops its oldest events beyond ``max_pending``) nor fill the
        ReplayQ past half its bound, and the recorder's thread shares the GIL with delivery.
        """
        while self.events and not self._closing:
            stats = self.events.stats()
            if (stats["pending_items"] <= GC_EVENTS_PENDING
                    and stats["buffered_bytes"] <= self.settings.events_max_bytes // 2):
                return
            await asyncio.sleep(GC_EVENTS_WAIT_S)


class GcPacer:
    """How big a GC step is and how long GC pauses after it (issue 5: GC must not starve delivery).

    The event loop is single-threaded and the reader, writer and event threads share the GIL with it,
    so GC work delays every delivery that is due meanwhile. Two controls:

    * Step size: each step's wall time (read in a thread, delete through the writer agents, record
      the events on the loop) is kept near ``target_s`` by halving or doubling the rows per step
      (``min_rows`` .. ``max_rows``), so one step holds up a delivery for a few ms at most. On a busy
      broker steps take longer (they wait behind traffic) and shrink.
    * Duty cycle: after a step GC pauses ``(1 - duty) / duty`` times as long as the step took (at most
      ``max_pause_s``, so a shutdown never waits long). ``duty`` is ``min_duty`` while the broker has
      traffic (appends or PUBACKs within the last ``quiet_s``) and ``max_duty`` while it has none.
    """

    def __init__(self, target_s: float = 0.005, min_duty: float = 0.1, max_duty: float = 0.5, quiet_s: float = 1.0,
                 min_rows: int = 16, max_rows: int = 512, max_pause_s: float = 0.5) -> None:
        self.rows = min_rows
        self.duty = max_duty
        self._target_s, self._min_duty, self._max_duty, self._quiet_s = target_s, min_duty, max_duty, quiet_s
        self._min_rows, self._max_rows, self._max_pause_s = min_rows, max_rows, max_pause_s
        self._traffic: int | None = None
        self._traffic_at = float("-inf")

    def note_traffic(self, count: int, now: float) -> None:
        """``count``: the broker's appends and PUBACKs so far; ``now``: time.monotonic(). Sets ``duty``."""
        if self._traffic is not None and count != self._traffic:
            self._traffic_at = now
        self._traffic = count
        self.duty = self._min_duty if now - self._traffic_at < self._quiet_s else self._max_duty

    def pause_after(self, busy_s: float) -> float:
        """Seconds to pause after a step that took ``busy_s``; adapts the next step's rows."""
        if busy_s > self._target_s:
            self.rows = max(self._min_rows, self.rows // 2)
        elif busy_s < self._target_s / 2:
            self.rows = min(self._max_rows, self.rows * 2)
        return min(self._max_pause_s, busy_s * (1 - self.duty) / self.duty)
