"""The data directory's layout (ecq/store/layout.py), with real `ecq broker` processes, the real LevelDB and
a real event buffer and lake: a fresh start makes queues/, events/ and lake/; the old layout (LevelDB's files
directly in data_dir) is moved into queues/ on start, also when a move was interrupted, and its consumers then
get exactly what they had not acked; conflicting layouts and a LevelDB in use are refused with nothing moved;
`ecq status|inspect|repair --data-dir` read either layout."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from ecq.events import EventRecorder, LakeExporter
from ecq.queue.clock import now_ms
from ecq.store.leveldb import LevelDbStore
from ecq.store.protocol import AckState, Append, SaveAck
from ecq.store.layout import MIGRATING, LayoutError, leveldb_files, migrate
from tests.harness import ECQ, BrokerProcess, drain, free_port, wait_until

START_BOUND_S = 30  # `ecq broker` must have exited (or be running) within this
KEYS = ("k1", "k2", "k3", "k4", "k5")  # written to the queue of "old1"; k1 and k2 acked


def make_old_layout(data_dir: Path) -> None:
    """What the broker left in ``data_dir`` before this layout: LevelDB's files at the top (a queue "old1" of
    KEYS with the first two acked, in .ldb tables and a .log), the event buffer in events/ holding one event
    not yet exported (key "buffered"), and the lake in lake/ holding one exported event (key "exported")."""
    store = LevelDbStore(data_dir)
    appended = store.commit([Append("old1", key, f"value-{key}".encode(), now_ms()) for key in KEYS])
    store.close()
    store = LevelDbStore(data_dir)  # the reopen turns the log into a table file; the ack goes to a new log
    store.commit([SaveAck("old1", AckState(acked=appended[1].seqno))])
    store.close()
    asyncio.run(_old_events(data_dir / "events", data_dir / "lake"))
    assert {"CURRENT", "LOCK"} <= set(leveldb_files(data_dir))
    assert any(name.endswith(".ldb") for name in leveldb_files(data_dir))


async def _old_events(buffer_dir: Path, lake: Path) -> None:
    recorder = EventRecorder(buffer_dir)
    await recorder.start()
    recorder.record("appended", ts_ms=now_ms(), clientid="old1", key="exported", seqno=1, publish_ts_ms=now_ms(),
                    payload_bytes=1)
    exporter = LakeExporter(recorder, lake, interval_s=0.02)
    await exporter.start()
    await exporter.close()
    recorder.record("appended", ts_ms=now_ms(), clientid="old1", key="buffered", seqno=2, publish_ts_ms=now_ms(),
                    payload_bytes=1)
    await recorder.close()


def lake_keys(lake: Path) -> list[str]:
    """Keys of the lake's events, one per event, sorted (hidden temp files skipped)."""
    if not any(lake.rglob("*.parquet")):
        return []
    table = ds.dataset(lake, format="parquet", partitioning="hive").to_table(columns=["key"])
    return sorted(key for key in table.column("key").to_pylist() if key is not None)


def run_broker(broker: BrokerProcess) -> subprocess.CompletedProcess:
    """`ecq broker` in the foreground, for a start that must fail."""
    return subprocess.run([ECQ, "broker", "-c", str(broker.config_path)], capture_output=True, text=True,
                          timeout=START_BOUND_S, cwd=broker.workdir)


def ecq(*args: str) -> subprocess.CompletedProcess:
    """An `ecq` command; status and inspect get an admin address where no broker answers."""
    admin = ["--admin", f"127.0.0.1:{free_port()}"] if args[0] in ("status", "inspect") else []
    return subprocess.run([ECQ, *args, *admin], capture_output=True, text=True, timeout=60)


def assert_moved(data_dir: Path) -> None:
    assert leveldb_files(data_dir) == [] and not (data_dir / MIGRATING).exists()
    assert (data_dir / "queues" / "CURRENT").exists()


def assert_unacked_delivered(connect, broker: BrokerProcess) -> None:
    assert drain(connect, broker.port, "old1", 3) == [(f"$ECQ/old1/{key}", f"value-{key}".encode())
                                                      for key in KEYS[2:]]


def test_a_fresh_start_makes_the_three_subdirectories(broker_process):
    broker = broker_process().start()
    data_dir = broker.data_dir
    assert sorted(p.name for p in data_dir.iterdir()) == ["events", "lake", "queues"]
    assert (data_dir / "queues" / "CURRENT").exists() and (data_dir / "events" / "lake-stream-id").exists()


def test_the_old_layout_is_moved_on_start_and_its_queues_resume(broker_process, connect):
    broker = broker_process(lake_file_age="200ms")  # the lake is read while the broker runs
    make_old_layout(broker.data_dir)
    moved = leveldb_files(broker.data_dir)

    broker.start()
    assert_moved(broker.data_dir)
    queues = broker.data_dir / "queues"
    assert f"moved {len(moved)} LevelDB entries of the old layout into {queues}: {' '.join(moved)}\n" in broker.log()
    assert_unacked_delivered(connect, broker)
    lake = broker.data_dir / "lake"
    assert wait_until(lambda: "buffered" in lake_keys(lake), 10), broker.log()  # the old buffer, exported
    assert [key for key in lake_keys(lake) if key in ("buffered", "exported")] == ["buffered", "exported"]


@pytest.mark.parametrize("moved_before", ["some files", "every file"])
def test_an_interrupted_move_is_finished_on_the_next_start(broker_process, connect, moved_before):
    broker = broker_process(events=False)
    make_old_layout(broker.data_dir)
    names = leveldb_files(broker.data_dir)
    partial = broker.data_dir / MIGRATING
    partial.mkdir()
    for name in names:
        if moved_before == "every file" or name == "CURRENT" or name.endswith(".ldb"):
            (broker.data_dir / name).rename(partial / name)

    broker.start()
    assert_moved(broker.data_dir)
    assert "finishing the move of LevelDB's files" in broker.log()
    assert_unacked_delivered(connect, broker)


def test_both_layouts_at_once_are_refused_and_nothing_moves(broker_process):
    broker = broker_process(events=False)
    make_old_layout(broker.data_dir)
    LevelDbStore(broker.data_dir / "queues").close()
    before = leveldb_files(broker.data_dir)

    result = run_broker(broker)
    assert result.returncode == 1, result.stderr
    assert f"holds LevelDB files both in {broker.data_dir / 'queues'} (this layout) and in {broker.data_dir}" in result.stderr
    assert "Traceback" not in result.stderr
    assert leveldb_files(broker.data_dir) == before and not (broker.data_dir / MIGRATING).exists()


def test_an_old_layout_in_use_is_not_moved(broker_process):
    broker = broker_process(events=False)
    make_old_layout(broker.data_dir)
    store = LevelDbStore(broker.data_dir)  # a broker of the old layout still running: it holds LevelDB's lock
    try:
        before = leveldb_files(broker.data_dir)
        result = run_broker(broker)
        after = leveldb_files(broker.data_dir)
    finally:
        store.close()
    assert result.returncode == 1, result.stderr
    assert "it is in use (is a broker running?)" in result.stderr and "Traceback" not in result.stderr
    assert after == before and not (broker.data_dir / "queues").exists() and not (broker.data_dir / MIGRATING).exists()


def offline_reads(data_dir: Path) -> tuple[int, int]:
    """(messages, acked of old1) as `ecq status` and `ecq inspect` read them from ``data_dir`` offline."""
    status = ecq("status", "--json", "--data-dir", str(data_dir))
    assert status.returncode == 0, status.stderr
    inspect = ecq("inspect", "old1", "--json", "--data-dir", str(data_dir))
    assert inspect.returncode == 0, inspect.stderr
    return json.loads(status.stdout)["messages"], json.loads(inspect.stdout)["acked"]


def test_offline_status_inspect_and_repair_read_both_layouts_in_place(broker_process, connect):
    broker = broker_process(events=False)
    data_dir = broker.data_dir
    make_old_layout(data_dir)
    assert offline_reads(data_dir) == (5, 2)
    repaired = ecq("repair", "--data-dir", str(data_dir))
    assert repaired.returncode == 0 and repaired.stdout.startswith(f"repaired {data_dir}: "), repaired.stderr
    assert "CURRENT" in leveldb_files(data_dir) and not (data_dir / "queues").exists()  # read in place

    partial = data_dir / MIGRATING
    partial.mkdir()
    (data_dir / "CURRENT").rename(partial / "CURRENT")
    interrupted = ecq("status", "--data-dir", str(data_dir))
    assert interrupted.returncode == 3 and "start the broker once to finish it" in interrupted.stderr

    broker.start()
    assert_moved(data_dir)
    assert broker.stop() == 0
    assert offline_reads(data_dir) == (5, 2)
    repaired = ecq("repair", "--data-dir", str(data_dir))
    assert repaired.returncode == 0 and repaired.stdout.startswith(f"repaired {data_dir / 'queues'}: ")
    broker.start()
    assert_unacked_delivered(connect, broker)


def test_jetstream_keeps_only_events_and_lake_in_the_data_dir(jetstream_options, broker_process):
    broker = broker_process(**jetstream_options).start()
    assert sorted(p.name for p in broker.data_dir.iterdir()) == ["events", "lake"]


def test_a_data_dir_that_is_a_queues_directory_is_not_moved_into_itself(tmp_path):
    queues = tmp_path / "data" / "queues"
    LevelDbStore(queues).close()
    before = leveldb_files(queues)
    with pytest.raises(LayoutError, match=f"looks like the LevelDB directory of data_dir {queues.parent}"):
        migrate(queues)
    assert leveldb_files(queues) == before and not (queues / "queues").exists()
