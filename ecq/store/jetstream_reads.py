"""The read side of :class:`ecq.store.jetstream.JetStreamStore`: queue reads, ack states and the scans of GC,
status and start-up, over the layout described in ecq/store/jetstream.py.

A queue read is one batched direct get (``$JS.API.DIRECT.GET``, answered by a current replica: with every
NATS server holding a replica, the one the node is connected to). A replica may not yet hold what the
stream leader just stored, so an answer can end short of an entry the reader was told exists (``known_last``,
from an append notice): only then are the missing entries taken from the stream leader, one
``STREAM.MSG.GET`` each (usually the one entry just appended). A read that does not know where the queue
ends (after an attach, a reconnect) confirms a short answer with the leader once. A full answer, or one that
reaches ``known_last``, costs one request: no leader round trip per read, none per message.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from ecq.config import EcqSettings
from ecq.store.jsapi import JetStreamApi, index_entry_of, message_of, stored_message_of, until, untoken
from ecq.store.protocol import AckState, ExpiredRow, IndexEntry, Message, StoreError, stored_pages

SCAN_PAGE = 256              # entries per direct get of stored_entries

Blocking = Callable[[Coroutine[Any, Any, Any], float], Any]   # run a coroutine on the link's loop, wait for it


class JetStreamReads:
    """Reads of the JetStream store. ``shard(clientid)``, ``stream(shard)``, ``queue_subject(clientid, key=None)``
    and ``ack_subject(clientid)`` are the store's layout; ``call(coro, timeout)`` runs a coroutine on the
    link's loop and raises TimeoutError when NATS does not answer in time. Blocking methods must not run on
    the link's loop; the ``_``-prefixed coroutines run on it."""

    def __init__(self, settings: EcqSettings, js: JetStreamApi, call: Blocking, shard: Callable[[str], int],
                 stream: Callable[[int], str], queue_subject: Callable[..., str],
                 ack_subject: Callable[[str], str]) -> None:
        self._settings, self._js, self._call = settings, js, call
        self._ns, self._shards = settings.jetstream_namespace, settings.jetstream_shards
        self._shard, self._stream, self._queue_subject, self._ack_subject = shard, stream, queue_subject, ack_subject

    # --- delivery's reads -----------------------------------------------------------------------------

    def read_after(self, clientid: str, after: int, limit: int, min_ts_ms: int = 0,
                   known_last: int | None = None, lapsed_at_ms: int = 0) -> list[Message]:
        """Up to ``limit`` entries of ``clientid`` with seqno > ``after``, in seqno order (QueueStore): either
        ``limit`` entries or every entry up to ``known_last`` (None: up to the leader's end of the queue)."""
        return self._call(self.read_after_async(clientid, after, limit, min_ts_ms, known_last, lapsed_at_ms),
                          self._settings.read_timeout)

    async def read_after_async(self, clientid: str, after: int, limit: int, min_ts_ms: int = 0,
                               known_last: int | None = None, lapsed_at_ms: int = 0) -> list[Message]:
        """:meth:`read_after` on the link's loop. Expired entries (before ``min_ts_ms``, or expiring at or before
        ``lapsed_at_ms`` when not 0; not yet collected) are skipped and the read goes on past them, so a short
        answer still means the end of the queue."""
        stream, subject = self._stream(self._shard(clientid)), self._queue_subject(clientid)
        live: list[Message] = []
        while len(live) < limit:
            wanted = limit - len(live)
            stored = await self._stored_after(stream, subject, after, wanted, known_last)
            live += [m for m in stored if m.ts_ms >= min_ts_ms and not m.lapsed(lapsed_at_ms)]
            if len(stored) < wanted:
                break
            after = stored[-1].seqno
        return live

    async def _stored_after(self, stream: str, subject: str, after: int, limit: int,
                            known_last: int | None) -> list[Message]:
        """Up to ``limit`` stored entries after ``after``: one direct get, and the leader for what it lacks."""
        messages = [message_of(reply) for reply in await self._js.direct(
            stream, {"seq": after + 1, "next_by_subj": subject, "batch": limit})]
        if len(messages) < limit:
            last = messages[-1].seqno if messages else after
            if known_last is None or known_last > last:  # the replica may lag the leader
                messages += await self._from_leader(stream, subject, last, limit - len(messages), known_last)
        return messages

    async def _from_leader(self, stream: str, subject: str, after: int, limit: int,
                           known_last: int | None) -> list[Message]:
        """Up to ``limit`` entries after ``after`` that the replica did not answer, from the stream leader, one
        request each, until ``known_last`` (None: first asks the leader for the queue's last seqno). Entries up
        to ``known_last`` may have been deleted meanwhile: the leader's answer is the last word."""
        if known_last is None:
            answer = await self._js.api(f"STREAM.MSG.GET.{stream}", {"last_by_subj": subject})
            known_last = answer["message"]["seq"] if "message" in answer else 0
        found: list[Message] = []
        while len(found) < limit and known_last > after:
            answer = await self._js.api(f"STREAM.MSG.GET.{stream}", {"seq": after + 1, "next_by_subj": subject})
            if "message" not in answer:
                break
            found.append(stored_message_of(answer["message"]))
            after = found[-1].seqno
        return found

    def ack_state(self, clientid: str) -> AckState:
        """The saved progress of ``clientid``'s consumer, read from the leader of the acks stream."""
        return self._call(self.ack_state_async(clientid), self._settings.read_timeout)

    async def ack_state_async(self, clientid: str) -> AckState:
        """:meth:`ack_state` on the link's loop."""
        request = {"last_by_subj": self._ack_subject(clientid)}
        answer = await until(time.monotonic() + self._settings.read_timeout - 0.2,
                             lambda: self._js.api(f"STREAM.MSG.GET.{self._ns}_ACKS", request))
        if "message" not in answer:
            if answer.get("error", {}).get("code") == 404:
                return AckState()
            raise StoreError(f"reading the ack state of {clientid}: {answer.get('error')}")
        body = json.loads(base64.b64decode(answer["message"]["data"]))
        return AckState(body["acked"], body["last_ack_ms"], {s for s in body["above"] if s > body["acked"]})

    def ack_states(self) -> Iterator[tuple[str, AckState]]:
        """Every saved consumer state as (clientid, state), in clientid order."""
        subjects = self._call(self._js.subjects(f"{self._ns}_ACKS", f"{self._ns}.ack.>"), self._settings.read_timeout)
        for clientid in sorted(untoken(subject.rsplit(".", 1)[1]) for subject in subjects):
            yield clientid, self.ack_state(clientid)

    # --- GC, status, start-up -------------------------------------------------------------------------

    async def holds_entries(self, clientid: str) -> bool:
        """True when the stream leader holds an entry of ``clientid`` (on the link's loop)."""
        answer = await self._js.api(f"STREAM.MSG.GET.{self._stream(self._shard(clientid))}",
                                    {"last_by_subj": self._queue_subject(clientid)})
        return "message" in answer

    def expired_step(self, cutoff_ms: int, limit: int, start: bytes | None = None
                     ) -> tuple[dict[str, list[ExpiredRow]], bytes | None]:
        """One GC step over the shards in order: up to ``limit`` entries published before ``cutoff_ms``.
        ``start`` is ``b"<shard>:<seqno>"``."""
        shard, seq = map(int, start.split(b":")) if start else (0, 1)
        request = {"seq": seq, "next_by_subj": f"{self._ns}.q.{shard}.>", "batch": limit}
        replies = self._call(self._js.direct(self._stream(shard), request), self._settings.read_timeout)
        found: dict[str, list[ExpiredRow]] = {}
        for reply in replies:
            entry = index_entry_of(reply)
            if entry.ts_ms >= cutoff_ms:  # the stream is in time order: the rest of this shard is fresh
                return found, self._next_shard(shard)
            found.setdefault(entry.clientid, []).append(ExpiredRow(entry.seqno, entry.key, entry.ts_ms,
                                                                   len(reply.data)))
        if len(replies) < limit:
            return found, self._next_shard(shard)
        return found, f"{shard}:{int(replies[-1].headers['Nats-Sequence']) + 1}".encode()

    def _next_shard(self, shard: int) -> bytes | None:
        return f"{shard + 1}:1".encode() if shard + 1 < self._shards else None

    def idle_queues(self, cutoff_ms: int) -> list[str]:
        """Clientids with an ack state saved before ``cutoff_ms`` whose queue stores no entry (state GC's
        candidates; a queue never acked has no state here to forget)."""
        return [clientid for clientid, state in self.ack_states() if state.last_ack_ms < cutoff_ms
                and not self._call(self.holds_entries(clientid), self._settings.read_timeout)]

    def count_queues(self) -> int:
        """How many queues hold entries now (a listing of every stored subject: O(keys))."""
        clientids = set()
        for shard in range(self._shards):
            subjects = self._call(self._js.subjects(self._stream(shard), f"{self._ns}.q.{shard}.>"),
                                  self._settings.read_timeout)
            clientids.update(subject.split(".")[3] for subject in subjects)
        return len(clientids)

    def key_bytes(self, clientid: str, key: str) -> int | None:
        """Payload bytes of the stored value of ``key`` in the queue of ``clientid``, None when none is stored:
        one request to the stream leader."""
        answer = self._call(self._js.api(f"STREAM.MSG.GET.{self._stream(self._shard(clientid))}",
                                         {"last_by_subj": self._queue_subject(clientid, key)}),
                            self._settings.read_timeout)
        if "message" in answer:
            return len(base64.b64decode(answer["message"].get("data") or ""))
        if answer.get("error", {}).get("code") == 404:
            return None
        raise StoreError(f"reading key {key!r} of {clientid}: {answer.get('error')}")

    def last_seqno(self, clientid: str) -> int:
        """Seqno of the newest stored entry of ``clientid``, 0 when it holds none."""
        answer = self._call(self._js.api(f"STREAM.MSG.GET.{self._stream(self._shard(clientid))}",
                                         {"last_by_subj": self._queue_subject(clientid)}), self._settings.read_timeout)
        return answer["message"]["seq"] if "message" in answer else 0

    def seqnos(self, clientid: str) -> Iterator[int]:
        """Seqnos of the stored entries of ``clientid``, ascending."""
        for page in stored_pages(self, clientid, SCAN_PAGE):
            yield from (m.seqno for m in page)

    def queue_range(self, clientid: str) -> tuple[int, int, int] | None:
        """(first seqno, last seqno, entry count) of the stored queue of ``clientid``, or None when empty."""
        seqnos = list(self.seqnos(clientid))
        return (seqnos[0], seqnos[-1], len(seqnos)) if seqnos else None

    def edge_index_entries(self) -> tuple[IndexEntry | None, IndexEntry | None]:
        """The oldest and the newest stored entry across every shard (by publish time)."""
        entries = []
        for shard in range(self._shards):
            stream = self._stream(shard)
            for request in ({"seq": 1, "next_by_subj": f"{self._ns}.q.{shard}.>"},
                            {"last_by_subj": f"{self._ns}.q.{shard}.>"}):
                replies = self._call(self._js.direct(stream, request), self._settings.read_timeout)
                entries.extend(index_entry_of(reply) for reply in replies)
        if not entries:
            return None, None
        return min(entries, key=lambda e: e.ts_ms), max(entries, key=lambda e: e.ts_ms)

    def stored_entries(self, clientid: str | None = None, after: int = 0) -> Iterator[tuple[str, int, int, int]]:
        """(clientid, seqno, publish ms, payload bytes) of every stored entry, shard by shard in stream order (so
        each queue's in seqno order); with ``clientid``, that queue's entries with seqno > ``after``. Direct gets
        answer whole messages: this reads every stored payload, O(stored bytes), in pages of SCAN_PAGE."""
        if clientid is not None:
            while page := self.read_after(clientid, after, SCAN_PAGE):
                yield from ((clientid, m.seqno, m.ts_ms, len(m.payload)) for m in page)
                after = page[-1].seqno
            return
        for shard in range(self._shards):
            seq = 1
            while True:
                request = {"seq": seq, "next_by_subj": f"{self._ns}.q.{shard}.>", "batch": SCAN_PAGE}
                replies = self._call(self._js.direct(self._stream(shard), request), self._settings.read_timeout)
                for reply in replies:
                    entry = index_entry_of(reply)
                    yield entry.clientid, entry.seqno, entry.ts_ms, len(reply.data)
                if len(replies) < SCAN_PAGE:
                    break
                seq = int(replies[-1].headers["Nats-Sequence"]) + 1
