"""The ECQ tables in LevelDB: key layout and encodings (used by ecq.store.leveldb and its reads).

Key layout (one leading byte per table; ``S(x)`` = 2-byte big-endian length + UTF-8 bytes, so a prefix
scan over ``S(clientid)`` returns exactly one client's rows and ``a`` never collides with ``a/b``;
``U64`` = 8-byte big-endian unsigned, so seqnos and timestamps sort numerically):

=======  ========================================  ==================================================
table    key                                       value
=======  ========================================  ==================================================
seqno    ``s`` S(clientid)                         U64 last assigned seqno (seqnos start at 1), U64 its publish ms
state    ``a`` S(clientid)                         U64 acked seqno, U64 last-ack ms, U64* acked above it
index    ``i`` S(clientid) U64(seqno)              U64 publish ms, U32 payload bytes, key bytes
                                                   [NUL, U64 expiry ms: only an entry that has one]
payload  ``p`` S(clientid) S(key) U64(seqno) U64(ms)  payload bytes
expiry   ``e`` U64(expiry ms) S(clientid) U64(seqno)  empty: GC's list of entries with an expiry, soonest first
session  ``c`` S(clientid)                         a persistent MQTT session's record (JSON, see
                                                   ecq.broker.session_state: owner, subscriptions, expiry)
session  ``q`` S(clientid) U64(order)              a QoS 1/2 message of an ordinary topic queued for that
queue                                              session while offline (ecq.broker.session_state), oldest
                                                   first; ``order`` a nanosecond clock then a counter
=======  ========================================  ==================================================

All timestamps are milliseconds since the Unix epoch (a seqno row written before ECQ kept the last publish time
holds the seqno alone, read as published at 0). An entry's own expiry time (an MQTT 5 write's Message Expiry
Interval, MQTT 5.0 section 3.3.2.3.3) follows its key in the index row after a NUL, which no key holds
(ecq.queue.topics refuses it); an entry without one, every entry written before ECQ kept expiries among them,
has neither that suffix nor an expiry row. The session tables (ecq.store.leveldb_sessions) are written outside the
queues' commits, one small write each, and read at start (every ``c`` row) and at a client's CONNECT.
"""

from __future__ import annotations

import struct

from ecq.store.protocol import AckState, ExpiredRow, IndexEntry

U64 = struct.Struct(">Q")
INDEX_VALUE = struct.Struct(">QI")  # publish ms, payload size in bytes; the key follows
SEQNO, STATE, INDEX, PAYLOAD, EXPIRY = b"s", b"a", b"i", b"p", b"e"
SESSION, SESSION_QUEUE = b"c", b"q"
EXPIRES = b"\x00"  # in an index value, between the key and the entry's expiry ms
MAX_U64 = b"\xff" * 8
INDEX_END = bytes([INDEX[0] + 1])  # first key after the index table


def encode_s(text: str) -> bytes:
    """``S(text)``: 2-byte big-endian length, then the UTF-8 bytes."""
    raw = text.encode()
    return len(raw).to_bytes(2, "big") + raw


def read_s(buf: bytes, offset: int) -> tuple[str, int]:
    """The ``S(x)`` at ``offset`` of ``buf``: (x, offset just past it)."""
    size = int.from_bytes(buf[offset:offset + 2], "big")
    end = offset + 2 + size
    return buf[offset + 2:end].decode(), end


def payload_key(clientid: str, key: str, seqno: int, ts_ms: int) -> bytes:
    """The payload table's key of an entry."""
    return PAYLOAD + encode_s(clientid) + encode_s(key) + U64.pack(seqno) + U64.pack(ts_ms)


def index_value(ts_ms: int, size: int, key: str, expires_ms: int) -> bytes:
    """An index-table value: publish ms, payload bytes, the key, and the expiry ms when there is one (not 0)."""
    value = INDEX_VALUE.pack(ts_ms, size) + key.encode()
    return value + EXPIRES + U64.pack(expires_ms) if expires_ms else value


def index_key_and_expiry(value: bytes) -> tuple[str, int]:
    """The key and the expiry ms (0: none) of an index-table value."""
    cut = value.find(EXPIRES, INDEX_VALUE.size)
    if cut < 0:
        return value[INDEX_VALUE.size:].decode(), 0
    return value[INDEX_VALUE.size:cut].decode(), U64.unpack_from(value, cut + 1)[0]


def expiry_key(expires_ms: int, clientid: str, seqno: int) -> bytes:
    """The expiry table's key of an entry expiring at ``expires_ms``."""
    return EXPIRY + U64.pack(expires_ms) + encode_s(clientid) + U64.pack(seqno)


def index_entry(row: tuple[bytes, bytes] | None) -> IndexEntry | None:
    """The entry an index-table row (key, value) describes; None for None."""
    if row is None:
        return None
    index_key, value = row
    clientid, offset = read_s(index_key, 1)
    ts_ms, _size = INDEX_VALUE.unpack_from(value)
    return IndexEntry(clientid, U64.unpack_from(index_key, offset)[0], index_key_and_expiry(value)[0], ts_ms)


def encode_state(state: AckState) -> bytes:
    """A state-table value: acked seqno, last-ack ms, the seqnos acked above it (ascending)."""
    above = sorted(s for s in state.above if s > state.acked)
    return b"".join(U64.pack(v) for v in (state.acked, state.last_ack_ms, *above))


def decode_state(raw: bytes) -> AckState:
    """Inverse of :func:`encode_state`."""
    values = [v for (v,) in U64.iter_unpack(raw)]
    return AckState(values[0], values[1], set(values[2:]))


class BatchState:
    """What the earlier ops of one commit batch did to the tables, which the database shows only once the batch is
    written (ecq.store.leveldb's commit)."""

    __slots__ = ("latest", "deleted", "added", "appended", "touched", "forgotten", "expiries")

    def __init__(self) -> None:
        # (clientid, key) -> (seqno, ms, bytes, expiry ms or 0) appended
        self.latest: dict[tuple[str, str], tuple[int, int, int, int]] = {}
        self.deleted: set[tuple[str, int]] = set()  # (clientid, seqno) deleted: compaction, Expire, quota eviction
        self.added: dict[str, list[ExpiredRow]] = {}  # clientid -> rows appended, in seqno order (quotas on only)
        self.appended: dict[str, int] = {}  # clientid -> the last seqno appended
        self.touched: set[str] = set()  # queues appended to or acked: state GC leaves them
        self.forgotten: list[str] = []  # queues whose seqno and state rows were deleted (ForgetQueue)
        self.expiries: dict[tuple[str, int], int] = {}  # (clientid, seqno) -> expiry ms, of the rows seen with one
