"""A bad disk is reported, not hidden. Real `ecq broker` processes on real LevelDB directories:
damaged .ldb/.log files stop start-up (exit 1) until `ecq repair`; a block damaged while the broker runs
stops that queue's delivery with one log line and a metric; a full disk degrades health and the broker
recovers by itself once space is freed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ecq.store import committed
from ecq.store.protocol import Append
from ecq.store.leveldb import LevelDbStore as Store
from tests.harness import ECQ, BrokerProcess, Client, drain, metrics_text, wait_until, write

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


def crash_image(store: Store, leveldb_dir: Path) -> None:
    """Copy the files of the open ``store`` into ``leveldb_dir``: what a kill -9 (or a power cut after the
    page cache reached the disk) would leave of it."""
    shutil.copytree(store.path, leveldb_dir, dirs_exist_ok=True)


def ten_writes_and_a_cut_log(store: Store, leveldb_dir: Path) -> Path:
    for i in range(10):
        store.commit([Append("d4", f"k{i}", os.urandom(5000), 1_700_000_000_000 + i)])
    crash_image(store, leveldb_dir)
    store.close()
    log_file = next(leveldb_dir.glob("*.log"))
    os.truncate(log_file, log_file.stat().st_size - 1000)
    return log_file


def test_a_log_cut_by_a_crash_is_reported(tmp_path, connect, broker_process, monkeypatch):
    """LevelDB, even with paranoid_checks, opens a log that ends inside a record (it takes it for a write
    cut by a crash) and drops that record: the broker starts and names the file and the bytes cut. A crash
    came before ECQ-COMMITTED had claimed that write, so nothing says it was acknowledged."""
    monkeypatch.setattr(committed, "CHECKPOINT_INTERVAL_S", 3600.0)  # no checkpoint before the crash
    broker = broker_process(data_retention="3650d")
    log_file = ten_writes_and_a_cut_log(Store(tmp_path / "live"), broker.queues_dir)

    broker.start()
    assert f"LevelDB log {log_file} ends inside a record (" in broker.log()
    assert "lost writes" not in broker.log()
    consumer = connect(broker.port, "d4")
    assert consumer.subscribe("$ECQ/d4/#") == 1
    assert len(consumer.expect(9)) == 9 and consumer.quiet(1.0) == []  # the cut last write is gone


def test_a_log_cut_after_a_clean_stop_stops_start_up(tmp_path, broker_process):
    """After a clean stop ECQ-COMMITTED claims every committed write: the one the cut takes is named."""
    broker = broker_process(data_retention="3650d")
    store = Store(broker.queues_dir)
    for i in range(10):
        store.commit([Append("d4", f"k{i}", os.urandom(5000), 1_700_000_000_000 + i)])
    store.close()
    log_file = next(broker.queues_dir.glob("*.log"))
    os.truncate(log_file, log_file.stat().st_size - 1000)

    result = run_broker(broker)
    assert result.returncode == 1
    assert "lost writes that ECQ had committed and acknowledged" in result.stderr
    assert "queue 'd4' seqno 10;" in result.stderr


# --- a LevelDB log lost while the broker is stopped -----------------------------------------------------

LOST = re.compile(r"queue 'lw' seqnos (\d+)-3000 \((\d+)\)")


def write_3000(broker: BrokerProcess, connect) -> None:
    """3,000 PUBACKed writes of 2 KB to the queue ``lw``, distinct keys: more than LevelDB's 4 MiB memtable, so
    the first ones are in a table file and the rest only in the log."""
    producer = connect(broker.port, "lw-producer")
    infos = producer.publish_many([(f"$ECQ/w/lw/k{i}", os.urandom(2048)) for i in range(3000)], timeout=60)
    assert all(info.is_published() for info in infos)


@pytest.mark.parametrize("lose", ["truncate", "rm"])
def test_a_lost_log_stops_start_up_until_repair_accepts_the_loss(tmp_path, connect, broker_process, lose):
    broker = broker_process(data_retention="3650d").start()
    write_3000(broker, connect)
    assert broker.stop() == 0
    [log_file] = broker.queues_dir.glob("*.log")
    if lose == "truncate":
        os.truncate(log_file, 0)
    else:
        log_file.unlink()

    result = run_broker(broker)
    assert result.returncode == 1
    assert "lost writes that ECQ had committed and acknowledged" in result.stderr
    assert (lost := LOST.search(result.stderr)), result.stderr
    first_lost, count = int(lost[1]), int(lost[2])
    assert 1 < first_lost and count == 3001 - first_lost
    assert f"`ecq repair --data-dir {broker.data_dir}` accepts the loss" in result.stderr
    assert "Traceback" not in result.stderr

    repaired = repair(broker.data_dir)
    assert repaired.returncode == 0, repaired.stderr
    assert f"accepted the loss of writes ECQ had committed: queue 'lw' seqnos {first_lost}-3000 ({count})" \
        in repaired.stdout
    broker.start()
    assert len(drain(connect, broker.port, "lw", first_lost - 1)) == first_lost - 1
    assert broker.stop() == 0
    assert run_broker_briefly(broker)  # the loss is accepted once, not at every start


def run_broker_briefly(broker: BrokerProcess) -> bool:
    """Start the broker once more; True when it came up (then it is stopped again)."""
    broker.start()
    return broker.stop() == 0


def test_kill_9_under_writes_is_no_lost_log(tmp_path, connect, broker_process):
    """ECQ-COMMITTED claims only seqnos whose LevelDB log was fsynced first: a kill -9 between two of its
    checkpoints, with writes in flight, leaves LevelDB holding at least that, so the broker starts."""
    broker = broker_process(data_retention="3650d").start()
    producer = connect(broker.port, "lw-producer")
    acked, stop = [], threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set():
            infos = producer.publish_many([(f"$ECQ/w/lw9/k{i + j}", os.urandom(2048)) for j in range(50)], timeout=5)
            acked.extend(i + j for j, info in enumerate(infos) if info.is_published())
            i += 50

    writer = threading.Thread(target=produce)
    writer.start()
    try:
        assert wait_until(lambda: len(acked) >= 4000, 60)  # several checkpoints and a memtable flush
        broker.kill()
    finally:
        stop.set()
        writer.join(30)
    broker.start()
    assert "lost writes" not in broker.log()
    consumer = connect(broker.port, "lw9")
    assert consumer.subscribe("$ECQ/lw9/#") == 1
    keys: set[str] = set()
    assert wait_until(lambda: keys.update(m.topic.rsplit("/", 1)[1] for m in consumer.quiet(0.2))
                      or keys >= {f"k{i}" for i in acked}, 60)


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
