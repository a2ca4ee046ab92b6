"""The ECQ amqtt broker plugin: enable it by listing ``ecq.plugin.EcqPlugin`` under ``plugins:``.

It stores ``$ECQ/w/<clientid>/<key>`` writes in LevelDB with compaction by key, delivers each queue at
QoS 1 to the one client ``<clientid>`` subscribed to ``$ECQ/<clientid>/#``, and garbage-collects
entries older than ``data_retention`` (SPEC.md section 1). Options: :class:`ecq.config.EcqSettings`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from amqtt.broker import BrokerContext
from amqtt.errors import AMQTTError
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.publish import PublishPacket
from amqtt.plugins.base import BasePlugin
from amqtt.session import Session

from ecq import amqtt_hooks as hooks
from ecq.config import EcqSettings
from ecq.delivery import Consumer, now_ms
from ecq.store import Append, Expire, Op, Store
from ecq.topics import BadWrite, parse_write, queue_filter
from ecq.writer import PoolClosed, WriterPool

log = logging.getLogger(__name__)

PLUGIN_PATH = "ecq.plugin.EcqPlugin"
GC_STEP_ROWS = 512


class EcqPlugin(BasePlugin[BrokerContext]):
    """amqtt broker plugin for exclusive compacted queues.

    Raises pydantic.ValidationError (through amqtt's PluginInitError) for a bad option and
    ecq.store.StoreError when the data directory cannot be opened.
    """

    # amqtt fills this dataclass from the YAML mapping (and refuses unknown keys); EcqSettings validates it.
    Config = dataclasses.make_dataclass(
        "Config", [(name, Any, dataclasses.field(default=None)) for name in EcqSettings.model_fields])

    def __init__(self, context: BrokerContext) -> None:
        super().__init__(context)
        given = {k: v for k, v in dataclasses.asdict(self.config).items() if v is not None}
        self.settings = EcqSettings(**given)
        self.store = Store(self.settings.data_dir, sync=self.settings.sync_writes)
        self.pool = WriterPool(self.store, self.settings.effective_pool_size(), self._on_commit)
        self.consumers: dict[str, Consumer] = {}
        self.refused: Counter[str] = Counter()
        self._connections: dict[str, BrokerProtocolHandler] = {}
        self._tasks: list[asyncio.Task] = []
        hooks.install(EcqPlugin)
        log.info("ECQ plugin: data_dir=%s, %d writer agents", self.settings.data_dir, self.settings.effective_pool_size())

    # --- lifecycle ----------------------------------------------------------------------------------

    async def on_broker_post_start(self) -> None:
        """Start the writer agents, the periodic GC and the delivery heartbeat."""
        self.pool.start()
        self._tasks = [asyncio.create_task(self._every(self.settings.gc_interval, self.run_gc), name="ecq-gc"),
                       asyncio.create_task(self._every(self.settings.heartbeat_interval, self._heartbeat),
                                           name="ecq-heartbeat")]

    async def on_broker_pre_shutdown(self) -> None:
        """Stop delivering; unacked messages stay stored for the next run."""
        for consumer in self.consumers.values():
            consumer.detach()

    async def close(self) -> None:
        """Commit every queued write, then close LevelDB (amqtt calls this last on shutdown)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.close()
        self.store.close()
        log.info("ECQ plugin: store closed")

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
        try:
            write = parse_write(topic, len(payload), self.settings.max_payload_bytes)
            future = self.pool.submit(write.clientid, Append(write.clientid, write.key, payload, now_ms()))
        except BadWrite as exc:
            self.refused[exc.reason] += 1
            log.warning("ECQ %s (publisher %s, reason %s)", exc, hooks.client_id(handler), exc.reason)
            await hooks.acknowledge(handler, qos, packet_id)
            return
        except PoolClosed:
            log.warning("ECQ write to %r not taken: broker is shutting down", topic)
            return
        try:
            await asyncio.wait_for(future, self.settings.write_timeout)
        except Exception as exc:
            log.error("ECQ write to %r failed (%s); closing publisher %s so it resends",
                      topic, exc or type(exc).__name__, hooks.client_id(handler))
            await hooks.close_connection(handler)
            return
        try:
            await hooks.acknowledge(handler, qos, packet_id)
        except (OSError, AMQTTError, TimeoutError) as exc:  # stored; the publisher resends if it reconnects
            log.info("ECQ could not acknowledge a stored write to %r: %s", topic, exc or type(exc).__name__)

    def _on_commit(self, ops: Sequence[Op], _results: Sequence[object]) -> None:
        for op in ops:
            if isinstance(op, Append) and (consumer := self.consumers.get(op.clientid)) and consumer.online:
                consumer.wake()

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

    async def on_broker_client_connected(self, client_id: str, client_session: Session) -> None:
        """Enforce takeover (MQTT 3.1.1 section 3.1.4) and resume a persistent session's queue."""
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
        if topic == queue_filter(client_id) and (consumer := self.consumers.get(client_id)):
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
        if clientid not in self.consumers:
            state = await asyncio.get_running_loop().run_in_executor(None, self.store.ack_state, clientid)
            self.consumers.setdefault(clientid, Consumer(
                clientid, state, store=self.store, pool=self.pool, publish=hooks.publish_qos1,
                window=self.settings.reader_batch_size, read_timeout=self.settings.read_timeout,
                retention_s=self.settings.data_retention))
        # checked after the await: an UNSUBSCRIBE, disconnect or takeover may have happened meanwhile
        if (hooks.connection_is_open(connection) and connection is hooks.live_connection(self.context, clientid)
                and self._holds_queue_subscription(clientid)):
            self.consumers[clientid].attach(connection)

    async def _heartbeat(self) -> None:
        """Re-poll idle online consumers (a lost wake-up delays, never loses) and forget idle offline ones."""
        for clientid, consumer in list(self.consumers.items()):
            if consumer.online and not consumer.inflight:
                consumer.wake()
            elif not consumer.online and consumer.saves_pending == 0:
                del self.consumers[clientid]

    # --- garbage collection ---------------------------------------------------------------------------

    async def run_gc(self) -> int:
        """Delete every entry published more than ``data_retention`` ago, client by client, in small steps.

        Returns the number of entries deleted. Each step reads at most 512 rows of one client in a thread
        and deletes them through that client's writer agent, so the broker keeps serving meanwhile.
        """
        loop = asyncio.get_running_loop()
        cutoff_ms = now_ms() - int(self.settings.data_retention * 1000)
        clientids = await loop.run_in_executor(None, lambda: list(self.store.clientids()))
        deleted = 0
        for clientid in clientids:
            while rows := await loop.run_in_executor(None, self.store.expired_rows, clientid, cutoff_ms, GC_STEP_ROWS):
                deleted += await self.pool.submit(clientid, Expire(clientid, rows))
                if len(rows) < GC_STEP_ROWS:
                    break
        if deleted:
            log.info("ECQ GC deleted %d entries published before %d ms", deleted, cutoff_ms)
        return deleted
