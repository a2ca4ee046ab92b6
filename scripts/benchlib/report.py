"""What scripts/bench prints and writes: the machine line, the results table, the load-check table, JSON."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any


@dataclass
class Row:
    """One figure: ECQ next to its baseline from the same run. ``ratio`` = ecq / baseline (for rates higher is
    better, for times lower is better); ``met`` is None when the issue sets no target for it."""

    scenario: str
    metric: str
    unit: str
    payload_bytes: int | None
    ecq: float | None
    baseline: float | None = None
    target: str = ""
    met: bool | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.ecq is None or not self.baseline:
            return None
        return round(self.ecq / self.baseline, 3)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


@dataclass
class ScenarioResult:
    """A scenario's rows and every measured number (``details``); ``status`` is ok, TIMEOUT or ERROR."""

    name: str
    rows: list[Row] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"
    message: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"scenario": self.name, "status": self.status, "message": self.message, "seconds": self.seconds,
                "rows": [row.as_dict() for row in self.rows], "details": self.details}


def machine() -> dict[str, Any]:
    """Cores, CPU model (/proc/cpuinfo), memory, Python and the versions of the MQTT pieces: carried by every figure."""
    model = platform.processor() or "unknown"
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {"cores": os.cpu_count(), "cpu": model, "memory_gib": mem_gib, "python": platform.python_version(),
            "kernel": platform.release(),
            "versions": {name: _version(name) for name in ("amqtt", "aiomqtt", "paho-mqtt", "plyvel", "psutil")}}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def source_state(repo: Path) -> dict[str, Any]:
    """The commit measured, the files under ecq/ (or pyproject.toml) that differ from it, and a digest of
    their contents: others edit and commit while benchmarks run, so a figure belongs to this state, and
    a digest that differs between the start and the end of a run means its scenarios ran different code."""
    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
    changed = [line[3:] for line in git("status", "--porcelain", "--", "ecq", "pyproject.toml").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or None, "uncommitted_ecq_files": changed,
            "digest": source_digest(repo)}


def source_digest(repo: Path) -> str:
    """12 hex digits of SHA-256 over the paths and contents of ecq/**/*.py and pyproject.toml."""
    digest = hashlib.sha256()
    for path in sorted([*(repo / "ecq").rglob("*.py"), repo / "pyproject.toml"]):
        digest.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def machine_line(m: dict[str, Any]) -> str:
    """``machine: 2 cores, AMD EPYC, 23.5 GiB, Python 3.11.2; amqtt 0.12.1, aiomqtt 2.5.1, ...``"""
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    return f"machine: {m['cores']} cores, {m['cpu']}, {m['memory_gib']} GiB, Python {m['python']}; {versions}"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def results_table(results: list[ScenarioResult]) -> str:
    """The table: scenario, metric, payload, ECQ, baseline, ratio, target, met?, note; then one line for each
    scenario that did not finish normally (TIMEOUT, ERROR, skipped)."""
    header = ("scenario", "metric", "payload", "ECQ", "baseline", "ratio", "target", "met?", "note")
    lines = [header]
    for result in results:
        for row in result.rows:
            met = "-" if row.met is None else ("yes" if row.met else "NO")
            payload = f"{row.payload_bytes} B" if row.payload_bytes else "-"
            ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
            lines.append((row.scenario, f"{row.metric} ({row.unit})", payload, _number(row.ecq), _number(row.baseline),
                          ratio, row.target or "-", met, row.note))
    statuses = [f"{r.name}: {r.status}: {r.message}" for r in results if r.status != "ok"]
    return _format(lines) + "".join(f"\n{line}" for line in statuses)


def load_table(checks: list[dict[str, Any]]) -> str:
    """Per measured phase: broker CPU (summed over a cluster's nodes), each load process's CPU (% of one core),
    machine busy (% of all cores) and CPU used by processes outside the benchmark (% of one core); with a
    ``nats`` column (the NATS servers, summed) when some phase ran beside a NATS cluster."""
    with_nats = any(c.get("nats_cpu_pct") is not None for c in checks)
    lines = [("phase", "broker", *(("nats",) if with_nats else ()), "load procs (each)", "machine", "others")]
    for c in checks:
        loads = "/".join(_number(v) for v in c["load_cpu_pct"]) if c["load_cpu_pct"] else "-"
        nats = (_percent(c.get("nats_cpu_pct")),) if with_nats else ()
        lines.append((c["phase"], _percent(c["broker_cpu_pct"]), *nats, loads, _percent(c["machine_busy_pct"]),
                      _percent(c["others_cpu_pct"])))
    others = sorted(c["others_cpu_pct"] for c in checks if c["others_cpu_pct"] is not None)
    footer = (f"\nprocesses outside the benchmark used {others[len(others) // 2]:.0f}% of a core (median over phases; "
              f"max {others[-1]:.0f}%) while it measured" if others else "")
    return _format(lines) + footer


def problems_text(brokers: list[dict[str, Any]]) -> str:
    """One block per broker run that logged warnings or errors, or did not exit with 0 on SIGTERM: its
    label (and how it stopped), then count and pattern."""
    blocks = []
    for run in brokers:
        unclean = run.get("stop") not in (None, "exit code 0", "not ours", "not running")
        if run.get("log_problems") or unclean:
            lines = [f"  {count:>6}  {pattern}" for pattern, count in run.get("log_problems", {}).items()]
            stop = f"; stop: {run['stop']}" if unclean else ""
            blocks.append(f"{run['label']} ({run['broker']}{stop}):\n" + "\n".join(lines))
    return "\n".join(blocks)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _format(lines: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write the whole report (machine, options, every scenario's rows and details, load checks)."""
    path.write_text(json.dumps(report, indent=2, default=str))
