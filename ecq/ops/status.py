"""What `ecq status` and `ecq inspect` report, computed from the store and, when the broker runs, from a
snapshot of its engine taken on the event loop. Shapes are plain JSON-ready dicts.

Timestamps are RFC 3339 strings in UTC (or null); counts are entries; bytes are payload bytes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ecq.queue.clock import now_ms
from ecq.queue.snapshots import ConsumerSnapshot, EngineSnapshot
from ecq.store.protocol import AckState, IndexEntry, QueueStore, stored_pages

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
    pending = [m for m in entries if m.seqno > state.acked and m.seqno not in state.above]
    return {
        "clientid": clientid,
        "acked": state.acked,
        "last_ack_ts": rfc3339(state.last_ack_ms),
        "last_seqno": last_seqno,
        "range": format_range(seqnos),
        "stored": len(seqnos),
        "pending": len(pending),
        "pending_bytes": sum(len(m.payload) for m in pending),
        "oldest_pending_age_s": round((now_ms() - min(m.ts_ms for m in pending)) / 1000, 3) if pending else None,
        "inflight": consumer.inflight if consumer else 0,
        "online": bool(consumer and consumer.online),
        "skipped_too_large": consumer.skipped if consumer else 0,
    }


def broker_status(store: QueueStore, snapshot: EngineSnapshot | None = None) -> dict[str, Any]:
    """Fleet view: queue and entry counts, payload bytes, first/last index entries, consumer states.

    ``first_index`` and ``last_index`` are two stored entries (clientid, seqno, key, ts) picked in the order
    ``index_order`` names (the store's ``edge_order``): ``clientid`` (the lowest and the highest by clientid, then
    seqno: LevelDB's key order, which says nothing of their age) or ``time`` (the oldest and the newest).

    ``snapshot`` is the running broker's engine snapshot, whose consumers and (entries, payload bytes)
    counts are used; None when reading a data dir directly (then the store is scanned). A shared store
    (a cluster) is always asked for its counts, so that every broker reports the same figures.
    At most 100 consumer states are listed; ``consumers_total`` gives how many are stored.
    """
    consumers = snapshot.consumers if snapshot else {}
    if snapshot is None or store.shared:
        messages, size = store.stored_totals()
    else:
        messages, size = snapshot.totals.stored_entries, snapshot.totals.stored_bytes
    first, last = store.edge_index_entries()
    states = []
    total = 0
    for clientid, stored_state in store.ack_states():
        total += 1
        if len(states) < CONSUMERS_LISTED:
            live = consumers.get(clientid)
            state = live if live else stored_state
            states.append({"clientid": clientid, "acked": state.acked, "last_ack_ts": rfc3339(state.last_ack_ms),
                           "online": bool(live and live.online)})
    return {
        "queues": store.count_queues(),
        "messages": messages,
        "bytes": size,
        "consumers_online": sum(1 for c in consumers.values() if c.online),
        "first_index": _entry(first),
        "last_index": _entry(last),
        "index_order": store.edge_order,
        "consumers_total": total,
        "consumers": states,
    }


def _entry(entry: IndexEntry | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    return {"clientid": entry.clientid, "seqno": entry.seqno, "key": entry.key, "ts": rfc3339(entry.ts_ms)}
