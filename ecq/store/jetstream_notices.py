"""What every broker of a cluster hears of the JetStream streams: append, ack-state and deletion notices.

Each shard stream republishes every message it stores, payload and headers, on ``NS.appended.<shard>.>``
(JetStream's RePublish: ``Nats-Subject``, ``Nats-Sequence``, ``Nats-Time-Stamp`` and ``Nats-Last-Sequence``,
which nats-server 2.15.1 sets to the subject's previous sequence, 0 for a new subject, i.e. the value this one
replaced; beside them the publisher's own ``Nats-Msg-Id`` and ``Ecq-Ts``), in sequence order from the stream
leader. Every message of a shard stream is an entry, so a shard's notices carry consecutive sequences; the acks stream
republishes every saved ack state on ``NS.acked.>``; a broker that deleted entries (GC, purge, an acked
tombstone) says so on ``NS.deleted.<shard>`` (core NATS). :class:`ShardWatch` keeps, per shard, a map of every
stored subject to (seqno, payload bytes), built by one read of the shard at start: with it each notice tells
which value it replaced and its payload bytes (compaction) without a lookup before the write. A measured 2.15.1 fact: a republished
message keeps its ``Nats-Msg-Id``, so a broker knows its own writes by the prefix of their ids.

Lost notices (a reconnect, a slow subscriber) are found two ways: a notice whose sequence does not follow the
last one heard from its shard, and a check every CHECK_INTERVAL_S of each shard's last sequence and
message count (stream info, one small request per shard) against the map, which also catches a lost deletion.
Either re-reads that one shard and tells the listener which queues changed. Nothing else is polled: an idle
cluster costs one stream info per shard per interval.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from ecq.store.jsapi import (EXPIRES_HEADER, TS_HEADER, JetStreamApi, message_of, queue_subject_parts, stream_ms,
                             untoken)
from ecq.store.link import NatsLink
from ecq.store.protocol import AckState, Append, Appended, AppendNotice, ExpiredRow, StoreListener

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 5.0  # how often each shard's last sequence and message count are compared with the map
SCAN_PAGE = 256         # entries per direct get when a shard is read


class ShardWatch:
    """The notices of namespace ``ns`` with ``shards`` shard streams named by ``stream(shard)``, told to
    ``listener``; ``subject(clientid, key)`` is an entry's subject; ``own_prefix`` starts the Nats-Msg-Id of
    every publish of this broker. Runs on ``link``'s loop.

    ``entries[shard]`` maps each stored subject to (seqno, payload bytes): about 215 bytes of memory per stored
    entry with 45-character subjects (tracemalloc, docs/cluster.md). ``expiring[shard]`` maps the subject of each
    entry heard of with an expiry time of its own (``Ecq-Expires``) to (seqno, publish ms, expiry ms), for GC
    (:meth:`lapsed`); one that ``entries`` no longer holds at that seqno is dropped when GC looks at it.
    """

    def __init__(self, link: NatsLink, api: JetStreamApi, ns: str, shards: int, stream: Callable[[int], str],
                 subject: Callable[[str, str], str], own_prefix: str, listener: StoreListener) -> None:
        self._link, self._js, self._ns, self._stream, self._subject = link, api, ns, stream, subject
        self._own, self._listener = own_prefix, listener
        self.entries: list[dict[str, tuple[int, int]]] = [{} for _ in range(shards)]
        self.expiring: list[dict[str, tuple[int, int, int]]] = [{} for _ in range(shards)]
        self._last = [0] * shards                      # the last sequence heard of each shard
        self._syncing: dict[int, list[tuple[str, int, int]]] = {}  # shard -> (subject, seqno, size) heard meanwhile
        self._suspect: dict[int, tuple[int, int]] = {}  # shard -> (last seq, count) a check found off the map
        self._batch: list[AppendNotice] = []
        self._subs: list[Any] = []
        self._checker: asyncio.Task | None = None

    async def start(self) -> None:
        """Subscribe, then read every shard into the map (notices heard meanwhile are applied on top), then
        check the shards every CHECK_INTERVAL_S."""
        nc = self._link.nc
        self._subs = [await nc.subscribe(f"{self._ns}.appended.>", cb=self._appended),
                      await nc.subscribe(f"{self._ns}.acked.>", cb=self._acked),
                      await nc.subscribe(f"{self._ns}.deleted.>", cb=self._deleted)]
        for shard in range(len(self.entries)):
            await self.resync(shard, tell=False)
        self._checker = asyncio.get_running_loop().create_task(self._check_every(), name="ecq-shard-check")

    async def stop(self) -> None:
        """Stop checking and listening."""
        if self._checker:
            self._checker.cancel()
        for sub in self._subs:
            await sub.unsubscribe()

    def queues(self) -> int:
        """How many queues hold entries, from the map."""
        return len({subject.split(".")[3] for shard in self.entries for subject in shard})

    def totals(self) -> tuple[int, int]:
        """(entries, payload bytes) stored, from the map."""
        return (sum(map(len, self.entries)),
                sum(size for shard in self.entries for _seqno, size in shard.values()))

    # --- appends ------------------------------------------------------------------------------------

    async def _appended(self, msg: Any) -> None:
        try:
            notice = self._notice(msg)
        except (KeyError, ValueError, IndexError) as exc:
            log.warning("ECQ: ignored a malformed append notice on %s: %s", msg.subject, exc)
            return
        if notice is None:
            return
        if not self._batch:  # one hand-over to the broker's loop per burst of notices
            asyncio.get_running_loop().call_soon(self._flush)
        self._batch.append(notice)

    def _notice(self, msg: Any) -> AppendNotice | None:
        headers = msg.headers
        shard = int(msg.subject.split(".")[2])
        seqno, replaced = int(headers["Nats-Sequence"]), int(headers["Nats-Last-Sequence"])
        if seqno <= self._last[shard]:
            return None  # already read by a resync
        in_order = seqno == self._last[shard] + 1 and shard not in self._syncing
        if seqno > self._last[shard] + 1:
            log.info("ECQ: append notices %d-%d of shard %d were lost; reading the shard again",
                     self._last[shard] + 1, seqno - 1, shard)
            self._link.loop.create_task(self._resync_logged(shard), name=f"ecq-resync-{shard}")
        self._last[shard] = seqno
        subject, size = headers["Nats-Subject"], len(msg.data)
        old = self.entries[shard].get(subject)
        self.entries[shard][subject] = (seqno, size)
        if (heard := self._syncing.get(shard)) is not None:
            heard.append((subject, seqno, size))
        clientid, key = queue_subject_parts(subject)
        ts_ms = int(headers[TS_HEADER]) if TS_HEADER in headers else stream_ms(headers["Nats-Time-Stamp"])
        expires_ms = int(headers.get(EXPIRES_HEADER, 0))
        if expires_ms:
            self.expiring[shard][subject] = (seqno, ts_ms, expires_ms)
        result = Appended(seqno)
        if replaced and old:  # not when GC deleted it first; 0 bytes when the map missed it (a lost notice)
            result = Appended(seqno, (replaced,), old[1] if old[0] == replaced else 0)
        own = headers.get("Nats-Msg-Id", "").startswith(self._own)
        return AppendNotice(Append(clientid, key, msg.data, ts_ms, expires_ms), result, own, in_order)

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        self._listener.appended(batch)

    # --- acks and deletions -------------------------------------------------------------------------

    async def _acked(self, msg: Any) -> None:
        if not msg.headers or msg.headers.get("Nats-Msg-Id", "").startswith(self._own):
            return
        try:
            clientid = untoken(msg.headers["Nats-Subject"].rsplit(".", 1)[1])
            body = json.loads(msg.data)
            state = AckState(body["acked"], body["last_ack_ms"], {s for s in body["above"] if s > body["acked"]})
        except (KeyError, ValueError, TypeError) as exc:
            log.warning("ECQ: ignored a malformed ack-state notice on %s: %s", msg.subject, exc)
            return
        self._listener.ack_saved(clientid, state)

    def deletion_notice(self, clientid: str, shard: int, rows: tuple[ExpiredRow, ...],
                        reason: str) -> tuple[str, bytes]:
        """This broker deleted ``rows`` of ``clientid`` (in ``shard``): drop them from the map; returns the
        (subject, body) of the notice to publish to the other brokers."""
        self._forget_rows(shard, clientid, rows)
        body = {"node": self._own, "clientid": clientid, "reason": reason, "rows": [list(row) for row in rows]}
        return f"{self._ns}.deleted.{shard}", json.dumps(body).encode()

    async def _deleted(self, msg: Any) -> None:
        try:
            body = json.loads(msg.data)
            if body["node"] == self._own:
                return
            shard = int(msg.subject.rsplit(".", 1)[1])
            rows = tuple(ExpiredRow(int(s), str(k), int(t), int(n)) for s, k, t, n in body["rows"])
            clientid, reason = str(body["clientid"]), str(body["reason"])
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            log.warning("ECQ: ignored a malformed deletion notice on %s: %s", msg.subject, exc)
            return
        self._forget_rows(shard, clientid, rows)
        self._listener.deleted(clientid, rows, reason)

    def _forget_rows(self, shard: int, clientid: str, rows: tuple[ExpiredRow, ...]) -> None:
        entries = self.entries[shard]
        for row in rows:
            subject = self._subject(clientid, row.key)
            if entries.get(subject, (0, 0))[0] == row.seqno:
                del entries[subject]

    def lapsed(self, now_ms: int, limit: int, shard: int, seq: int) -> tuple[dict[str, list[ExpiredRow]], int | None]:
        """Up to ``limit`` stored entries of ``shard`` with seqno >= ``seq`` whose own expiry time is at or before
        ``now_ms``, by clientid, from ``expiring`` (which this drops the entries no longer stored from); and the
        seqno the next call for the shard starts from, None once the whole shard was looked at. Call on the
        link's loop."""
        found: dict[str, list[ExpiredRow]] = {}
        taken = 0
        entries, expiring = self.entries[shard], self.expiring[shard]
        for subject, (seqno, ts_ms, expires_ms) in sorted(expiring.items(), key=lambda item: item[1][0]):
            stored = entries.get(subject)
            if stored is None or stored[0] != seqno:
                del expiring[subject]  # replaced by a newer write, or deleted
            elif seqno >= seq and expires_ms <= now_ms:
                if taken >= limit:
                    return found, seqno
                clientid, key = queue_subject_parts(subject)
                found.setdefault(clientid, []).append(ExpiredRow(seqno, key, ts_ms, stored[1]))
                taken += 1
        return found, None

    # --- gaps ---------------------------------------------------------------------------------------

    async def resync(self, shard: int, tell: bool = True) -> None:
        """Read ``shard`` again into the map (JetStream direct gets, SCAN_PAGE entries each) and tell the
        listener which queues changed. A resync of the shard already running makes this one a no-op."""
        if shard in self._syncing:
            return
        heard = self._syncing[shard] = []
        try:
            fresh, last = await self._read_shard(shard)
        finally:
            del self._syncing[shard]
        for subject, seqno, size in heard:
            if fresh.get(subject, (0, 0))[0] < seqno:
                fresh[subject] = (seqno, size)
        old, self.entries[shard] = self.entries[shard], fresh
        self._last[shard] = max(self._last[shard], last)
        self._suspect.pop(shard, None)
        if tell:
            changed = {queue_subject_parts(subject)[0] for subject, _ in set(old.items()) ^ set(fresh.items())}
            if changed:
                self._listener.resynced(changed)

    async def _resync_logged(self, shard: int) -> None:
        try:
            await self.resync(shard)
        except Exception as exc:  # NATS away: the shard check finds the difference again and retries
            log.warning("ECQ: shard %d not read again: %s", shard, exc or type(exc).__name__)

    async def _read_shard(self, shard: int) -> tuple[dict[str, tuple[int, int]], int]:
        stream = self._stream(shard)
        info = await self._js.api(f"STREAM.INFO.{stream}", {})
        last = info.get("state", {}).get("last_seq", 0)
        fresh: dict[str, tuple[int, int]] = {}
        seq = 1
        while True:
            request = {"seq": seq, "next_by_subj": f"{self._ns}.q.{shard}.>", "batch": SCAN_PAGE}
            replies = await self._js.direct(stream, request)
            for reply in replies:
                seq = int(reply.headers["Nats-Sequence"])
                fresh[reply.headers["Nats-Subject"]] = (seq, len(reply.data))
                last = max(last, seq)
                if EXPIRES_HEADER in reply.headers:
                    message = message_of(reply)
                    self.expiring[shard][reply.headers["Nats-Subject"]] = (seq, message.ts_ms, message.expires_ms)
            if len(replies) < SCAN_PAGE:
                return fresh, last
            seq += 1

    async def check(self) -> None:
        """Compare each shard's last sequence and message count (stream info) with the map; a shard found off
        twice in a row with the same figures (notices in flight make a single miss normal) is read again."""
        for shard in range(len(self.entries)):
            if shard in self._syncing:
                continue
            info = await self._js.api(f"STREAM.INFO.{self._stream(shard)}", {})
            state = info.get("state")
            if state is None:
                continue
            figures = (state.get("last_seq", 0), state.get("messages", 0))
            if figures == (self._last[shard], len(self.entries[shard])) or figures[0] < self._last[shard]:
                self._suspect.pop(shard, None)
            elif self._suspect.get(shard) == figures:
                log.info("ECQ: shard %d holds %d entries up to seqno %d, this broker heard of %d up to %d; "
                         "reading the shard again", shard, figures[1], figures[0], len(self.entries[shard]),
                         self._last[shard])
                await self.resync(shard)
            else:
                self._suspect[shard] = figures

    async def check_logged(self) -> None:
        """:meth:`check`, logging instead of raising (NATS away: the next round tries again)."""
        try:
            await self.check()
        except Exception as exc:
            log.debug("ECQ shard check failed: %s", exc or type(exc).__name__)

    async def _check_every(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            await self.check_logged()

