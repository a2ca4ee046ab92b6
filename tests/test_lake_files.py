"""Lake file sizing: the exporter gathers events into files bounded by rows, bytes and age instead of one
file per export interval; a stop flushes what waits. Real recorder, real ReplayQ on disk, real Parquet
files; the last test runs a real broker process over TCP."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from ecq.broker.observers import lake_file_bytes
from ecq.config import EcqSettings
from ecq.events import EventRecorder, LakeExporter
from tests.test_events import lake_keys, wait_for

T_MID_HOUR = 1_767_227_400_000  # 2026-01-01T00:30:00Z: a few minutes of events stay in one hour partition


def lake_files(lake: Path) -> list[Path]:
    """The visible Parquet files of the lake, oldest batch first (names carry the ReplayQ position)."""
    return sorted(lake.glob("date=*/hour=*/*.parquet"), key=lambda path: path.name)


def rows_per_file(lake: Path) -> list[int]:
    return [pq.ParquetFile(path).metadata.num_rows for path in lake_files(lake)]


def record_trickle(recorder: EventRecorder, first: int, count: int) -> list[str]:
    """``count`` appended events with unique keys, stamped in the middle of an hour."""
    keys = []
    for i in range(first, first + count):
        key = f"k{i:06d}"
        recorder.record("appended", ts_ms=T_MID_HOUR + i, clientid="c1", key=key, seqno=i + 1,
                        publish_ts_ms=T_MID_HOUR + i, payload_bytes=100)
        keys.append(key)
    return keys


async def started(tmp_path: Path, **exporter_options) -> tuple[EventRecorder, LakeExporter]:
    recorder = EventRecorder(tmp_path / "buffer")
    await recorder.start()
    exporter = LakeExporter(recorder, tmp_path / "lake", interval_s=0.05, **exporter_options)
    await exporter.start()
    return recorder, exporter


async def stop(recorder: EventRecorder, exporter: LakeExporter) -> None:
    await exporter.close()
    await recorder.close()


async def test_events_over_a_few_seconds_land_in_one_file_not_one_per_interval(tmp_path):
    recorder, exporter = await started(tmp_path, max_age_s=4.0)
    keys: list[str] = []
    started_at = time.monotonic()
    while time.monotonic() - started_at < 2.0:  # 40 export intervals with events in each
        keys += record_trickle(recorder, len(keys), 25)
        await asyncio.sleep(0.05)
    await wait_for(lambda: recorder.stats()["exported_items"] == len(keys), timeout=20)
    assert rows_per_file(tmp_path / "lake") == [len(keys)]
    await stop(recorder, exporter)
    assert lake_keys(tmp_path / "lake") == keys


async def test_the_row_bound_cuts_files_and_close_flushes_the_rest(tmp_path):
    recorder, exporter = await started(tmp_path, batch_items=100, max_age_s=3600.0)
    keys = record_trickle(recorder, 0, 250)
    await wait_for(lambda: recorder.stats()["exported_items"] == 200)
    assert rows_per_file(tmp_path / "lake") == [100, 100]
    assert recorder.stats()["buffered_items"] == 50  # less than a file's worth waits for the age bound
    await stop(recorder, exporter)
    assert rows_per_file(tmp_path / "lake") == [100, 100, 50]
    assert lake_keys(tmp_path / "lake") == keys


async def test_the_byte_bound_cuts_files(tmp_path):
    recorder, exporter = await started(tmp_path, batch_bytes=20_000, max_age_s=3600.0)
    keys = record_trickle(recorder, 0, 1000)  # about 80 bytes each, 80 kB in all
    await wait_for(lambda: recorder.stats()["buffered_items"] < 400)
    await stop(recorder, exporter)
    sizes = rows_per_file(tmp_path / "lake")
    assert len(sizes) >= 3 and max(sizes) < 400 and sum(sizes) == 1000
    assert lake_keys(tmp_path / "lake") == keys


async def test_the_age_bound_flushes_a_trickle(tmp_path):
    recorder, exporter = await started(tmp_path, max_age_s=1.0)
    keys: list[str] = []
    first_file_after = None
    started_at = time.monotonic()
    while time.monotonic() - started_at < 3.5:  # one event every 100 ms, far below the row bound
        keys += record_trickle(recorder, len(keys), 1)
        if first_file_after is None and lake_files(tmp_path / "lake"):
            first_file_after = time.monotonic() - started_at
        await asyncio.sleep(0.1)
    files_while_running = len(lake_files(tmp_path / "lake"))
    await stop(recorder, exporter)
    assert first_file_after is not None and first_file_after < 3.0, "the age bound should have written a file"
    assert 2 <= files_while_running <= 5, f"{files_while_running} files for 3.5 s at a 1 s age bound"
    assert lake_keys(tmp_path / "lake") == keys


def test_the_file_options_are_validated_and_the_byte_bound_stays_below_the_buffer():
    settings = EcqSettings()
    assert (settings.lake_file_rows, settings.lake_file_bytes, settings.lake_file_age) == (1_000, 64 << 20, 60.0)
    assert lake_file_bytes(settings) == 64 << 20
    assert lake_file_bytes(EcqSettings(events_max_bytes=16 << 20)) == 4 << 20
    assert EcqSettings(lake_file_age="5m").lake_file_age == 300.0
    for bad in ({"lake_file_rows": 0}, {"lake_file_bytes": 10}, {"lake_file_age": "0s"}, {"lake_file_rows": "9"}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            EcqSettings(**bad)


@pytest.mark.timeout(120)
def test_a_broker_stop_flushes_the_events_still_waiting_for_a_file(make_broker, connect, tmp_path):
    lake = tmp_path / "lake"
    broker = make_broker(lake_dir=str(lake), export_interval="100ms")  # lake_file_age: the default minute
    producer = connect(broker.port, "producer")
    infos = producer.publish_many([(f"$ECQ/w/dev/k{i:03d}", b"v") for i in range(50)])
    assert all(info.is_published() for info in infos)
    time.sleep(1.0)  # ten export intervals: with one file per interval the lake would have them by now
    assert lake_files(lake) == []
    assert broker.stop() == 0
    assert len(lake_files(lake)) == 1
    assert sorted(key for key in lake_keys(lake)) == [f"k{i:03d}" for i in range(50)]
