"""Event recorder and lake exporter on real files: a disk ReplayQ, a Parquet lake read
back with pyarrow, lake outages made by moving the directory away, and crashes of real processes."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ecq.events import EventRecorder, LakeExporter
from ecq.events.recorder import read_stream_id
from ecq.events.schema import COLUMNS, EVENT_TYPES, SCHEMA, InvalidEvent, encode_event, encode_events

HOUR_MS = 3_600_000
T0 = 1_767_225_540_000  # 2025-12-31T23:59:00Z: events run across a date and an hour boundary


def lake_rows(lake: Path) -> list[dict]:
    """Every event in the lake (hidden temp files are skipped, as Spark skips them), ordered by key."""
    if not any(lake.rglob("*.parquet")):
        return []
    table = ds.dataset(lake, format="parquet", partitioning="hive").to_table(columns=list(COLUMNS))
    return sorted(table.to_pylist(), key=lambda row: (row["key"] or "", row["type"]))


def lake_keys(lake: Path) -> list[str]:
    return sorted(row["key"] for row in lake_rows(lake))


def record_appends(recorder: EventRecorder, first: int, count: int, step_ms: int = 10) -> list[str]:
    """Record ``count`` appended events with unique keys k000000...; returns the keys."""
    keys = []
    for i in range(first, first + count):
        key = f"k{i:06d}"
        recorder.record("appended", ts_ms=T0 + i * step_ms, clientid="c1", key=key, seqno=i + 1,
                        publish_ts_ms=T0 + i * step_ms, payload_bytes=100)
        keys.append(key)
    return keys


async def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached in time")
        await asyncio.sleep(0.02)


async def fill_buffer(buffer_dir: Path, count: int) -> list[str]:
    """Put ``count`` events, 100 ms apart, into the ReplayQ at ``buffer_dir`` without exporting them."""
    recorder = EventRecorder(buffer_dir)
    await recorder.start()
    keys = record_appends(recorder, 0, count, step_ms=100)
    await recorder.close()
    return keys


async def export_all(buffer_dir: Path, lake: Path, **exporter_options) -> dict:
    """Start a recorder and an exporter on ``buffer_dir``, wait until the buffer is empty, close; returns stats."""
    recorder = EventRecorder(buffer_dir)
    await recorder.start()
    exporter = LakeExporter(recorder, lake, interval_s=0.02, **exporter_options)
    await exporter.start()
    await wait_for(lambda: recorder.stats()["buffered_items"] == 0 and recorder.stats()["lake_ok"])
    await exporter.close()
    await recorder.close()
    return recorder.stats()


async def export_all_from(recorder: EventRecorder, lake: Path) -> None:
    """Export what ``recorder`` (started) holds by closing an exporter, then close the recorder."""
    exporter = LakeExporter(recorder, lake, interval_s=0.02)
    await exporter.start()
    await exporter.close()
    await recorder.close()


async def test_every_event_type_lands_once_with_the_schema_and_hour_partitions(tmp_path):
    recorder = EventRecorder(tmp_path / "buffer")
    await recorder.start()
    exporter = LakeExporter(recorder, tmp_path / "lake", interval_s=0.05)
    await exporter.start()
    common = dict(clientid="c1", publish_ts_ms=T0)
    recorder.record("appended", ts_ms=T0, key="a", seqno=1, payload_bytes=5, **common)
    recorder.record("compacted", ts_ms=T0 + 1, key="b", seqno=2, replaced_seqno=1, **common)
    recorder.record("delivered", ts_ms=T0 + 2, key="c", seqno=2, payload_bytes=5, attempt=2, **common)
    recorder.record("acked", ts_ms=T0 + HOUR_MS, key="d", seqno=2, payload_bytes=5, **common)
    recorder.record("expired", ts_ms=T0 + HOUR_MS + 1, key="e", seqno=3, payload_bytes=5, **common)
    recorder.record("refused", ts_ms=T0 + 2 * HOUR_MS, key="f", reason="bad_key", topic="$ECQ/w/c1/+")
    recorder.record("rewound", ts_ms=T0 + 2 * HOUR_MS + 1, clientid="c1", seqno=0, reason="earliest")
    await wait_for(lambda: recorder.stats()["exported_items"] == 7)
    await exporter.close()
    await recorder.close()

    lake = tmp_path / "lake"
    files = sorted(p.relative_to(lake).parent.as_posix() for p in lake.rglob("*.parquet"))
    assert files == ["date=2025-12-31/hour=23", "date=2026-01-01/hour=00", "date=2026-01-01/hour=01"]
    for path in lake.rglob("*.parquet"):
        assert pq.read_schema(path).remove_metadata() == SCHEMA
    rows = lake_rows(lake)
    assert [(r["type"], r["key"]) for r in rows] == [
        ("rewound", None), ("appended", "a"), ("compacted", "b"), ("delivered", "c"), ("acked", "d"), ("expired", "e"),
        ("refused", "f")]
    rewound, compacted, delivered, refused = rows[0], rows[2], rows[3], rows[6]
    assert (compacted["seqno"], compacted["replaced_seqno"], compacted["payload_bytes"]) == (2, 1, None)
    assert (delivered["attempt"], delivered["ts_ms"]) == (2, T0 + 2)
    assert (refused["clientid"], refused["reason"], refused["topic"], refused["seqno"]) == (
        None, "bad_key", "$ECQ/w/c1/+", None)
    assert (rewound["clientid"], rewound["seqno"], rewound["reason"], rewound["publish_ts_ms"]) == (
        "c1", 0, "earliest", None)
    assert recorder.stats() | {"buffered_bytes": 0} == {
        "recorded": 7, "dropped_items": 0, "dropped_bytes": 0, "invalid": 0, "pending_items": 0,
        "buffered_items": 0, "buffered_bytes": 0, "exported_items": 7, "export_errors": 0, "lake_ok": True}


async def test_record_stamps_now_when_no_time_is_given(tmp_path):
    before = time.time_ns() // 1_000_000
    recorder = EventRecorder(tmp_path / "buffer")
    await recorder.start()
    recorder.record("appended", clientid="c1", key="k", seqno=1, publish_ts_ms=before, payload_bytes=1)
    await export_all_from(recorder, tmp_path / "lake")
    (row,) = lake_rows(tmp_path / "lake")
    assert before <= row["ts_ms"] <= time.time_ns() // 1_000_000


async def test_invalid_events_are_counted_and_kept_out_of_the_lake(tmp_path):
    recorder = EventRecorder(tmp_path / "buffer")
    await recorder.start()
    recorder.record("appended", clientid="c1", key="good", seqno=1)
    recorder.record("published", clientid="c1", key="bad-type")
    recorder.record("appended", clientid="c1", key="bad-field", colour="red")
    recorder.record("appended", clientid="c1", key="bad-value", seqno="1")
    recorder.record("appended", clientid="c1", key="bad-bool", seqno=True)
    recorder.record("delivered", clientid="c1", key="bad-range", attempt=2**31)
    recorder.record("refused", clientid="c1", key="bad-unicode\ud800", reason="bad_key")
    recorder.record("appended", ts_ms="now", clientid="c1", key="bad-ts")
    await export_all_from(recorder, tmp_path / "lake")
    assert lake_keys(tmp_path / "lake") == ["good"]
    stats = recorder.stats()
    assert (stats["recorded"], stats["invalid"], stats["exported_items"]) == (8, 7, 1)


async def test_overload_drops_the_oldest_events_and_counts_them(tmp_path):
    buffer_dir = tmp_path / "buffer"
    recorder = EventRecorder(buffer_dir, max_buffer_bytes=20_000)
    await recorder.start()
    keys = record_appends(recorder, 0, 1000)  # ~85 bytes each: 4x the limit
    await recorder.close()
    stats = recorder.stats()
    assert stats["dropped_items"] > 500 and stats["buffered_bytes"] <= 20_000
    assert stats["buffered_items"] + stats["dropped_items"] == 1000

    await export_all(buffer_dir, tmp_path / "lake")
    exported = lake_keys(tmp_path / "lake")
    assert exported == keys[-len(exported):] and len(exported) == stats["buffered_items"]


async def test_the_memory_deque_is_bounded_and_keeps_the_newest(tmp_path):
    recorder = EventRecorder(tmp_path / "buffer", max_pending=100)
    keys = record_appends(recorder, 0, 150)  # not started: nothing moves the deque into the ReplayQ yet
    assert recorder.stats()["pending_items"] == 100 and recorder.stats()["dropped_items"] == 50
    await recorder.start()
    await export_all_from(recorder, tmp_path / "lake")
    assert lake_keys(tmp_path / "lake") == keys[50:]
    recorder.record("appended", clientid="c1", key="after-close")  # ignored and counted, never raises
    assert recorder.stats()["dropped_items"] == 51


async def test_lake_outage_mid_run_loses_and_duplicates_nothing(tmp_path):
    """The lake disappears (unmounted), then is a plain file (read-only stand-in: tests run as root, where
    permissions do not stop writes), then comes back; events keep coming all along."""
    lake, away = tmp_path / "lake", tmp_path / "lake-away"
    recorder = EventRecorder(tmp_path / "buffer")
    await recorder.start()
    exporter = LakeExporter(recorder, lake, batch_items=50, interval_s=0.02, max_backoff_s=0.2)
    await exporter.start()
    keys: list[str] = []

    async def produce(count: int) -> None:
        for _ in range(count // 20):
            keys.extend(record_appends(recorder, len(keys), 20))
            await asyncio.sleep(0.005)

    await produce(400)
    await wait_for(lambda: recorder.stats()["exported_items"] == 400)
    lake.rename(away)
    await produce(400)
    await wait_for(lambda: recorder.stats()["export_errors"] >= 2)
    lake.write_text("not a directory")
    await produce(400)
    errors = recorder.stats()["export_errors"]
    await wait_for(lambda: recorder.stats()["export_errors"] >= errors + 2)
    stats = recorder.stats()
    assert not stats["lake_ok"] and stats["buffered_items"] >= 800 and stats["exported_items"] < 1200
    lake.unlink()
    away.rename(lake)
    await produce(400)
    await wait_for(lambda: recorder.stats()["exported_items"] == 1600)
    await exporter.close()
    await recorder.close()

    assert recorder.stats()["lake_ok"] and recorder.stats()["dropped_items"] == 0
    assert lake_keys(lake) == keys  # each exactly once


async def test_close_is_bounded_while_the_lake_is_down_and_the_events_wait_for_the_next_run(tmp_path):
    lake = tmp_path / "lake"
    lake.write_text("not a directory")
    recorder = EventRecorder(tmp_path / "buffer")
    await recorder.start()
    exporter = LakeExporter(recorder, lake, interval_s=0.02)
    await exporter.start()
    keys = record_appends(recorder, 0, 300)
    started = time.monotonic()
    await exporter.close()
    await recorder.close()
    assert time.monotonic() - started < 6
    assert recorder.stats()["buffered_items"] == 300 and not recorder.stats()["lake_ok"]

    lake.unlink()
    await export_all(tmp_path / "buffer", lake)
    assert lake_keys(lake) == keys


CRASH_AFTER_RENAME = """
import os, sys
from pathlib import Path
from ecq.events.lake import write_batch
from ecq.events.recorder import read_stream_id
from ecq.events.replayq import ReplayQ, ReplayQConfig

buffer_dir, lake, count = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
queue = ReplayQ.open(ReplayQConfig(dir=buffer_dir, fsync="never"))
ref, items = queue.pop(count)  # what LakeExporter does: pop, write_batch (temp, fsync, rename), then ack
write_batch(lake, read_stream_id(buffer_dir), ref, items)
os._exit(9)  # crash after the rename, before the ack
"""


async def test_a_crash_between_rename_and_ack_does_not_duplicate_events(tmp_path):
    buffer_dir, lake = tmp_path / "buffer", tmp_path / "lake"
    keys = await fill_buffer(buffer_dir, 1000)  # from 23:59:00, 100 ms apart: a batch of 1000 spans two hours
    lake.mkdir()
    crash = subprocess.run([sys.executable, "-c", CRASH_AFTER_RENAME, str(buffer_dir), str(lake), "7000"],
                           capture_output=True, timeout=60)
    assert crash.returncode == 9, crash.stderr.decode()
    crash = subprocess.run([sys.executable, "-c", CRASH_AFTER_RENAME, str(buffer_dir), str(lake), "150"],
                           capture_output=True, timeout=60)
    assert crash.returncode == 9, crash.stderr.decode()
    assert len(lake_keys(lake)) == 1150  # the second crash's files overlap the first's: 1000 + 150 rows
    stream = read_stream_id(buffer_dir)
    stray_tmp = lake / "date=2026-01-01" / "hour=00" / f".part-{stream}-0000000001-0000000042.parquet.tmp"
    stray_tmp.write_bytes(b"half a file")

    await export_all(buffer_dir, lake, batch_items=400)  # other batch boundaries than the crashed exports
    assert lake_keys(lake) == keys
    assert not stray_tmp.exists()


CHAOS_EXPORTER = """
import asyncio, sys
from pathlib import Path
from ecq.events import EventRecorder, LakeExporter

async def main():
    recorder = EventRecorder(Path(sys.argv[1]))
    await recorder.start()
    exporter = LakeExporter(recorder, Path(sys.argv[2]), batch_items=int(sys.argv[3]), interval_s=0.001)
    await exporter.start()
    print("started", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.timeout(300)
async def test_kill_9_during_export_loses_and_duplicates_nothing(tmp_path):
    buffer_dir, lake = tmp_path / "buffer", tmp_path / "lake"
    keys = await fill_buffer(buffer_dir, 20_000)
    rng = random.Random(6)
    for _ in range(6):
        batch_items = str(rng.randint(5, 15))  # small batches (many of them), new boundaries after each crash
        with open(tmp_path / "exporter.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-c", CHAOS_EXPORTER, str(buffer_dir), str(lake), batch_items],
                                    stdout=subprocess.PIPE, stderr=log)
        assert proc.stdout.readline() == b"started\n", (tmp_path / "exporter.log").read_text()
        await asyncio.sleep(rng.uniform(0.05, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
    assert 0 < len(lake_keys(lake)) < 20_000, "the kills should land in the middle of the export"

    await export_all(buffer_dir, lake)
    assert lake_keys(lake) == keys


async def test_two_buffers_sharing_a_lake_keep_each_others_files(tmp_path):
    lake = tmp_path / "lake"
    first = await fill_buffer(tmp_path / "buffer-1", 100)
    await export_all(tmp_path / "buffer-1", lake)
    second = await fill_buffer(tmp_path / "buffer-2", 100)  # a wiped data dir: the ReplayQ starts at 1 again
    await export_all(tmp_path / "buffer-2", lake)
    assert lake_keys(lake) == sorted(first + second)
    assert read_stream_id(tmp_path / "buffer-1") != read_stream_id(tmp_path / "buffer-2")


def test_events_buffered_before_kind_and_reader_existed_are_exported_with_them_null(tmp_path):
    """A ReplayQ item written by a broker before the ``kind`` and ``reader`` columns (an 11-value row) is exported
    with both null, beside a new one in the same batch; nothing is lost to the upgrade."""
    from ecq.events.schema import encode_event, events_table

    old = b'[1000,"appended","c1","k",1,1000,3,null,null,null,null]'
    new = encode_event(2000, "acked", {"clientid": "$SCQ/q", "seqno": 1, "kind": "scq", "reader": "r1"})
    for items in ([old], [old, new]):
        rows = events_table(items).to_pylist()
        assert rows[0] == {**dict.fromkeys(COLUMNS), "ts_ms": 1000, "type": "appended", "clientid": "c1", "key": "k",
                           "seqno": 1, "publish_ts_ms": 1000, "payload_bytes": 3}
    assert (rows[1]["kind"], rows[1]["reader"]) == ("scq", "r1")


_FIELD_VALUES = {  # per column: values its rule takes, and values it refuses (a wrong type, out of range)
    **dict.fromkeys(("seqno", "publish_ts_ms", "payload_bytes", "replaced_seqno"),
                    (st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
                     st.one_of(st.booleans(), st.text(max_size=3), st.floats(), st.integers(min_value=2**63)))),
    "attempt": (st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)), st.integers(min_value=2**31)),
    **dict.fromkeys(("clientid", "key", "reason", "topic", "kind", "reader"),
                    (st.one_of(st.none(), st.text(max_size=8)), st.one_of(st.integers(), st.just("lone\ud800")))),
}


@st.composite
def recorded_events(draw, invalid: bool) -> tuple[int, str, dict]:
    """(ts_ms, type, fields) as `EventRecorder.record` keeps an event; with ``invalid`` one value or name is wrong."""
    fields = {name: draw(_FIELD_VALUES[name][0]) for name in draw(st.sets(st.sampled_from(sorted(_FIELD_VALUES))))}
    event = [draw(st.integers(-(2**63), 2**63 - 1)), draw(st.sampled_from(sorted(EVENT_TYPES))), fields]
    if invalid:
        wrong = draw(st.sampled_from(["ts_ms", "type", "field", *_FIELD_VALUES]))
        if wrong == "ts_ms":
            event[0] = draw(st.one_of(st.none(), st.booleans(), st.integers(min_value=2**63)))
        elif wrong == "type":
            event[1] = "published"
        elif wrong == "field":
            fields["colour"] = "red"
        else:
            fields[wrong] = draw(_FIELD_VALUES[wrong][1])
    return tuple(event)


@settings(max_examples=150, deadline=None)
@given(events=st.lists(recorded_events(invalid=False), max_size=20),
       bad=st.lists(recorded_events(invalid=True), max_size=1), at=st.integers(0, 20))
def test_a_batch_encodes_as_its_events_one_by_one_and_refuses_any_invalid_one(events, bad, at):
    """The recorder's batch encoding (`encode_events`, column by column) gives each event's `encode_event` bytes, and
    refuses a batch holding one event `encode_event` refuses, so that the recorder encodes that batch one by one."""
    assert encode_events(events) == [encode_event(*event) for event in events]
    if bad:
        with pytest.raises(InvalidEvent):
            encode_event(*bad[0])
        with pytest.raises(InvalidEvent):
            encode_events([*events[:at], bad[0], *events[at:]])
