"""Background sampling of CPU and memory, to tell from the outside where a scenario's bottleneck is.

A thread reads, every SAMPLE_INTERVAL_S, the CPU seconds (user + system, all threads) and RSS of each
watched process (brokers, load processes) and the machine's busy CPU seconds, stamped with
``time.monotonic()`` (the clock the load processes use for their ``*_ns`` instants). Figures over an
interval are interpolated between samples.

Units: CPU percent of ONE core for a process (a single-threaded process tops out at 100), percent of ALL
cores for the machine; RSS in bytes.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

import psutil

SAMPLE_INTERVAL_S = 0.05


class ResourceSampler:
    """Samples watched processes and the machine until :meth:`close`."""

    def __init__(self) -> None:
        self.cores = os.cpu_count() or 1
        self._procs: dict[int, psutil.Process] = {}
        self._times: list[float] = []
        self._cpu_s: dict[int, list[tuple[float, float]]] = {}
        self._rss: dict[int, list[tuple[float, int]]] = {}
        self._machine: list[float] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-sampler", daemon=True)
        self._thread.start()

    def watch(self, *pids: int | None) -> None:
        """Start sampling these processes (None and unknown pids are ignored)."""
        with self._lock:
            for pid in pids:
                if pid and pid not in self._procs:
                    try:
                        self._procs[pid] = psutil.Process(pid)
                    except psutil.NoSuchProcess:
                        continue
                    self._cpu_s.setdefault(pid, [])
                    self._rss.setdefault(pid, [])

    def close(self) -> None:
        """Stop the sampling thread."""
        self._closing.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self._closing.wait(SAMPLE_INTERVAL_S):
            self._sample()

    def _sample(self) -> None:
        now = time.monotonic()
        machine = psutil.cpu_times()
        busy_s = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
        with self._lock:
            self._times.append(now)
            self._machine.append(busy_s)
            for pid, proc in list(self._procs.items()):
                try:
                    with proc.oneshot():
                        cpu = proc.cpu_times()
                        rss = proc.memory_info().rss
                except psutil.Error:  # exited: stop watching it
                    del self._procs[pid]
                    continue
                self._cpu_s[pid].append((now, cpu.user + cpu.system))
                self._rss[pid].append((now, rss))

    def cpu_percent(self, pid: int | None, start: float, end: float) -> float | None:
        """CPU use of ``pid`` between two monotonic instants, in percent of one core (None if unknown)."""
        with self._lock:
            series = list(self._cpu_s.get(pid, []))
        return _rate_percent(series, start, end)

    def machine_percent(self, start: float, end: float) -> float | None:
        """Busy CPU of the whole machine between two monotonic instants, in percent of all cores."""
        with self._lock:
            series = list(zip(self._times, self._machine))
        rate = _rate_percent(series, start, end)
        return None if rate is None else round(rate / self.cores, 1)

    def peak_rss_bytes(self, pid: int | None, start: float, end: float) -> int | None:
        """Largest RSS sampled for ``pid`` between two monotonic instants (None if none sampled)."""
        with self._lock:
            inside = [rss for t, rss in self._rss.get(pid, []) if start <= t <= end]
        return max(inside) if inside else None

    def rss_bytes(self, pid: int | None) -> int | None:
        """RSS of ``pid`` right now (None if it is not running)."""
        try:
            return psutil.Process(pid).memory_info().rss if pid else None
        except psutil.Error:
            return None


def _value_at(series: list[tuple[float, float]], t: float) -> float | None:
    """Linear interpolation of a (time, cumulative value) series at ``t`` (clamped to its ends)."""
    if not series:
        return None
    times = [s[0] for s in series]
    i = bisect.bisect_left(times, t)
    if i == 0:
        return series[0][1]
    if i == len(series):
        return series[-1][1]
    (t0, v0), (t1, v1) = series[i - 1], series[i]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1


def _rate_percent(series: list[tuple[float, float]], start: float, end: float) -> float | None:
    """100 * (growth of a cumulative seconds series over [start, end]) / (end - start)."""
    if end <= start:
        return None
    first, last = _value_at(series, start), _value_at(series, end)
    if first is None or last is None:
        return None
    return round(100.0 * (last - first) / (end - start), 1)


def listen_drops() -> int | None:
    """The machine's TcpExt ListenDrops counter (/proc/net/netstat): connection attempts the kernel dropped,
    mostly because a listener's accept backlog was full. None where there is no such file."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:]))
            return int(table["ListenDrops"]) if "ListenDrops" in table else None
    return None


def rss_split_bytes(pid: int | None) -> dict[str, int] | None:
    """RSS of ``pid`` split as /proc/<pid>/status does: ``anon`` (heap, stacks: memory the process owns),
    ``file`` (pages of mapped files: shared libraries, and LevelDB's mmapped table files, page cache the
    kernel may drop) and ``shmem``; in bytes. None when the process or the file is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    fields = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    split = {}
    for line in lines:
        name, *value = line.split()
        if name in fields:
            split[fields[name]] = int(value[0]) * 1024  # reported in kB
    return split or None
