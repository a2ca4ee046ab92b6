"""The operator side of the admin API: one HTTP call, the answer checked, and the text renderings of
``ecq status``, ``ecq inspect`` and ``ecq top`` (the JSON shapes come from ecq.ops.status and ecq.queue.lag). Used by ecq.cli.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any

import click

EXIT_NOT_FOUND, EXIT_UNREACHABLE = 1, 3  # ecq exit codes (see ecq.cli)


class Unreachable(click.ClickException):
    """No broker answered at the admin address (exit code 3)."""

    exit_code = EXIT_UNREACHABLE


class Refused(click.ClickException):
    """The broker answered but refused the request's token (exit code 3; no fallback to the data dir)."""

    exit_code = EXIT_UNREACHABLE


def call_admin(admin: str, path: str, token: str | None, method: str = "GET",
               timeout: float = 10.0) -> tuple[int, Any]:
    """One admin API call, answered within ``timeout`` seconds; returns (HTTP status, decoded JSON). Raises
    Unreachable when nothing answers."""
    request = urllib.request.Request(f"http://{admin}{path}", method=method)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)
    except (urllib.error.URLError, OSError) as exc:
        raise Unreachable(f"no broker answers at {admin}: {getattr(exc, 'reason', exc)}") from exc


def emit(data: Any, as_json: bool, render) -> None:
    """Print ``data`` as JSON or through ``render(data) -> str``."""
    click.echo(json.dumps(data, indent=2) if as_json else render(data))


def check_answer(status: int, body: Any) -> Any:
    """The decoded body of a successful answer; exits 1 on 404 (printing why), raises Refused on 401 and
    ClickException on any other error status."""
    if status == 401:
        raise Refused(f"admin API refused the request: {body.get('error')}")
    if status == 404:
        click.echo(body.get("error", "not found"), err=True)
        sys.exit(EXIT_NOT_FOUND)
    if status >= 400:
        raise click.ClickException(body.get("error", f"admin API answered HTTP {status}"))
    return body


def render_status(d: dict[str, Any]) -> str:
    """Human-readable `ecq status`."""
    lines = [f"queues:            {d['queues']}", f"messages stored:   {d['messages']}",
             f"bytes stored:      {d['bytes']}", f"consumers online:  {d['consumers_online']}",
             f"first index entry: {_index_line(d['first_index'])}",
             f"last index entry:  {_index_line(d['last_index'])}"]
    if d.get("events"):
        e = d["events"]
        lines.append(f"events:            {e.get('recorded', 0)} recorded, {e.get('dropped_items', 0)} dropped, "
                     f"{e.get('buffered_items', 0)} buffered")
    if "source" in d:
        lines.append(f"source:            {d['source']}")
    if "cluster" in d:
        lines += render_cluster(d["cluster"])
    lines.append(f"consumers ({d['consumers_total']} with stored state):")
    for c in d["consumers"]:
        lines.append(f"  {c['clientid']}  acked {c['acked']}  last ack {c['last_ack_ts'] or 'never'}"
                     f"  {'online' if c['online'] else 'offline'}")
    return "\n".join(lines)


def render_cluster(c: dict[str, Any]) -> list[str]:
    """`ecq status` lines of a cluster: its problems, leaders per server, each stream's leader and replicas
    current/configured (the shape of ecq.store.jetstream_health.StreamHealth.report)."""
    spread = ", ".join(f"{server} {len(streams)}" for server, streams in sorted(c["leaders"].items()))
    lines = [f"cluster:           {'writable' if c['writable'] else 'NOT writable'}; "
             f"leaders per server: {spread or 'none'}"]
    lines += [f"  problem: {problem}" for problem in c["problems"]]
    for name, s in sorted(c["streams"].items()):
        lagging = f"  not current: {', '.join(s['lagging'])}" if s["lagging"] else ""
        lines.append(f"  {name:<16} leader {s['leader'] or 'none':<8} replicas {s['replicas_current']}/"
                     f"{s['replicas']}{lagging}")
    return lines


def render_queue(d: dict[str, Any]) -> str:
    """Human-readable `ecq inspect`."""
    return "\n".join([f"clientid:    {d['clientid']}", f"acked:       {d['acked']}",
                      f"last ack:    {d['last_ack_ts'] or 'never'}", f"queue range: {d['range']}",
                      f"last seqno:  {d['last_seqno']}", f"stored:      {d['stored']}",
                      f"pending:     {d['pending']} ({d['pending_bytes']} bytes, oldest "
                      f"{_age(d['oldest_pending_age_s'])})", f"inflight:    {d['inflight']}",
                      f"online:      {'yes' if d['online'] else 'no'}"])


def render_top(d: dict[str, Any]) -> str:
    """Human-readable `ecq top`: a summary line, then one line per queue."""
    lines = [f"pending: {d['pending']} entries in {d['lagging']} queues, oldest {_age(d['oldest_pending_age_s'])}"
             f" (by {d['by']})"]
    if "source" in d:
        lines.append(f"source:  {d['source']}")
    width = max([len("CLIENTID"), *(len(q["clientid"]) for q in d["queues"])])
    lines.append(f"{'CLIENTID':<{width}}  {'PENDING':>10}  {'BYTES':>12}  {'OLDEST AGE S':>14}")
    for q in d["queues"]:
        lines.append(f"{q['clientid']:<{width}}  {q['pending']:>10}  {q['pending_bytes']:>12}  "
                     f"{q['oldest_pending_age_s']:>14.1f}")
    return "\n".join(lines)


def _age(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds:.1f} s old"


def _index_line(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "none"
    return f"{entry['clientid']} seqno {entry['seqno']} key {entry['key']} at {entry['ts']}"
