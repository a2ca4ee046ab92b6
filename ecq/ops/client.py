"""The operator side of the admin API: where it is, one HTTP call, the answer checked, and the text renderings of
``ecq status``, ``ecq inspect`` and ``ecq top`` (the JSON shapes come from ecq.ops.status and ecq.queue.lag). Used by ecq.cli.
"""

from __future__ import annotations

import ipaddress
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click
import yaml

from ecq.broker.config_file import PLUGIN_PATH, ConfigError, load_broker_config, plugin_settings
from ecq.config import COMPUTED_OPTIONS, split_host_port
from ecq.queue.topics import printable

EXIT_NOT_FOUND, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3  # ecq exit codes (see ecq.cli)
DEFAULT_ADMIN = "127.0.0.1:18083"


class BadConfig(click.ClickException):
    """The broker config given to an operator command (``-c``) cannot tell where the admin API is (exit code 2)."""

    exit_code = EXIT_USAGE


def admin_target(admin: str | None, token: str | None, config_path: Path | None) -> tuple[str, str | None]:
    """(``HOST:PORT`` to call, bearer token or None) of the broker's admin API. The address is ``admin``
    (``--admin``, else $ECQ_ADMIN), else the ``admin_bind`` of the broker config at ``config_path`` (``-c``),
    else DEFAULT_ADMIN; a wildcard host (``0.0.0.0``, ``[::]``) is called on loopback. The token is ``token``
    (``--token``, else $ECQ_ADMIN_TOKEN), else the config's ``admin_token``. Raises BadConfig, in one line, for
    a config that is missing, invalid, or turns the admin API off."""
    settings = None
    if config_path is not None and (admin is None or token is None):
        try:
            settings = plugin_settings(load_broker_config(config_path)["plugins"][PLUGIN_PATH])
        except ConfigError as exc:
            raise BadConfig(str(exc)) from None
        if admin is None and settings.admin_bind is None:
            raise BadConfig(f"broker config {config_path} turns the admin API off (admin_bind: null); give --admin")
    if admin is None:
        admin = settings.admin_bind if settings else DEFAULT_ADMIN
    if token is None and settings:
        token = settings.admin_token_value()
    return _loopback_if_wildcard(admin), token


def _loopback_if_wildcard(address: str) -> str:
    try:
        host, port = split_host_port(address)
        unspecified = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return address  # not HOST:PORT with an IP: called as given, and refused or unreachable there
    if not unspecified:
        return address
    return f"[::1]:{port}" if ":" in host else f"127.0.0.1:{port}"


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
    """Print ``data`` as JSON (exact: ``json.dumps`` escapes control characters) or through ``render(data) -> str``,
    handed ``data`` with every string escaped by ecq.queue.topics.printable, keys too (a queue named with an ESC
    sequence or a newline is shown escaped, never acted on by the terminal)."""
    click.echo(json.dumps(data, indent=2) if as_json else render(_printable(data)))


def _printable(data: Any) -> Any:
    if isinstance(data, str):
        return printable(data)
    if isinstance(data, dict):
        return {_printable(key): _printable(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_printable(value) for value in data]
    return data


def check_answer(status: int, body: Any) -> Any:
    """The decoded body of a successful answer; exits 1 on 404 (printing why), raises Refused on 401 and
    ClickException on any other error status (the error escaped by ecq.queue.topics.printable)."""
    error = printable(str(body.get("error", f"admin API answered HTTP {status}")))
    if status == 401:
        raise Refused(f"admin API refused the request: {error}")
    if status == 404:
        click.echo(error, err=True)
        sys.exit(EXIT_NOT_FOUND)
    if status >= 400:
        raise click.ClickException(error)
    return body


def render_config(inuse: dict[str, Any], origin: dict[str, Any]) -> str:
    """`ecq show-config` as YAML: the options in effect (``inuse``), each one the config does not set (``origin``:
    those it sets) marked ``# default``, or ``# default, computed`` when the broker computed it at start-up."""
    lines = []
    for name, value in inuse.items():
        text = yaml.safe_dump({name: value}, sort_keys=False).rstrip("\n")
        if name not in origin:
            first, newline, rest = text.partition("\n")
            computed = ", computed" if name in COMPUTED_OPTIONS else ""
            text = f"{first}  # default{computed}{newline}{rest}"
        lines.append(text)
    return "\n".join(lines)


def render_status(d: dict[str, Any]) -> str:
    """Human-readable `ecq status`."""
    lines = [f"queues:            {d['queues']}", f"messages stored:   {d['messages']}",
             f"bytes stored:      {d['bytes']}", f"consumers online:  {d['consumers_online']}",
             *_edge_lines(d)]
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
    lines.append(f"SCQs ({d.get('scqs_total', 0)} with readers):")
    for q in d.get("scqs", []):
        lines.append(f"  {q['queue']}  readers {q['readers']}  online {q['readers_online']}")
    return "\n".join(lines)


def render_scq(d: dict[str, Any]) -> str:
    """Human-readable `ecq inspect --scq QUEUE`: the SCQ, then one line per reader listed."""
    lines = [f"scq:         {d['queue']}", f"last seqno:  {d['last_seqno']}", f"range:       {d['range']}",
             f"stored:      {d['stored']}", f"readers:     {d['readers_total']} ({d['readers_online']} online)"]
    for r in d["readers"]:
        lines.append(f"  {r['reader']}  acked {r['acked']}  pending {r['pending']} ({r['pending_bytes']} bytes, oldest "
                     f"{_age(r['oldest_pending_age_s'])})  {'online' if r['online'] else 'offline'}")
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
                      f"online:      {'yes' if d['online'] else 'no'}",
                      f"skipped:     {d['skipped_too_large']} (too large for the consumer's connection)"])


def render_top(d: dict[str, Any]) -> str:
    """Human-readable `ecq top`: a summary line, then one line per queue."""
    lines = [f"pending: {d['pending']} entries in {d['lagging']} queues, oldest {_age(d['oldest_pending_age_s'])}"
             f" (by {d['by']})"]
    if "source" in d:
        lines.append(f"source:  {d['source']}")
    if "scq" in d:
        lines.append(f"readers of the SCQ {d['scq']}")
    names = [_top_name(q) for q in d["queues"]]
    width = max([len("QUEUE"), *map(len, names)])
    lines.append(f"{'QUEUE':<{width}}  {'PENDING':>10}  {'BYTES':>12}  {'OLDEST AGE S':>14}")
    for name, q in zip(names, d["queues"], strict=True):
        lines.append(f"{name:<{width}}  {q['pending']:>10}  {q['pending_bytes']:>12}  "
                     f"{q['oldest_pending_age_s']:>14.1f}")
    return "\n".join(lines)


def _top_name(row: dict[str, Any]) -> str:
    """An ECQ queue by its clientid; an SCQ reader's position as ``scq <queue> reader <clientid>``."""
    return f"scq {row['queue']} reader {row['reader']}" if row.get("kind") == "scq" else row["clientid"]


def _age(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds:.1f} s old"


def _edge_lines(d: dict[str, Any]) -> list[str]:
    """The two index entries of `ecq status`, labelled by what picked them (see ecq.ops.status.broker_status)."""
    first, last = _index_line(d["first_index"]), _index_line(d["last_index"])
    if d.get("index_order", "clientid") == "time":
        return [f"oldest entry:      {first}", f"newest entry:      {last}"]
    return ["index entries:     by clientid then seqno (key order, not age)",
            f"  first:           {first}", f"  last:            {last}"]


def _index_line(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "none"
    return f"{entry['clientid']} seqno {entry['seqno']} key {entry['key']} at {entry['ts']}"
