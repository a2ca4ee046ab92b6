"""The queue event schema: what an event is, how it is checked and encoded for the event buffer, and
how buffered events become an Arrow table.

Schema (one Parquet table, `SCHEMA`, columns in this order; a column that does not apply to an event
type is null). Times are ms since the Unix epoch (UTC), sizes are bytes.

============== ====== ==================================================================================
column         type   meaning
============== ====== ==================================================================================
ts_ms          int64  when the event happened (ms); for ``acked`` the time of the PUBACK
type           string ``appended`` | ``compacted`` | ``delivered`` | ``acked`` | ``expired`` | ``evicted`` |
                      ``refused`` | ``rewound``
clientid       string the queue's clientid, for an SCQ its queue id ``$SCQ/<queue>`` (never a reader's client id);
                      ``refused``: the target clientid (or ``$SCQ/<queue>``) if the topic names one
key            string the message's key
seqno          int64  ``appended``: the new seqno; ``compacted``: the NEW seqno that replaced the old one;
                      ``delivered``/``acked``/``expired``/``evicted``: the message's seqno; ``rewound``: the new acked
                      seqno (the next delivery is the first stored entry above it)
publish_ts_ms  int64  the message's publish (append) time in ms, for every type but ``refused`` and ``rewound``
payload_bytes  int64  the message's payload size in bytes (``appended``, ``delivered``, ``acked``, ...)
replaced_seqno int64  ``compacted`` only: the seqno that was deleted
attempt        int32  ``delivered`` only: 1 for the first send, 2+ for redeliveries
reason         string ``refused``: ``not_a_write``, ``empty_key``, ``bad_key``, ``payload_too_large``,
                      ``acl_denied``, ``not_owner``, ``bad_rewind``, ``quota_exceeded``, ``store_full``, ...; ``rewound``: the point as asked
                      (``42``, ``earliest``, ``latest``, ``since:<unix ms>``); ``expired``: why the entry was deleted
                      (``retention``, ``message_expiry``, ``tombstone_retention``, ``tombstone_acked``,
                      ``purge``); ``evicted``: ``quota`` (the queue quota deleted its oldest entry to make room)
topic          string ``refused`` only: the PUBLISH topic
kind           string the queue's kind: ``ecq`` (a client's own queue) or ``scq`` (a shared compacted queue; ``refused``: a
                      topic under ``$SCQ/``); null in files written before the column existed: readers take it from
                      ``clientid`` (``$SCQ/...``: scq)
reader         string SCQ ``delivered``, ``acked`` and ``rewound`` only: whose position it is, the reader's client id
                      or ``$share/<group>`` for a group; null for ECQ
============== ====== ==================================================================================

End-to-end latency (append to ack, including time offline) is ``acked.ts_ms - acked.publish_ts_ms`` (ms); delivery
latency (sent to ack) is the ack time minus the last ``delivered`` event of that seqno at or before it.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Sequence
from functools import partial
from itertools import chain, repeat
from typing import Any

import pyarrow as pa

EVENT_TYPES = frozenset({"appended", "compacted", "delivered", "acked", "expired", "evicted", "refused", "rewound"})
SCHEMA = pa.schema([
    pa.field("ts_ms", pa.int64(), nullable=False),
    pa.field("type", pa.string(), nullable=False),
    pa.field("clientid", pa.string()),
    pa.field("key", pa.string()),
    pa.field("seqno", pa.int64()),
    pa.field("publish_ts_ms", pa.int64()),
    pa.field("payload_bytes", pa.int64()),
    pa.field("replaced_seqno", pa.int64()),
    pa.field("attempt", pa.int32()),
    pa.field("reason", pa.string()),
    pa.field("topic", pa.string()),
    pa.field("kind", pa.string()),
    pa.field("reader", pa.string()),
])
COLUMNS = tuple(SCHEMA.names)
_OPTIONAL = COLUMNS[2:]  # the fields `record` takes besides ts_ms and type
_INT64 = (-(2**63), 2**63 - 1)
_INT32 = (-(2**31), 2**31 - 1)
_FIELD_RULES = {field.name: {pa.int64(): _INT64, pa.int32(): _INT32}.get(field.type)
                for field in SCHEMA if field.name in _OPTIONAL}  # None for a string column
_UNKNOWN = object()  # _FIELD_RULES.get() of a field not in SCHEMA
_encode_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # json.dumps builds one per call
# What _encode_json does, without the encoder object that JSONEncoder.encode builds on each call (for a row, more time
# than the encoding): a row's JSON as a list of chunks to join. Its arguments as JSONEncoder.iterencode passes them:
# markers (None: no circular check, a row is flat), default, encoder, indent, key_separator, item_separator,
# sort_keys, skipkeys, allow_nan.
_row_chunks = json.encoder.c_make_encoder(None, None, json.encoder.encode_basestring, None, ":", ",", False, False,
                                          True)
_COLUMN_RULES = (_INT64, None, *map(_FIELD_RULES.get, _OPTIONAL))  # each column's, in COLUMNS order
_COLUMN_TYPES = tuple(str if rule is None else int for rule in _COLUMN_RULES)
_OPTIONAL_NAMES = frozenset(_OPTIONAL)
_NONE = type(None)
_not_none = partial(operator.is_not, None)
_type_of = type  # encode_event's parameter ``type`` shadows the builtin
_TABLE_CHUNK = 500  # events per JSON parse and per Arrow conversion when exporting


class InvalidEvent(ValueError):
    """An event that does not fit `SCHEMA` (unknown type or field, wrong value type, out of range)."""


def encode_event(ts_ms: int, type: str, fields: dict[str, Any]) -> bytes:
    """One event as a ReplayQ item: a JSON array of the `COLUMNS` values, UTF-8.

    Raises InvalidEvent for an unknown type or field, a value of the wrong type (int for the int64/int32
    columns, str for the string columns, or None) or out of its column's range, and for strings that are
    not valid Unicode (lone surrogates). Checking here keeps bad events out of the lake export, where one
    of them would make a whole batch fail forever.
    """
    if type not in EVENT_TYPES:
        raise InvalidEvent(f"unknown event type {type!r}")
    _check_value("ts_ms", ts_ms, _INT64)
    for name, value in fields.items():
        rule = _FIELD_RULES.get(name, _UNKNOWN)
        if rule is _UNKNOWN:
            raise InvalidEvent(f"unknown event field {name!r} for {type!r}")
        if value is None or (_type_of(value) is str if rule is None else
                             _type_of(value) is int and rule[0] <= value <= rule[1]):
            continue  # the common case checked inline (it runs for every event); _check_value says what is wrong
        _check_value(name, value, rule)
    row = [ts_ms, type, *map(fields.get, _OPTIONAL)]
    try:
        return _encode_json(row).encode()
    except UnicodeEncodeError as exc:
        raise InvalidEvent(f"{type!r} event has a string that is not valid Unicode: {exc}") from None


def encode_events(events: Sequence[tuple[int, str, dict[str, Any]]]) -> list[bytes]:
    """`encode_event` of each of ``events`` (ts_ms, type, fields), in order, checked column by column: a few C calls
    per column of the batch instead of Python work per value (the recorder encodes every event of the broker).

    Raises InvalidEvent when any event of the batch is invalid, without saying which: `encode_event` each of them
    then.
    """
    if not events:
        return []
    ts_ms, types, fields = zip(*events)
    if not EVENT_TYPES.issuperset(types) or not _OPTIONAL_NAMES.issuperset(chain.from_iterable(fields)):
        raise InvalidEvent("an event of the batch has an unknown type or field")
    columns = [ts_ms, types, *([values.get(name) for values in fields] for name in _OPTIONAL)]
    if _NONE in set(map(type, ts_ms)) or not all(map(_column_fits, columns, _COLUMN_TYPES, _COLUMN_RULES)):
        raise InvalidEvent("an event of the batch has a value its column does not take")
    try:
        return list(map(str.encode, map("".join, map(_row_chunks, zip(*columns), repeat(0)))))
    except UnicodeEncodeError:
        raise InvalidEvent("an event of the batch has a string that is not valid Unicode") from None


def _column_fits(values: Sequence[Any], column_type: type, rule: tuple[int, int] | None) -> bool:
    """Whether every value of one column is None or of ``column_type`` exactly (a subclass, as bool of int, goes to
    `encode_event`'s checks) and, for an int column, within ``rule``."""
    if not {column_type, _NONE}.issuperset(map(type, values)):
        return False
    if rule is None:
        return True
    ints = list(filter(_not_none, values))
    return not ints or rule[0] <= min(ints) and max(ints) <= rule[1]


def _check_value(name: str, value: Any, rule: tuple[int, int] | None) -> None:
    """``rule`` is None for a string column, else the int column's (lowest, highest) value."""
    if rule is None:
        if not isinstance(value, str):
            raise InvalidEvent(f"{name} must be a str, not {type(value).__name__}")
    elif not isinstance(value, int) or isinstance(value, bool):
        raise InvalidEvent(f"{name} must be an int, not {type(value).__name__}")
    elif not rule[0] <= value <= rule[1]:
        raise InvalidEvent(f"{name}={value} is out of range for its column")


def events_table(items: Sequence[bytes]) -> pa.Table:
    """Decode ReplayQ items made by `encode_event` into a pyarrow Table with `SCHEMA`, in item order.

    Works in chunks of `_TABLE_CHUNK` items: each JSON parse and array conversion is one C call that holds
    the GIL throughout, and the broker's event loop waits for the GIL meanwhile: small chunks keep each
    of its stalls short.
    """
    if not items:
        return SCHEMA.empty_table()
    return pa.Table.from_batches([_record_batch(items[start:start + _TABLE_CHUNK])
                                  for start in range(0, len(items), _TABLE_CHUNK)], schema=SCHEMA)


def _record_batch(items: Sequence[bytes]) -> pa.RecordBatch:
    rows = json.loads(b"[" + b",".join(items) + b"]")  # one parse per chunk, not per item
    if len(rows) != len(items):  # an item that is not one JSON value: parse them one by one
        rows = [json.loads(item) for item in items]
    try:
        columns = list(zip(*rows, strict=True))
    except ValueError:
        columns = []
    if len(columns) != len(COLUMNS):  # items buffered before kind and reader existed: their missing columns null
        columns = list(zip(*(row + [None] * (len(COLUMNS) - len(row)) for row in rows), strict=True))
    arrays = [pa.array(col, type=field.type) for col, field in zip(columns, SCHEMA, strict=True)]
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)
