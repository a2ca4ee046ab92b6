"""What `ecq status` and `ecq inspect` report, computed from the store and, when the broker runs, from a
snapshot of its engine taken on the event loop. Shapes are plain JSON-ready dicts.

Timestamps are RFC 3339 strings in UTC (or null); counts are entries; bytes are payload bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from ecq.queue.clock import now_ms
from ecq.queue.snapshots import ConsumerSnapshot, EngineSnapshot
from ecq.queue.topics import SCQ_PREFIX, is_position_id, queue_of_position, scq_queue_id
from ecq.store.protocol import AckState, IndexEntry, Message, QueueStore, stored_pages

CONSUMERS_LISTED = 100


def rfc3339(ts_ms: int) -> str | None:
    """``2026-11-21T06:11:13.123Z`` for a time in ms since the epoch; None for 0 (never)."""
    if not ts_ms:
        return None
    return datetime.fromtimestamp(ts_ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def format_range(seqnos: list[int]) -> str:
    """The reference CLI's queue range: ``[3,...,9]``, ``[3]`` for one entry, ``[]`` for none."""
    if not seqnos:
        return "[]"
    return f"[{seqnos[0]}]" if len(seqnos) == 1 else f"[{seqnos[0]},...,{seqnos[-1]}]"


def queue_info(store: QueueStore, clientid: str, consumer: ConsumerSnapshot | None = None) -> dict[str, Any] | None:
    """State of one queue, or None when ``clientid`` never had a write nor a consumer state. ``consumer``:
    the running broker's view of its consumer (None: the stored state).

    Keys: clientid, acked, last_ack_ts, last_seqno, range, stored, pending (stored and not acked),
    pending_bytes (their payload bytes), oldest_pending_age_s (seconds since the oldest of them was published,
    null when none), inflight, online, skipped_too_large (entries skipped as too large for the consumer's
    connection, see ecq.queue.delivery). Reads the whole queue: O(stored entries).
    """
    state = consumer.ack_state() if consumer else store.ack_state(clientid)
    last_seqno = store.last_seqno(clientid)
    if last_seqno == 0 and state == AckState():
        return None
    entries = [message for page in stored_pages(store, clientid, 256) for message in page]
    seqnos = [m.seqno for m in entries]
    return {
        "clientid": clientid,
        "acked": state.acked,
        "last_ack_ts": rfc3339(state.last_ack_ms),
        "last_seqno": last_seqno,
        "range": format_range(seqnos),
        "stored": len(seqnos),
        **_pending(entries, state),
        "inflight": consumer.inflight if consumer else 0,
        "online": bool(consumer and consumer.online),
        "skipped_too_large": consumer.skipped if consumer else 0,
    }


def scq_info(store: QueueStore, queue: str, readers: Mapping[str, ConsumerSnapshot] | None = None
             ) -> dict[str, Any] | None:
    """State of the SCQ named ``queue`` and of its readers, or None when it never had a write nor a reader's stored
    position. ``readers``: the running broker's snapshots of its readers in memory, by position id (None: the stored
    positions only).

    Keys: kind (``scq``), queue, last_seqno, range, stored (as :func:`queue_info`), readers_total, readers_online
    and ``readers``: at most CONSUMERS_LISTED, the most pending first, ties by client id, each as reader (its client
    id), acked, last_ack_ts, pending, pending_bytes, oldest_pending_age_s, inflight, online. Reads the whole SCQ and
    every stored ack state: O(stored entries + states + listed readers x entries)."""
    queue_id, readers = scq_queue_id(queue), readers or {}
    states = {cid: state for cid, state in store.ack_states() if is_position_id(cid) and queue_of_position(cid) ==
              queue_id}
    states.update((cid, snapshot.ack_state()) for cid, snapshot in readers.items())
    last_seqno = store.last_seqno(queue_id)
    if last_seqno == 0 and not states:
        return None
    entries = [message for page in stored_pages(store, queue_id, 256) for message in page]
    rows = []
    for cid, state in states.items():
        live = readers.get(cid)
        rows.append({"reader": cid[len(queue_id) + 1:], "acked": state.acked, "last_ack_ts": rfc3339(state.last_ack_ms),
                     **_pending(entries, state), "inflight": live.inflight if live else 0,
                     "online": bool(live and live.online)})
    rows.sort(key=lambda row: (-row["pending"], row["reader"]))
    return {"kind": "scq", "queue": queue, "last_seqno": last_seqno, "range": format_range([m.seqno for m in entries]),
            "stored": len(entries), "readers_total": len(rows), "readers_online": sum(row["online"] for row in rows),
            "readers": rows[:CONSUMERS_LISTED]}


def _pending(entries: list[Message], state: AckState) -> dict[str, Any]:
    """pending, pending_bytes and oldest_pending_age_s of ``entries`` for a consumer at ``state``."""
    pending = [m for m in entries if m.seqno > state.acked and m.seqno not in state.above]
    return {"pending": len(pending), "pending_bytes": sum(len(m.payload) for m in pending),
            "oldest_pending_age_s": round((now_ms() - min(m.ts_ms for m in pending)) / 1000, 3) if pending else None}


def broker_status(store: QueueStore, snapshot: EngineSnapshot | None = None) -> dict[str, Any]:
    """Fleet view: queue and entry counts, payload bytes, first/last index entries, consumer states.

    ``first_index`` and ``last_index`` are two stored entries (clientid, seqno, key, ts) picked in the order
    ``index_order`` names (the store's ``edge_order``): ``clientid`` (the lowest and the highest by clientid, then
    seqno: LevelDB's key order, which says nothing of their age) or ``time`` (the oldest and the newest).

    ``snapshot`` is the running broker's (``QueueEngine.readers_snapshot``: its totals and its SCQ readers in memory),
    whose queue, entry and payload byte counts are used (the ``ecq_queues`` and ``ecq_stored_*`` gauges' figures);
    None when reading a data dir directly (then the store is scanned).
    A shared store (a cluster) is always asked for its counts, so that every broker reports the same figures.
    ``consumers_online`` is the engine's count of ECQ consumers and SCQ readers connected and subscribed, the
    ``ecq_consumers_online`` gauge's figure (0 from a data dir). At most 100 consumer states are listed as stored
    (``online`` false: :func:`with_live_consumers` puts in the running broker's); ``consumers_total`` gives how many
    are stored. An SCQ reader's position is no consumer here: ``scqs`` lists the SCQs that have readers (stored
    positions, or readers in memory), by name, at most 100, each as kind (``scq``), queue, readers, readers_online;
    ``scqs_total`` gives how many. Reads every stored ack state: O(stored states), and O(SCQ readers in memory).
    """
    readers_live = snapshot.consumers if snapshot else {}
    if snapshot is None or store.shared:
        queues, (messages, size) = store.count_queues(), store.stored_totals()
    else:
        queues, messages, size = snapshot.totals.queues, snapshot.totals.stored_entries, snapshot.totals.stored_bytes
    first, last = store.edge_index_entries()
    states = []
    total = 0
    readers: dict[str, set[str]] = {}
    for clientid in readers_live:
        readers.setdefault(queue_of_position(clientid), set()).add(clientid)
    for clientid, stored_state in store.ack_states():
        if is_position_id(clientid):
            readers.setdefault(queue_of_position(clientid), set()).add(clientid)
            continue
        total += 1
        if len(states) < CONSUMERS_LISTED:
            states.append(_consumer_row(clientid, stored_state, False))
    return {
        "queues": queues,
        "messages": messages,
        "bytes": size,
        "consumers_online": snapshot.totals.online if snapshot else 0,
        "first_index": _entry(first),
        "last_index": _entry(last),
        "index_order": store.edge_order,
        "consumers_total": total,
        "consumers": states,
        "scqs_total": len(readers),
        "scqs": [{"kind": "scq", "queue": queue_id[len(SCQ_PREFIX):], "readers": len(positions),
                  "readers_online": sum(1 for cid in positions if (live := readers_live.get(cid)) and live.online)}
                 for queue_id, positions in sorted(readers.items())[:CONSUMERS_LISTED]],
    }


def with_live_consumers(status: dict[str, Any], live: Callable[[str], ConsumerSnapshot | None]) -> dict[str, Any]:
    """``status`` (:func:`broker_status`) with each listed consumer's state as the running broker holds it, where
    ``live(clientid)`` (``QueueEngine.consumer_snapshot``, called on the event loop) has it in memory: at most
    CONSUMERS_LISTED look-ups, whatever the size of the fleet."""
    status["consumers"] = [_consumer_row(row["clientid"], state, state.online) if (state := live(row["clientid"]))
                           else row for row in status["consumers"]]
    return status


def _consumer_row(clientid: str, state: AckState | ConsumerSnapshot, online: bool) -> dict[str, Any]:
    return {"clientid": clientid, "acked": state.acked, "last_ack_ts": rfc3339(state.last_ack_ms), "online": online}


def _entry(entry: IndexEntry | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    return {"clientid": entry.clientid, "seqno": entry.seqno, "key": entry.key, "ts": rfc3339(entry.ts_ms)}
