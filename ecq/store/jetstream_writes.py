"""The write side of :class:`ecq.store.jetstream.JetStreamStore`: commits of appends, ack states, GC deletions
and state GC, each a JetStream publish or API request on the NATS link's loop.

A write is one publish acked by a quorum of the stream's replicas, and the publishes of one group commit are
all sent before any ack is awaited. What an append replaced (compaction) is not looked up before it: every
broker learns it from the shard stream's notice of the append (ecq.store.jetstream_notices). Publishes carry a
``Nats-Msg-Id`` (this broker's prefix and a counter), kept on every retry until ``write_timeout``, so one
retried after a leader change is stored once (JetStream's duplicate window).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable, Sequence

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from ecq.store.jetstream_publish import BatchPublisher, Publish
from ecq.store.jsapi import EXPIRES_HEADER, REQUEST_TIMEOUT_S, TS_HEADER, JetStreamApi, Retry, stream_ms
from ecq.store.link import NatsLink
from ecq.store.protocol import (Append, Appended, CommitResult, Expire, ExpiredRow, ForgetQueue, Op, SaveAck,
                                StoreError)


class JetStreamWrites:
    """Mixed into JetStreamStore, which provides the link, the API, the settings, the subjects and the shard
    watch (``_watch``, None until :meth:`JetStreamStore.watch`)."""

    _link: NatsLink
    _js: JetStreamApi
    _ns: str
    write_error: str | None
    observe_publish: Callable[[float], None]
    _publisher: BatchPublisher

    # --- writes -------------------------------------------------------------------------------------

    def commits_without_waiting(self) -> bool:
        """Never: every commit waits on the network."""
        return False

    def commit_async(self, ops: Sequence[Op]) -> asyncio.Future:
        """:meth:`commit` on the link's loop, awaited from the caller's loop without a thread in between."""
        return self._link.submit(self._commit_or_raise(ops))

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
        # Every publish of the batch is sent, in order, before any ack is awaited (ecq.store.jetstream_publish).
        # What an append replaced comes later, from its notice (ecq.store.jetstream_notices): the ack waits for
        # nothing else. GC deletions and state GC are API requests, run beside the publishes.
        publishes = [i for i, op in enumerate(ops) if isinstance(op, Append | SaveAck)]
        others = {i: asyncio.ensure_future(self._forget(op) if isinstance(op, ForgetQueue) else self._expire(op))
                  for i, op in enumerate(ops) if not isinstance(op, Append | SaveAck)}
        try:
            acks = await self._publisher.publish([self._message(ops[i]) for i in publishes], deadline)
        finally:
            done = await asyncio.gather(*others.values(), return_exceptions=True)
        results: list[CommitResult] = [None] * len(ops)
        for i, ack in zip(publishes, acks, strict=True):
            results[i] = Appended(ack["seq"]) if isinstance(ops[i], Append) else None
        for i, outcome in zip(others, done, strict=True):
            if isinstance(outcome, BaseException):
                raise outcome
            results[i] = outcome
        return results

    def _message(self, op: Append | SaveAck) -> Publish:
        msg_id = {"Nats-Msg-Id": self._msg_id_prefix + str(next(self._msg_ids))}
        if isinstance(op, Append):
            headers = {TS_HEADER: str(op.ts_ms), **msg_id}
            if op.expires_ms:
                headers[EXPIRES_HEADER] = str(op.expires_ms)
            return Publish(self._queue_subject(op.clientid, op.key), op.payload, headers)
        state = op.state
        above = sorted(seqno for seqno in state.above if seqno > state.acked)
        body = json.dumps({"acked": state.acked, "last_ack_ms": state.last_ack_ms, "above": above})
        return Publish(self._ack_subject(op.clientid), body.encode(), msg_id)

    async def _expire(self, op: Expire) -> tuple[ExpiredRow, ...]:
        stream = self.stream(self.shard(op.clientid))
        answers = await asyncio.gather(*(self._js.api(f"STREAM.MSG.DELETE.{stream}",
                                                      {"seq": row.seqno, "no_erase": True}) for row in op.rows))
        deleted = tuple(row for row, answer in zip(op.rows, answers, strict=True) if answer.get("success"))
        if deleted and self._watch is not None:
            await self._link.nc.publish(*self._watch.deletion_notice(op.clientid, self.shard(op.clientid), deleted,
                                                                     op.reason))
        return deleted

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
