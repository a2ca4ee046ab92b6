"""ReplayQ: modes, acks, segments, COMMIT, corruption, crashes, overload, config."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from ecq.events.replayq import AckRef, Dropped, ReplayQ, ReplayQError
from ecq.events.segments import MAGIC

REPO = Path(__file__).resolve().parent.parent
HEADER = 12  # magic, CRC32, length


def items(n: int, size: int = 40, start: int = 0) -> list[bytes]:
    return [f"{i:0{size}d}".encode() for i in range(start, start + n)]


OPENED: list[ReplayQ] = []


@pytest.fixture(autouse=True)
def close_opened_queues():
    yield
    while OPENED:
        OPENED.pop().close()


def open_q(path: Path | None, **options) -> ReplayQ:
    """Open a queue (fsync="never" unless given) that is closed at the end of the test."""
    q = ReplayQ.open({"dir": path, "fsync": "never", **options} if path else options)
    OPENED.append(q)
    return q


def segment_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("*.seg"))


def append_each(q: ReplayQ, batch: list[bytes]) -> None:
    """One append per item, so segments fill up item by item (a batch never spans segments)."""
    for item in batch:
        q.append([item])


def drain(q: ReplayQ) -> list[bytes]:
    _, out = q.pop()
    return out


def run_and_crash(script: str) -> None:
    """Run ``script`` in a child Python that ends by SIGKILLing itself (a crash, no close)."""
    code = textwrap.dedent(script) + "\nimport os, signal; os.kill(os.getpid(), signal.SIGKILL)\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


# --- modes and the API ---------------------------------------------------------------------------


def test_memory_only_has_the_same_api_and_touches_no_disk(tmp_path):
    q = ReplayQ.open({})
    q.append([b"a", b"bb", b"ccc"])
    assert (q.count(), q.bytes(), q.is_writing_to_disk()) == (3, 6, False)
    ref, out = q.pop(count_limit=2)
    assert out == [b"a", b"bb"] and (q.count(), q.bytes()) == (1, 3)
    q.ack(ref)
    assert drain(q) == [b"ccc"]
    q.close()
    q.close()
    with pytest.raises(ReplayQError, match="closed"):
        q.append([b"x"])
    assert ReplayQ.open({"mem_only": True}).count() == 0


def test_pop_limits_hand_out_at_least_one_item(tmp_path):
    q = open_q(tmp_path)
    q.append([b"x" * 10, b"y" * 10, b"z" * 30])
    assert q.pop(bytes_limit=5)[1] == [b"x" * 10]
    assert q.pop(bytes_limit=39, count_limit=5)[1] == [b"y" * 10]
    assert q.pop(count_limit=1, bytes_limit=1000)[1] == [b"z" * 30]
    for bad in ({"count_limit": 0}, {"bytes_limit": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            q.pop(**bad)


def test_popping_twice_without_ack_hands_out_the_next_items_and_restart_repeats_unacked(tmp_path):
    q = open_q(tmp_path, seg_bytes=100)
    append_each(q, items(7))
    ref1, first = q.pop(count_limit=3)
    ref2, second = q.pop(count_limit=3)
    assert first + second == items(6) and q.count() == 1
    q.ack(ref1)
    q.close()
    q = open_q(tmp_path, seg_bytes=100)
    assert q.count() == 4 and drain(q) == items(4, start=3)


def test_ack_refs_are_immutable_cumulative_and_checked(tmp_path):
    q = open_q(tmp_path)
    empty_ref, nothing = q.pop()
    assert nothing == []
    q.ack(empty_ref)
    q.append(items(6))
    ref1, _ = q.pop(count_limit=2)
    ref2, _ = q.pop(count_limit=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref1.id = 5
    with pytest.raises(ValueError, match="not handed out"):
        q.ack(AckRef(ref2.segno, ref2.id + 1))
    with pytest.raises(ValueError, match="not handed out"):
        q.ack(AckRef(ref1.segno, ref1.id + 1))
    with pytest.raises(TypeError):
        q.ack((ref1.segno, ref1.id))
    q.ack(ref2)
    q.ack(ref1)
    q.ack(ref2)
    q.close()
    q = open_q(tmp_path)
    ref3, rest = q.pop()
    assert rest == items(2, start=4)
    with pytest.raises(ValueError, match="not handed out"):
        q.ack(AckRef(ref3.segno, ref3.id - 1))


def test_disk_items_are_framed_in_numbered_segments_and_acked_segments_deleted(tmp_path):
    q = open_q(tmp_path, seg_bytes=100)  # two 52-byte frames fill a segment
    for item in items(10):
        q.append([item])
        assert q.is_writing_to_disk()
    assert segment_files(tmp_path) == [f"{n:010d}.seg" for n in range(1, 6)]
    data = (tmp_path / "0000000001.seg").read_bytes()
    magic, crc, length = struct.unpack_from(">4sII", data)
    assert (magic, crc, length) == (MAGIC, zlib.crc32(items(1)[0]), 40)
    assert data[HEADER : HEADER + 40] == items(1)[0] and len(data) == 2 * (HEADER + 40)

    ref, _ = q.pop(count_limit=5)
    q.ack(ref)
    assert json.loads((tmp_path / "COMMIT").read_text()) == {"segno": 3, "id": 1}
    assert segment_files(tmp_path) == [f"{n:010d}.seg" for n in range(3, 6)]
    assert not list(tmp_path.glob("*.tmp"))
    q.close()
    q = open_q(tmp_path, seg_bytes=100)
    assert drain(q) == items(5, start=5)


def test_a_partly_acked_segment_is_kept_after_the_reader_moved_past_it(tmp_path):
    q = open_q(tmp_path, seg_bytes=100)
    append_each(q, items(4))
    ref, _ = q.pop(count_limit=1)
    q.pop(count_limit=2)
    q.ack(ref)
    assert segment_files(tmp_path) == ["0000000001.seg", "0000000002.seg"]
    q.close()
    assert drain(open_q(tmp_path, seg_bytes=100)) == items(3, start=1)


def test_fsync_always_round_trips(tmp_path):
    q = open_q(tmp_path, fsync="always", seg_bytes=100)
    q.append(items(5))
    ref, _ = q.pop(count_limit=3)
    q.ack(ref)
    q.close()
    assert drain(open_q(tmp_path, fsync="always")) == items(2, start=3)


@pytest.mark.parametrize("offload", [False, True])
def test_marshaller_and_sizer_handle_non_bytes_items(tmp_path, offload):
    config = {"marshaller": (pickle.dumps, pickle.loads), "sizer": lambda item: len(item["k"]), "offload": offload}
    q = open_q(tmp_path, **config)
    q.append([{"k": "abc"}, {"k": "de"}])
    assert q.bytes() == 5
    q.close()
    q = open_q(tmp_path, **config)
    assert (q.count(), q.bytes()) == (2, 5) and drain(q) == [{"k": "abc"}, {"k": "de"}]


def test_items_must_be_bytes_without_a_marshaller(tmp_path):
    q = open_q(tmp_path)
    with pytest.raises(TypeError, match="marshaller"):
        q.append(["text"])
    with pytest.raises(TypeError, match="sequence"):
        q.append(b"abc")
    q.append([bytearray(b"ab"), memoryview(b"cd")])
    assert drain(q) == [b"ab", b"cd"]


def test_a_directory_is_locked_by_the_queue_that_opened_it(tmp_path):
    q = open_q(tmp_path)
    with pytest.raises(ReplayQError, match="already open"):
        open_q(tmp_path)
    q.close()
    open_q(tmp_path).close()


def test_purge_discards_everything_and_old_refs_stay_harmless(tmp_path):
    q = open_q(tmp_path, seg_bytes=100)
    q.append(items(5))
    ref, _ = q.pop(count_limit=2)
    q.purge()
    assert (q.count(), q.bytes(), segment_files(tmp_path)) == (0, 0, [])
    q.ack(ref)
    q.append([b"new"])
    q.close()
    q = open_q(tmp_path, seg_bytes=100)
    assert drain(q) == [b"new"]


# --- offload -------------------------------------------------------------------------------------


def test_offload_keeps_items_in_ram_until_the_threshold_then_spills_the_tail(tmp_path):
    q = open_q(tmp_path, offload=True, seg_bytes=100)
    q.append(items(2))
    assert not q.is_writing_to_disk() and segment_files(tmp_path) == []
    q.append(items(1, start=2))
    assert q.is_writing_to_disk()
    append_each(q, items(3, start=3))
    assert segment_files(tmp_path) == ["0000000002.seg", "0000000003.seg"]
    assert drain(q) == items(6)
    assert not q.is_writing_to_disk()


def test_offload_crash_keeps_what_reached_disk(tmp_path):
    run_and_crash(f"""
        from ecq.events.replayq import ReplayQ
        q = ReplayQ.open({{"dir": {str(tmp_path)!r}, "offload": True, "seg_bytes": 100}})
        for i in range(6):
            q.append([b"%040d" % i])
    """)
    q = open_q(tmp_path, offload=True, seg_bytes=100)
    assert drain(q) == items(3, start=3)


def test_offload_close_dumps_unacked_ram_items_but_not_acked_ones(tmp_path):
    q = open_q(tmp_path, offload=True, seg_bytes=1000)
    q.append(items(6))
    ref, _ = q.pop(count_limit=2)
    q.ack(ref)
    q.pop(count_limit=2)
    assert json.loads((tmp_path / "COMMIT").read_text()) == {"segno": 1, "id": 0}
    q.close()
    q = open_q(tmp_path, offload=True, seg_bytes=1000)
    assert q.count() == 4 and drain(q) == items(4, start=2)


def test_offload_dump_keeps_ram_head_before_spilled_tail(tmp_path):
    q = open_q(tmp_path, offload=True, seg_bytes=100)
    append_each(q, items(6))
    ref, _ = q.pop(count_limit=1)
    q.ack(ref)
    q.close()
    assert segment_files(tmp_path) == ["0000000001.seg", "0000000002.seg", "0000000003.seg"]
    q = open_q(tmp_path, offload=True, seg_bytes=100)
    assert drain(q) == items(5, start=1)


def test_volatile_offload_wipes_old_segments_and_never_dumps(tmp_path):
    q = open_q(tmp_path, offload=True, seg_bytes=100)
    q.append(items(6))
    q.close()
    assert segment_files(tmp_path)
    q = open_q(tmp_path, offload="volatile", seg_bytes=100)
    assert q.count() == 0 and segment_files(tmp_path) == [] and not (tmp_path / "COMMIT").exists()
    q.append(items(2))
    q.close()
    assert segment_files(tmp_path) == []


# --- corruption and crashes ----------------------------------------------------------------------


def write_segment(path: Path, n: int) -> Path:
    q = open_q(path)
    q.append(items(n))
    q.close()
    return path / "0000000001.seg"


def test_segment_truncated_mid_frame_keeps_the_whole_frames(tmp_path, caplog):
    seg = write_segment(tmp_path, 5)
    os.truncate(seg, seg.stat().st_size - 7)
    q = open_q(tmp_path)
    assert q.corrupt_discarded() == Dropped(1, HEADER + 40 - 7)
    assert "discarding 1 item" in caplog.text
    assert seg.stat().st_size == 4 * (HEADER + 40) and drain(q) == items(4)


@pytest.mark.parametrize("where, survivors", [("payload", 2), ("magic", 2), ("length", 2)])
def test_a_bad_frame_truncates_the_segment_from_there(tmp_path, where, survivors):
    seg = write_segment(tmp_path, 5)
    data = bytearray(seg.read_bytes())
    frame = 2 * (HEADER + 40)
    data[frame + {"magic": 1, "length": 10, "payload": HEADER + 5}[where]] ^= 0xFF
    seg.write_bytes(bytes(data))
    q = open_q(tmp_path)
    assert q.corrupt_discarded() == Dropped(3, 3 * (HEADER + 40))
    assert drain(q) == items(survivors)
    q.append([b"after"])
    assert drain(q) == [b"after"]


def test_a_garbage_segment_is_emptied_and_later_segments_survive(tmp_path):
    q = open_q(tmp_path, seg_bytes=100)
    append_each(q, items(4))
    q.close()
    (tmp_path / "0000000001.seg").write_bytes(os.urandom(300))
    q = open_q(tmp_path, seg_bytes=100)
    assert q.corrupt_discarded() == Dropped(1, 300)
    assert segment_files(tmp_path) == ["0000000002.seg"] and drain(q) == items(2, start=2)


def test_truncation_inside_the_commit_segment_keeps_ids_consistent(tmp_path):
    q = open_q(tmp_path)
    q.append(items(5))
    ref, _ = q.pop(count_limit=2)
    q.ack(ref)
    q.close()
    seg = tmp_path / "0000000001.seg"
    os.truncate(seg, 4 * (HEADER + 40) - 1)
    q = open_q(tmp_path)
    q.append([b"new"])
    assert q.count() == 2 and drain(q) == [items(5)[2], b"new"]


def test_committed_is_the_position_in_commit_that_a_reopen_resumes_after(tmp_path):
    q = open_q(tmp_path, seg_bytes=100, max_total_bytes=250)
    assert q.committed() == AckRef(0, 0)
    append_each(q, items(4))
    ref, _ = q.pop(count_limit=3)
    assert q.committed() == AckRef(0, 0)  # popped, not acked
    q.ack(ref)
    assert q.committed() == ref == AckRef(2, 1)
    assert json.loads((tmp_path / "COMMIT").read_text()) == {"segno": 2, "id": 1}
    q.append(items(6, start=4))  # over max_total_bytes with nothing outstanding: drops are committed at once
    dropped_to = q.committed()
    assert dropped_to > ref
    q.close()
    q = open_q(tmp_path, seg_bytes=100)
    assert q.committed() == dropped_to
    assert open_q(None).committed() == AckRef(0, 0)


def test_deleting_commit_hands_out_every_item_still_on_disk(tmp_path):
    q = open_q(tmp_path, seg_bytes=100)
    append_each(q, items(6))
    ref, _ = q.pop(count_limit=3)
    q.ack(ref)
    q.close()
    (tmp_path / "COMMIT").unlink()
    q = open_q(tmp_path, seg_bytes=100)
    assert drain(q) == items(4, start=2)


@pytest.mark.parametrize("content", [b"", b"garbage", b'{"segno": 1}', b'{"segno": -1, "id": 0}', b"[1, 2]", b"\xff"])
def test_a_corrupt_commit_file_is_an_error_not_a_guess(tmp_path, content):
    write_segment(tmp_path, 2)
    (tmp_path / "COMMIT").write_bytes(content)
    with pytest.raises(ReplayQError, match="corrupt COMMIT"):
        open_q(tmp_path)
    (tmp_path / "COMMIT").unlink()
    assert drain(open_q(tmp_path)) == items(2)


@pytest.mark.parametrize("name", ["1.seg", "abcdefghij.seg", "00000000001.seg"])
def test_unexpected_segment_names_are_an_error(tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(ReplayQError, match="unexpected segment file"):
        open_q(tmp_path)


def test_stale_temp_files_are_removed_and_other_files_ignored(tmp_path):
    write_segment(tmp_path, 2)
    for name in ("COMMIT.tmp", "0000000009.seg.tmp", "notes.txt"):
        (tmp_path / name).write_bytes(b"junk")
    q = open_q(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000000001.seg", "notes.txt"]
    assert drain(q) == items(2)


def test_a_segment_changed_under_an_open_queue_is_an_error(tmp_path):
    q = open_q(tmp_path)
    q.append(items(3))
    os.truncate(tmp_path / "0000000001.seg", HEADER + 40)
    with pytest.raises(ReplayQError, match="changed on disk"):
        q.pop()


def test_kill_9_loses_nothing_that_append_returned_and_repeats_only_unacked(tmp_path):
    run_and_crash(f"""
        from ecq.events.replayq import ReplayQ
        q = ReplayQ.open({{"dir": {str(tmp_path)!r}, "seg_bytes": 200, "fsync": "always"}})
        for i in range(20):
            q.append([b"%040d" % i])
        ref, _ = q.pop(count_limit=7)
        q.ack(ref)
        q.pop(count_limit=5)
    """)
    q = open_q(tmp_path, seg_bytes=200)
    assert q.corrupt_discarded() == Dropped(0, 0) and drain(q) == items(13, start=7)


def test_a_failed_write_is_truncated_away(tmp_path):
    limit = 3 * (HEADER + 40) + 20
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            import resource, signal
            from ecq.events.replayq import ReplayQ
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
            q = ReplayQ.open({{"dir": {str(tmp_path)!r}, "fsync": "never"}})
            q.append([b"%040d" % i for i in range(3)])
            try:
                q.append([b"%040d" % i for i in range(3, 5)])
            except OSError:
                print("failed")
            q.append([b"x"])
            q.close()
        """)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert proc.stdout.strip() == "failed", proc.stderr
    q = open_q(tmp_path)
    assert q.corrupt_discarded() == Dropped(0, 0) and drain(q) == items(3) + [b"x"]


# --- overload ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [{}, {"fsync": "never"}, {"offload": True, "seg_bytes": 300}])
def test_overload_keeps_bytes_under_the_limit_and_counts_drops(tmp_path, mode):
    q = open_q(tmp_path if mode else None, max_total_bytes=1000, **mode)
    for item in items(25, size=100):
        q.append([item])
        assert q.bytes() <= 1000
    assert q.count() == 10 and q.overflow_dropped() == Dropped(15, 1500)
    assert drain(q) == items(10, size=100, start=15)
    q.append(items(12, size=100))
    assert q.overflow_dropped() == Dropped(17, 1700) and drain(q)[0] == items(1, size=100, start=2)[0]


@pytest.mark.parametrize("ack", [False, True])
def test_drops_reach_commit_with_the_ack_of_the_batch_before_them(tmp_path, ack):
    q = open_q(tmp_path, max_total_bytes=200)
    q.append(items(2, size=100))
    ref, _ = q.pop(count_limit=1)
    q.append(items(2, size=100, start=2))
    assert q.overflow_dropped() == Dropped(1, 100)
    if ack:
        q.ack(ref)
    q.close()
    q = open_q(tmp_path)
    assert drain(q) == (items(2, size=100, start=2) if ack else items(4, size=100))


def test_drops_with_nothing_outstanding_are_committed_at_once(tmp_path):
    q = open_q(tmp_path, max_total_bytes=250)
    q.append(items(4, size=100))
    assert q.overflow_dropped() == Dropped(2, 200)
    q.close()
    q = open_q(tmp_path)
    assert drain(q) == items(4, size=100)[2:]


def test_high_memory_drops_at_least_what_each_append_adds(tmp_path):
    usage = [50.0]
    q = open_q(tmp_path, high_mem_percent=90, mem_probe=lambda: usage[0])
    q.append(items(10, size=100))
    assert q.overflow_dropped() == Dropped(0, 0)
    usage[0] = 95.0
    q.append(items(3, size=100, start=10))
    assert q.count() == 10 and q.overflow_dropped() == Dropped(3, 300)
    q.append([b""])
    assert q.count() == 10 and q.overflow_dropped() == Dropped(4, 400)
    assert drain(q)[0] == items(1, size=100, start=4)[0]


def test_high_memory_threshold_uses_psutil_by_default():
    q = ReplayQ.open({"high_mem_percent": 0.0001})
    q.append([b"a" * 10])
    q.append([b"b" * 10])
    assert q.count() == 0 and q.overflow_dropped() == Dropped(2, 20)
    assert ReplayQ.open({"high_mem_percent": 100}).count() == 0


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, option",
    [
        ({"dir": "q", "seg_bytes": 0}, "seg_bytes"),
        ({"dir": "q", "seg_bytes": -5}, "seg_bytes"),
        ({"offload": True}, "offload"),
        ({"offload": "volatile"}, "offload"),
        ({"dir": "q", "offload": "yes"}, "offload"),
        ({"dir": "q", "offload": 1}, "offload"),
        ({"max_total_bytes": 0}, "max_total_bytes"),
        ({"fsync": "sometimes"}, "fsync"),
        ({"dir": "q", "mem_only": True}, "mem_only"),
        ({"high_mem_percent": 0}, "high_mem_percent"),
        ({"high_mem_percent": 101}, "high_mem_percent"),
        ({"sizer": 3}, "sizer"),
        ({"segment_bytes": 10}, "segment_bytes"),
    ],
)
def test_bad_config_names_the_option(tmp_path, config, option):
    if "dir" in config:
        config["dir"] = tmp_path / config["dir"]
    with pytest.raises(ValidationError, match=option):
        ReplayQ.open(config)
