"""A bad disk is reported, not hidden. Real `ecq broker` processes on real LevelDB directories:
damaged .ldb/.log files stop start-up (exit 1) until `ecq repair`; a block damaged while the broker runs
stops that queue's delivery with one log line and a metric; a full disk degrades health and the broker
recovers by itself once space is freed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ecq.queue.store import Append
from ecq.queue.leveldb import LevelDbStore as Store
from tests.harness import ECQ, BrokerProcess, Client, metrics_text, wait_until, write

START_BOUND_S = 30  # `ecq broker` must have exited (or be running) within this


def fill_store(leveldb_dir: Path, clientid: str, count: int, size: int) -> None:
    """``count`` writes of ``size`` bytes to ``clientid``'s queue, then a reopen so that LevelDB moves
    its log into .ldb table files."""
    store = Store(leveldb_dir)
    for start in range(0, count, 100):
        store.commit([Append(clientid, f"k{i}", os.urandom(size), 1_700_000_000_000 + i)
                      for i in range(start, min(count, start + 100))])
    store.close()
    Store(leveldb_dir).close()


def run_broker(broker: BrokerProcess) -> subprocess.CompletedProcess:
    return subprocess.run([ECQ, "broker", "-c", str(broker.config_path)], capture_output=True, text=True,
                          timeout=START_BOUND_S, cwd=broker.workdir)


def ldb_files(leveldb_dir: Path) -> list[Path]:
    return sorted(leveldb_dir.glob("*.ldb"))


def overwrite(path: Path, start: int, end: int) -> None:
    with path.open("r+b") as f:
        f.seek(start)
        f.write(b"\xa5" * (end - start))


def repair(data_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([ECQ, "repair", "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=60)


def test_garbage_in_a_table_file_stops_start_up_until_repair(tmp_path, connect, broker_process):
    broker = broker_process(data_retention="3650d")
    fill_store(broker.queues_dir, "d1", 3000, 2000)
    table = ldb_files(broker.queues_dir)[0]
    overwrite(table, 100, 20_000)

    result = run_broker(broker)
    assert result.returncode == 1
    assert "is corrupt: Corruption: block checksum mismatch" in result.stderr
    assert f"ecq repair --data-dir {broker.data_dir}" in result.stderr
    assert "Traceback" not in result.stderr

    repaired = repair(broker.data_dir)
    assert repaired.returncode == 0, repaired.stderr
    store = Store(broker.queues_dir)
    kept, _bytes = store.stored_totals()
    store.close()
    assert 0 < kept < 3000 and f"{kept} queue entries" in repaired.stdout  # the damaged block's rows are gone
    broker.start()
    consumer = connect(broker.port, "d1")
    assert consumer.subscribe("$ECQ/d1/#") == 1
    assert len(consumer.expect(kept, timeout=30)) == kept


def test_truncated_table_file_is_named(tmp_path, broker_process):
    broker = broker_process()
    fill_store(broker.queues_dir, "d2", 3000, 2000)
    table = ldb_files(broker.queues_dir)[0]
    os.truncate(table, table.stat().st_size // 2)

    result = run_broker(broker)
    assert result.returncode == 1
    assert f"{table}: Invalid argument" in result.stderr
    assert "Traceback" not in result.stderr
    assert repair(broker.data_dir).returncode == 0
    broker.start()


def test_garbage_in_the_log_stops_start_up(tmp_path, broker_process):
    broker = broker_process()
    store = Store(broker.queues_dir)
    store.commit([Append("d3", f"k{i}", b"v" * 1000, 1_700_000_000_000) for i in range(200)])
    store.close()  # the writes are in the .log only
    log_file = next(broker.queues_dir.glob("*.log"))
    overwrite(log_file, log_file.stat().st_size // 3, log_file.stat().st_size // 3 + 64)

    result = run_broker(broker)
    assert result.returncode == 1
    assert "is corrupt: Corruption: checksum mismatch" in result.stderr
    assert "Traceback" not in result.stderr
    assert repair(broker.data_dir).returncode == 0
    broker.start()


def test_cut_log_is_reported(tmp_path, connect, broker_process):
    """LevelDB, even with paranoid_checks, opens a log that ends inside a record (it takes it for a write
    cut by a crash) and drops that record: the broker starts and names the file and the bytes cut."""
    broker = broker_process(data_retention="3650d")
    store = Store(broker.queues_dir)
    for i in range(10):
        store.commit([Append("d4", f"k{i}", os.urandom(5000), 1_700_000_000_000 + i)])
    store.close()
    log_file = next(broker.queues_dir.glob("*.log"))
    os.truncate(log_file, log_file.stat().st_size - 1000)

    broker.start()
    assert f"LevelDB log {log_file} ends inside a record (" in broker.log()
    consumer = connect(broker.port, "d4")
    assert consumer.subscribe("$ECQ/d4/#") == 1
    assert len(consumer.expect(9)) == 9 and consumer.quiet(1.0) == []  # the cut last write is gone


def test_block_damaged_at_run_time_stops_that_queue_once(tmp_path, connect, broker_process):
    broker = broker_process(data_retention="3650d", read_timeout="200ms")
    fill_store(broker.queues_dir, "bad", 3000, 2000)
    broker.start()
    for table in ldb_files(broker.queues_dir):  # the data blocks; the index blocks at the end are already loaded
        overwrite(table, 0, table.stat().st_size * 3 // 4)

    consumer = connect(broker.port, "bad")
    assert consumer.subscribe("$ECQ/bad/#") == 1
    stopped = "ECQ delivery of bad stopped: cannot read its queue"
    assert wait_until(lambda: stopped in broker.log(), 10)
    assert 'ecq_store_errors_total{op="read"} 1.0' in metrics_text(broker)
    consumer.quiet(2.0)  # two heartbeats and ten read timeouts: no retry, no second line
    assert broker.log().count(stopped) == 1 and "ECQ read for bad failed" not in broker.log()
    assert "Corruption: block checksum mismatch" in broker.log()

    other = connect(broker.port, "fine")  # the broker itself goes on
    write(other, "fine", "k", "v")
    assert other.subscribe("$ECQ/fine/#") == 1
    assert other.expect(1)[0].payload == b"v"


# --- disk full -------------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path, request):
    """``tmp_path/data`` on a tmpfs of ``request.param`` (a mount size such as ``64m``; unmounted at teardown)."""
    mount_point = tmp_path / "data"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {result.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill_disk(directory: Path, leave_bytes: int) -> Path:
    """A file taking all free space of ``directory``'s filesystem but ``leave_bytes``."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError:
        pass
    os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave_bytes))
    os.close(fd)
    return filler


def health(broker: BrokerProcess) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{broker.admin_port}/api/v1/health", timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def try_write(port: int, key: str, payload: bytes) -> bool:
    """One QoS 1 write from a fresh connection; True when it was PUBACKed within 3 s."""
    client = Client(port, f"filler-{key}")
    try:
        client.publish(f"$ECQ/w/full/{key}", payload, timeout=3)
        return True
    except TimeoutError:
        return False
    finally:
        client.close()


@pytest.mark.parametrize("small_disk", ["64m", "20m"], indirect=True)
def test_full_disk_degrades_then_recovers_when_space_is_freed(small_disk, tmp_path, connect, broker_process):
    """On a 20 MB volume the room LevelDB would like for a reopen (twice its log plus 8 MiB, about 16 MB) can
    never be free: the broker reopens with what such a volume can give, and says what it waits for."""
    broker = broker_process(data_retention="3650d").start()
    assert broker.data_dir == small_disk
    producer = connect(broker.port, "p")
    for i in range(350):  # ~3.6 MB: LevelDB's 4 MB memtable is nearly full
        write(producer, "full", f"a{i}", os.urandom(10_000))
    filler = fill_disk(small_disk, leave_bytes=1 << 20)

    refused = 0
    for i in range(200):  # the memtable flush and then the log run out of space
        if not try_write(broker.port, f"b{i}", os.urandom(10_000)):
            refused += 1
            if refused == 3:
                break
    assert refused == 3, "writes were still acknowledged on a full disk"
    status, body = health(broker)
    assert status == 503 and body["status"] == "degraded" and "No space left on device" in body["reason"]
    assert 'ecq_store_errors_total{op="write"}' in metrics_text(broker)
    waiting = re.compile(r"ECQ store writes stay suspended \(.*No space left on device.*\) until LevelDB at "
                         r"\S+ can be reopened: [\d.]+ MiB free needed, [\d.]+ MiB free now on a volume of ")
    assert wait_until(lambda: waiting.search(broker.log()), 5), broker.log()

    filler.unlink()
    assert wait_until(lambda: try_write(broker.port, "after", b"back"), 20, 0.2), broker.log()
    assert health(broker) == (200, {"status": "ok"})
    assert "ECQ store reopened after failed writes" in broker.log()

    consumer = connect(broker.port, "full")
    assert consumer.subscribe("$ECQ/full/#") == 1
    got = []
    assert wait_until(lambda: got.extend(m.payload for m in consumer.quiet(0.2)) or b"back" in got, 30)
    assert wait_until(lambda: queue(broker, "full")["pending"] == 0, 20)  # every PUBACK came
    assert broker.stop() == 0  # commits the latest ack state, which must work again
    assert "saving the state of consumer full failed" not in broker.log().split("store reopened")[-1]
    store = Store(broker.queues_dir)
    try:
        assert store.ack_state("full").acked == store.last_seqno("full")
    finally:
        store.close()


def queue(broker: BrokerProcess, clientid: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.admin_port}/api/v1/queues/{clientid}", timeout=10) as r:
        return json.load(r)


def test_repair_refuses_a_store_in_use(broker):
    result = repair(broker.data_dir)
    assert result.returncode == 1
    assert f"LevelDB at {broker.queues_dir} is in use (is a broker running?)" in result.stderr
