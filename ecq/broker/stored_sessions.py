"""Persistent sessions that outlive the broker on the embedded LevelDB store (``backend: leveldb``), restored lazily.

A persistent session (MQTT 3.1.1 CleanSession 0; MQTT 5.0 a Session Expiry Interval above 0) is written to the
store's session tables (``ecq.store.leveldb_sessions``, layout in ``ecq.store.leveldb_tables``): its record (owner,
subscriptions with their v5 options, expiry) at each CONNACK, SUBACK, UNSUBACK and disconnect that changes it (an
unchanged one is not written again), and each QoS 1/2 message of an ordinary topic routed to it, before the
publisher's PUBACK: queued while it is offline (:meth:`queue_message`, at most ``session_max_queued``, the oldest
dropped) or sent while it is connected (:meth:`store_sends`, one write batch per fan-out; a queue taken for sending at
its reconnect keeps its entries, :meth:`take_queue`), each deleted when its client acknowledges it
(:meth:`settle_sends`, ``amqtt_hooks.stored_sends``) or the session ends (clean session, another owner, expiry). So
after a ``kill -9`` its stored queue is what its client has not acknowledged, oldest first (a QoS 2 message whose
PUBREC came is there until its PUBCOMP, and comes again as a new PUBLISH).
At shutdown (SIGTERM) the stored queue of a session with messages not acknowledged becomes those amqtt holds for it
(sent and not acknowledged, then queued), and the packet ids of the QoS 2 PUBRELs it owes join its record
(:meth:`save_at_shutdown`).
ECQ queues need nothing here: their entries and ack positions are the queue store's.

While the broker runs, amqtt does not hold an offline one either: when a persistent session's connection ends (not
a takeover), ``amqtt_hooks.cluster.hand_offline_sessions_to_the_store`` hands it here (:meth:`evict`: its record as
offline, the messages queued for it as its stored queue, its filters indexed) and amqtt forgets it, so that it is
exactly a session stored by an earlier run: about 1 KiB of memory (the index entries and its deadline) instead of
amqtt's Session (4.9 KiB traced, 20-40 KiB of RSS). Kept in amqtt's memory instead, as before: a session whose MQTT 5
Will waits for its delay, and one holding packet ids its reconnect must see again (a send not acknowledged, a
client's QoS 2 PUBLISH not released: MQTT 3.1.1 section 4.4 resends with the same id, which the store does not keep),
and a member of a shared subscription group (its group's messages go to it while no member is connected).
A cluster (``backend: jetstream``) keeps every offline session in memory, to hand it over to another broker, and
its sends and queues in JetStream (``cluster_state.ClusterState``: the same store_sends, settle_sends and take_queue).

After a restart, amqtt holds none of them: a session is restored when its client id CONNECTs (:meth:`claim`, through
the same adopt-on-CONNECT path as a session the cluster hands over, ``amqtt_hooks.cluster``), with CONNACK session
present 1, its queued messages and its ECQ queue, judged by its owner (``amqtt_hooks.session_owners``). Until then a
message published to it must still be queued, so start-up reads every session record (not their messages) into a
:class:`FilterIndex` of their subscriptions, which each fan-out consults (:meth:`queue_for_stored`). The trade-off,
measured: start-up reads about 100,000 records per second (``tests/test_stored_sessions.py`` prints it; LevelDB's
own checksum pass at start reads every row anyway), and an unclaimed session costs its index entries (about 0.5 KB
for one subscription) instead of an amqtt Session (25 KB); an index lookup walks the topic's levels, not the stored
sessions. Loading amqtt Sessions eagerly would cost minutes and gigabytes at 1,000,000 sessions; consulting no
index would lose what was published before the client came back. ``len()`` is what the ``ecq_sessions_stored``
gauge shows.

A session's expiry is absolute: ``offline_ms`` (when its connection ended; for a session whose broker died while it
was connected, the start of this broker) plus its interval. Expired sessions are not restored and are deleted when
met (at start, at a fan-out that matches them, at their CONNECT) and otherwise at their deadline, which each stored
session sets on the broker's one heap of offline sessions' deadlines (``amqtt_hooks.session_deadlines``, swept by
amqtt's session monitor as ECQ replaced it; the deadline replaces the one amqtt's copy of an evicted session had):
``expire`` (``SessionKeeper.expired``) ends each as an MQTT 5 expiry does. No timer per session, a cost per expired
session only. Shared subscriptions (``$share/``) are restored
with their session but queue nothing while it is unclaimed (MQTT 5.0 section 4.8.2 lets the group's other members
take them).
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from ecq.broker.amqtt_hooks import HeldSession, PersistentSession
from ecq.broker.session_state import SessionState, TurnBatch, message_value, read_message, subscriptions_value
from ecq.config import EcqSettings
from ecq.queue.deadlines import DeadlineHeap
from ecq.queue.topic_tree import TopicTree
from ecq.queue.topics import PREFIX, SCQ_PREFIX, is_ecq_topic
from ecq.store.leveldb_sessions import LevelDbSessions

log = logging.getLogger(__name__)

_NOT_INDEXED = ("$share/", PREFIX, SCQ_PREFIX)  # shared subscriptions queue nothing while unclaimed; ECQ and SCQ
# queues are the engine's


class FilterIndex(TopicTree):
    """Topic filters of stored sessions in a :class:`ecq.queue.topic_tree.TopicTree`, each holding ``{clientid: granted
    QoS}``: :meth:`match` costs the topic's levels times the wildcards met, not the number of filters (MQTT 3.1.1
    section 4.7; a topic starting with ``$`` is not matched by a wildcard at its first level)."""

    def match(self, topic: str) -> dict[str, int]:
        """client id -> highest granted QoS among its filters matching ``topic``."""
        found: dict[str, int] = {}
        for holders in self.filters_matching(topic):
            for clientid, qos in holders.items():
                if qos > found.get(clientid, -1):
                    found[clientid] = qos
        return found


class StoredSessions:
    """The embedded :class:`ecq.broker.session_state.SessionStore` over ``table``, with the index of the sessions
    stored by an earlier run and not yet claimed. Build it with :meth:`load` before the listeners open. A store
    write that fails is logged, not raised (the session then lives on in this broker's memory only)."""

    def __init__(self, settings: EcqSettings, table: LevelDbSessions, deadlines: DeadlineHeap,
                 expire: Callable[[str], Awaitable[None]]) -> None:
        self._settings, self._table = settings, table
        self._filters = FilterIndex()
        self._unclaimed: dict[str, tuple[int, tuple[str, ...]]] = {}  # clientid -> (expires ms, its indexed filters)
        self._deadlines, self._expire = deadlines, expire
        self._at_deadline = self._expire_if_due  # one bound method, the value of every stored session's deadline
        self._started_ms = _now_ms()
        self._settling = TurnBatch(partial(self._write, "acknowledged messages", self._table.delete_messages))

    @classmethod
    def load(cls, settings: EcqSettings, store: Any, deadlines: DeadlineHeap,
             expire: Callable[[str], Awaitable[None]]) -> StoredSessions:
        """The stored sessions of ``store`` (an open LevelDbStore), their subscriptions indexed and their deadlines
        (epoch ms) set on ``deadlines``, the heap of the broker's offline sessions, to ``await expire(clientid)`` when
        due; the expired ones and unreadable records deleted (logged). Logs how many and how long it took."""
        started = time.monotonic()
        sessions = cls(settings, LevelDbSessions(store), deadlines, expire)
        collecting = gc.isenabled()
        gc.disable()  # the index is millions of small objects made at once: 1.9 s -> 1.2 s of CPU per 100,000 sessions
        try:
            expired = sessions._read_records()
        finally:
            if collecting:
                gc.enable()
        log.info("ECQ stored sessions: %d to restore at their CONNECT, %d expired and deleted (%.2f s to read)",
                 len(sessions._unclaimed), expired, time.monotonic() - started)
        return sessions

    def _read_records(self) -> int:
        """Index every stored session; returns how many had expired (deleted, as unreadable ones are)."""
        expired = 0
        for clientid, record in self._table.records():
            try:
                raw = json.loads(record)
                expires_ms = self._expires_ms(raw)
                filters = [(entry[0], int(entry[1])) for entry in raw["subscriptions"]]
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                log.warning("ECQ deleted the unreadable stored session of %r: %s", clientid, exc)
                self._table.delete(clientid)
                continue
            if expires_ms <= self._started_ms:
                expired += 1
                self._table.delete(clientid)
                continue
            if raw.get("offline_ms") is None:  # its broker died while it was connected: offline since this start
                self._table.put(clientid, json.dumps({**raw, "offline_ms": self._started_ms}).encode())
            self._index(clientid, expires_ms, filters)
        return expired

    def __len__(self) -> int:
        """How many stored sessions are not yet claimed."""
        return len(self._unclaimed)

    # --- the SessionStore protocol ------------------------------------------------------------------------

    def save_session(self, clientid: str, session: PersistentSession) -> bool:
        """Store the record of ``clientid``'s session (see the module's docstring) unless the store holds that very
        record already (a SUBSCRIBE of a filter held at the same QoS, an UNSUBSCRIBE of none held, the SUBSCRIBE a
        resumed session's client sends again at each CONNECT): True when it was written."""
        return self._write(f"session of {clientid!r}", self._table.put_if_changed, clientid,
                           _record(session, _now_ms()), failed=False)

    def save_at_shutdown(self, sessions: dict[str, HeldSession]) -> None:
        """Store every persistent session the broker holds as offline from now (a stopping broker ends every
        connection): a session's expiry then runs from the shutdown, not from the next start. One with messages sent
        and not acknowledged, or QoS 2 releases owed, gets them stored too (its stored queue becomes what its client
        has not received, oldest first), so that they come again after the restart (MQTT 3.1.1 section 4.4; as new
        PUBLISHes, the PUBRELs with their packet ids)."""
        self._settling.flush()
        for clientid, (session, messages, releases) in sessions.items():
            offline = session._replace(offline=True)
            if not messages and not releases:
                self.save_session(clientid, offline)
            elif self._write(f"session of {clientid!r}", self._table.put, clientid,
                             _record(offline, _now_ms(), releases), failed=False) is not False:
                self._replace_queue(clientid, messages)

    def forget_session(self, clientid: str) -> None:
        """Delete ``clientid``'s stored session and queue, and its index entries."""
        self._unindex(clientid)
        self._write(f"end of the session of {clientid!r}", self._table.delete, clientid)

    def queue_message(self, clientid: str, topic: str, qos: int, payload: bytes) -> list[str]:
        """Store a message queued for ``clientid``'s offline session (at most ``session_max_queued``); returns the
        topics of the oldest messages dropped for it."""
        dropped = self._write(f"message queued for {clientid!r}", self._table.queue, clientid,
                              message_value(topic, qos, payload), self._settings.session_max_queued, failed=[])
        return [_topic_of(value) for value in dropped]

    def store_sends(self, sends: list[tuple[str, str, int, bytes]]) -> list[bytes | None]:
        """Store each ``(clientid, topic, QoS, payload)``, a message of an ordinary topic about to be sent to a
        connected persistent session, at the end of its stored queue, all in one write batch (called by the fan-out,
        so before the publisher's PUBACK): returns a key per message, for :meth:`settle_sends` once its client
        acknowledged it, or Nones when the write failed (logged). No bound here: the connection's sends are bounded
        (``max_queued_messages``), each dropped one settled."""
        return self._write(f"messages sent to {len(sends)} sessions", self._table.put_messages,
                           [(clientid, message_value(topic, qos, payload)) for clientid, topic, qos, payload in sends],
                           failed=[None] * len(sends))

    def settle_sends(self, keys: list[bytes]) -> None:
        """Delete the stored copies of messages sent (:meth:`store_sends`, :meth:`take_queue`): acknowledged, or
        dropped from the session's memory. They are deleted at the event loop's next turn, in one write batch with
        all those settled before it (at once without a running loop): 6-7 us per delivery with the fan-out's write
        instead of 15-23 us with a write per PUBACK (200 sessions a fan-out, on the 2-core test machine); a broker
        killed before that turn sends them once more (QoS 1 allows it)."""
        self._settling.add(keys)

    def take_queue(self, clientid: str, messages: list[tuple[str, int, bytes]], kept: frozenset[bytes]) -> list[Any]:
        """``clientid``'s queued ``messages`` ``[(topic, QoS, payload)]`` are being sent: its stored queue becomes the
        entries of ``kept`` (sends not yet acknowledged) then these, in one write batch; returns their keys for
        :meth:`settle_sends`, or Nones when the write failed (logged)."""
        return self._write(f"sent queue of {clientid!r}", self._table.replace_queue, clientid,
                           [message_value(topic, qos, payload) for topic, qos, payload in messages], kept,
                           failed=[None] * len(messages))

    # --- restoring and routing ------------------------------------------------------------------------

    def claim(self, clientid: str, clean: bool) -> SessionState | None:
        """At ``clientid``'s CONNECT: its stored session, not yet claimed and not expired, with its queued messages
        (then no longer indexed: amqtt holds it from now on); None otherwise. A ``clean`` CONNECT deletes it
        (MQTT 3.1.1 section 3.1.2.4, MQTT 5.0 section 3.1.2.4 Clean Start)."""
        if clean:
            self.forget_session(clientid)
            return None
        if clientid not in self._unclaimed:
            return None
        expires_ms, _filters = self._unclaimed[clientid]
        if expires_ms <= _now_ms():
            self.forget_session(clientid)
            return None
        self._unindex(clientid)
        try:
            state = SessionState.from_kv(self._table.get(clientid) or b"")
            state.messages = [read_message(value) for value in self._table.messages(clientid)]
        except Exception as exc:  # unreadable, or the store failing: the client starts afresh
            log.warning("ECQ could not restore the stored session of %r: %s", clientid, exc or type(exc).__name__)
            return None
        return state

    def evict(self, clientid: str, session: PersistentSession, messages: list[tuple[str, int, bytes]]) -> bool:
        """Keep ``clientid``'s ``session``, whose connection just ended, in the store only, as if an earlier run had
        stored it: its record as offline from now, its stored queue replaced by ``messages`` ``[(topic, QoS,
        payload)]`` (those sent and not acknowledged, then those queued), and its filters indexed until its CONNECT
        (:meth:`claim`) or its deadline (:meth:`_expire_if_due`). False, and nothing indexed, when the record could
        not be written (amqtt keeps the session then)."""
        offline_ms = _now_ms()
        if self._write(f"session of {clientid!r}", self._table.put, clientid, _record(session, offline_ms),
                       failed=False) is False:
            return False
        self._replace_queue(clientid, messages)
        self._unindex(clientid)
        self._index(clientid, self._expires_ms({"expiry_s": session.expiry_s, "offline_ms": offline_ms}),
                    [(topic_filter, qos) for topic_filter, qos, _options in session.subscriptions])
        return True

    def _replace_queue(self, clientid: str, messages: list[tuple[str, int, bytes]]) -> None:
        self.take_queue(clientid, messages[-self._settings.session_max_queued:], frozenset())

    async def _expire_if_due(self, clientid: str) -> None:
        """At the deadline of ``clientid``'s stored session: ``expire`` it if it is still unclaimed and its expiry has
        passed; set its deadline again if it is unclaimed but not yet due."""
        expires_ms = self._unclaimed.get(clientid, (None,))[0]
        if expires_ms is None:
            return
        if expires_ms <= _now_ms():
            await self._expire(clientid)
        else:
            self._deadlines.set(clientid, expires_ms, self._at_deadline)

    def queue_for_stored(self, topic: str, payload: bytes, publish_qos: int) -> list[tuple[str, str]]:
        """Queue a message of an ordinary ``topic`` broadcast at ``publish_qos`` for each unclaimed stored session a
        subscription of which takes it, at min(``publish_qos``, highest granted QoS) when that is 1 or 2 (MQTT
        3.1.1 sections 3.1.2.4 and 3.3.5), as amqtt would for an offline session it held. Returns ``[(clientid,
        topic)]`` of the messages dropped from full queues (``session_max_queued``: the oldest go)."""
        if publish_qos == 0 or is_ecq_topic(topic) or not self._unclaimed:
            return []
        now_ms, dropped = _now_ms(), []
        for clientid, granted in self._filters.match(topic).items():
            if (qos := min(publish_qos, granted)) == 0:
                continue
            if self._unclaimed[clientid][0] <= now_ms:
                self.forget_session(clientid)
            else:
                dropped += [(clientid, old) for old in self.queue_message(clientid, topic, qos, payload)]
        return dropped

    def _index(self, clientid: str, expires_ms: int, filters: list[tuple[str, int]]) -> None:
        indexed = tuple(f for f, _qos in filters if not f.startswith(_NOT_INDEXED))
        for topic_filter, qos in filters:
            if not topic_filter.startswith(_NOT_INDEXED):
                self._filters.add(topic_filter, clientid, qos)
        self._unclaimed[clientid] = (expires_ms, indexed)
        self._deadlines.set(clientid, expires_ms, self._at_deadline)

    def _unindex(self, clientid: str) -> None:
        if (unclaimed := self._unclaimed.pop(clientid, None)) is None:
            return
        self._deadlines.discard(clientid)
        for topic_filter in unclaimed[1]:
            self._filters.remove(topic_filter, clientid)

    def _expires_ms(self, raw: dict[str, Any]) -> int:
        expiry_s = raw.get("expiry_s")
        interval_s = self._settings.session_expiry if expiry_s is None else min(expiry_s, self._settings.session_expiry)
        offline_ms = raw.get("offline_ms") or self._started_ms
        return int(offline_ms + interval_s * 1000)

    @staticmethod
    def _write(what: str, write: Callable[..., Any], *args: Any, failed: Any = None) -> Any:
        """``write(*args)``'s result, or ``failed`` when it raised (logged: a full disk, the store closed at shutdown)."""
        try:
            return write(*args)
        except Exception as exc:
            log.warning("ECQ could not store the %s: %s", what, exc or type(exc).__name__)
            return failed


def _topic_of(value: bytes) -> str:
    """The topic of a stored queued message (``session_state.message_value``), "?" for one that does not read."""
    try:
        return read_message(value)[0]
    except (ValueError, UnicodeDecodeError):
        return "?"


def _record(session: PersistentSession, now_ms: int, releases: list[int] | None = None) -> bytes:
    """The stored record of ``session``: owner, subscriptions, expiry, since when offline (null while online), and the
    packet ids of the QoS 2 releases it owes, when there are any."""
    record = {"username": session.username, "subscriptions": subscriptions_value(session.subscriptions),
              "expiry_s": session.expiry_s, "offline_ms": now_ms if session.offline else None}
    return json.dumps(record | {"releases": releases} if releases else record).encode()


def _now_ms() -> int:
    return int(time.time() * 1000)
