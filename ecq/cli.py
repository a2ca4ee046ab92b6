"""The ``ecq`` command line (console script).

``ecq broker`` runs amqtt with the ECQ plugin in the foreground. ``ecq status``, ``ecq inspect``, ``ecq top``,
``ecq gc``, ``ecq rewind``, ``ecq delete``, ``ecq purge`` and ``ecq show-config`` talk to a running broker
through its admin API (ecq.ops.client); when no broker answers, ``status``, ``inspect`` and ``top`` read the data directory directly. ``ecq repair`` rebuilds a
damaged store, or accepts the loss of writes whose LevelDB log was truncated or deleted.

Exit codes: 0 ok, 1 not found (or, for ``broker``, a runtime failure such as a port in use, a locked or
corrupt store; for ``repair``, a store it cannot repair), 2 usage or configuration error, 3 broker unreachable.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import dataclasses
import gc as pygc  # the name gc is the `ecq gc` command below
import logging
import os
import signal
import sys
import urllib.request
from importlib import resources
from pathlib import Path
from typing import Any

import click
import yaml
from amqtt.broker import Broker
from amqtt.contexts import BrokerConfig, ListenerConfig
from pydantic import ValidationError

from ecq.broker.acl import AclError, load_acl
from ecq.config import EcqSettings, split_host_port
from ecq.pipeline.cli import pipeline
from ecq.broker.plugin import PLUGIN_PATH, EcqPlugin
from ecq.ops.client import (EXIT_NOT_FOUND, Unreachable, call_admin, check_answer, emit, render_queue,
                            render_status, render_top)
from ecq.ops.status import broker_status, queue_info
from ecq.queue.clock import now_ms
from ecq.queue.lag_reads import TOP_MAX, TOP_ORDERS, scan_lag, top_report
from ecq.store.protocol import StoreError
from ecq.queue.topics import BadWrite, parse_rewind_point
from ecq.store.committed import describe as describe_missing
from ecq.store.leveldb import LevelDbStore
from ecq.store.leveldb_files import repair as repair_store
from ecq.store.layout import QUEUES, leveldb_dir

GC_YOUNG_THRESHOLD = 50_000  # allocations between young collections of Python's cyclic GC (CPython: 700)
GIL_SWITCH_INTERVAL_S = 0.0005  # how long a thread may hold the GIL while another waits (CPython: 0.005)
DEFAULT_ADMIN = "127.0.0.1:18083"
OLD_PLUGIN_PATH = "ecq.plugin.EcqPlugin"  # before the package layout; named in the error for old configs

log = logging.getLogger("ecq")


@click.group()
@click.version_option(package_name="ecq", message="%(prog)s %(version)s")
def main() -> None:
    """ECQ: exclusive compacted queues for MQTT (amqtt broker plugin on LevelDB)."""


main.add_command(pipeline)


def load_broker_config(path: Path | None) -> dict[str, Any]:
    """Read an amqtt broker YAML config (the packaged default when ``path`` is None).

    Raises click.UsageError when the file is unreadable, not YAML, or does not enable the ECQ plugin.
    """
    try:
        text = path.read_text() if path else resources.files("ecq").joinpath("default_broker.yaml").read_text()
        config = yaml.safe_load(text)
    except (OSError, yaml.YAMLError) as exc:
        raise click.UsageError(f"cannot read broker config {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise click.UsageError(f"broker config {path} is not a YAML mapping")
    plugins = config.get("plugins")
    if isinstance(plugins, list):  # amqtt also accepts a list of one-key mappings
        plugins = {k: v for item in plugins for k, v in (item.items() if isinstance(item, dict) else [(item, None)])}
        config["plugins"] = plugins
    if isinstance(plugins, dict) and OLD_PLUGIN_PATH in plugins:
        raise click.UsageError(f"broker config {path}: the plugin {OLD_PLUGIN_PATH} is now {PLUGIN_PATH}; rename it "
                               "under 'plugins:'")
    if not isinstance(plugins, dict) or PLUGIN_PATH not in plugins:
        raise click.UsageError(f"broker config {path} does not list {PLUGIN_PATH} under 'plugins:'")
    plugins[PLUGIN_PATH] = plugins[PLUGIN_PATH] or {}
    check_broker_keys(config, path)
    return config


# amqtt 0.12.1's BrokerConfig fields; it also takes `topic-check` for `topic_check`
_BROKER_KEYS = {f.name for f in dataclasses.fields(BrokerConfig)} | {"topic-check"}
_LISTENER_KEYS = {f.name for f in dataclasses.fields(ListenerConfig)}


def check_broker_keys(config: dict[str, Any], path: Path | None) -> None:
    """Refuse unknown top-level keys and listener keys of an amqtt broker config, and a listener ``bind``
    that is not ``HOST:PORT`` (amqtt 0.12.1 would bind every interface for ``:1883`` and port 1883 for
    ``127.0.0.1:``). Raises click.UsageError naming the key."""
    unknown = sorted(set(config) - _BROKER_KEYS)
    if unknown:
        raise click.UsageError(f"broker config {path}: unknown key(s) {', '.join(map(repr, unknown))}; "
                               f"amqtt accepts {', '.join(sorted(_BROKER_KEYS))}")
    listeners = config.get("listeners") or {}
    if not isinstance(listeners, dict):
        raise click.UsageError(f"broker config {path}: 'listeners' must be a mapping of listener names")
    for name, listener in listeners.items():
        if not isinstance(listener, dict):
            raise click.UsageError(f"broker config {path}: listeners.{name} must be a mapping")
        if unknown := sorted(set(listener) - _LISTENER_KEYS):
            raise click.UsageError(f"broker config {path}: listeners.{name}: unknown key(s) {', '.join(map(repr, unknown))}")
        if "bind" in listener:
            try:
                split_host_port(listener["bind"])
            except ValueError as exc:
                raise click.UsageError(f"broker config {path}: listeners.{name}.bind: {exc}") from exc


def amqtt_bind(bind: str) -> str:
    """A checked ``HOST:PORT`` (ecq.config.split_host_port) in the form amqtt 0.12.1 binds: an IPv6 host without
    brackets (``[::1]:1883`` -> ``::1:1883``). amqtt keeps the brackets of ``[::1]:1883`` in the host it hands
    to ``asyncio.start_server``, which then fails with ``Name or service not known``; it splits at the last colon."""
    host, port = split_host_port(bind)
    return f"{host}:{port}"


def check_data_dir(path: Path) -> None:
    """Refuse a ``data_dir`` that is a file, cannot be created or is not writable, or whose ``queues``
    (LevelDB's directory, see ecq.store.layout) is a file or not writable (click.UsageError)."""
    if path.exists() and not path.is_dir():
        raise click.UsageError(f"data_dir {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.UsageError(f"data_dir {path}: cannot create it: {exc.strerror or exc}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise click.UsageError(f"data_dir {path}: not writable")
    queues = path / QUEUES
    if queues.exists() and not queues.is_dir():
        raise click.UsageError(f"data_dir {path}: {queues} exists and is not a directory")
    if queues.exists() and not os.access(queues, os.W_OK | os.X_OK):
        raise click.UsageError(f"data_dir {path}: {queues} is not writable")


def _check_bind(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        try:
            split_host_port(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from exc
    return value


def check_plugin_options(options: dict[str, Any]) -> EcqSettings:
    """Validate the ECQ plugin options and the ACL file they name.

    Raises click.UsageError naming each bad option and its rule, or ``file:line: what is wrong``.
    """
    try:
        settings = EcqSettings(**options)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in exc.errors())
        raise click.UsageError(f"invalid {PLUGIN_PATH} option: {problems}") from exc
    if settings.acl_file:
        try:
            load_acl(settings.acl_file)
        except AclError as exc:
            raise click.UsageError(f"bad ACL file: {exc}") from exc
    check_data_dir(settings.data_dir)
    return settings


@main.command()
@click.option("-c", "--config", "config_path", type=click.Path(path_type=Path, dir_okay=False),
              help="amqtt broker YAML config listing ecq.broker.plugin.EcqPlugin (default: the packaged one)")
@click.option("--bind", callback=_check_bind,
              help="HOST:PORT of the MQTT TCP listener, [HOST]:PORT for IPv6 (overrides the config's default listener)")
@click.option("--data-dir", type=click.Path(path_type=Path, file_okay=False),
              help="data directory: LevelDB in DIR/queues, events in DIR/events (overrides the plugin's data_dir)")
@click.option("--acl", "acl_file", type=click.Path(path_type=Path, dir_okay=False),
              help="ACL file in EMQX acl.conf syntax (overrides the plugin's acl_file)")
@click.option("--admin-bind", help="HOST:PORT of the admin API, [HOST]:PORT for IPv6 (overrides admin_bind; '' turns "
                                   "it off)")
@click.option("-v", "--verbose", is_flag=True, help="debug logging")
def broker(config_path: Path | None, bind: str | None, data_dir: Path | None, acl_file: Path | None,
           admin_bind: str | None, verbose: bool) -> None:
    """Run the MQTT broker with the ECQ plugin in the foreground until SIGINT or SIGTERM; SIGHUP reloads the ACL."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("transitions").setLevel(logging.WARNING)
    if not verbose:  # amqtt logs every connection at INFO; keep the broker's own warnings and ECQ's INFO
        logging.getLogger("amqtt").setLevel(logging.WARNING)
    config = load_broker_config(config_path)
    options = config["plugins"][PLUGIN_PATH]
    if data_dir is not None:
        options["data_dir"] = str(data_dir)
    if acl_file is not None:
        options["acl_file"] = str(acl_file)
    if admin_bind is not None:
        options["admin_bind"] = admin_bind
    if bind is not None:
        config.setdefault("listeners", {}).setdefault("default", {"type": "tcp"})["bind"] = bind
    for listener in (config.get("listeners") or {}).values():
        if "bind" in listener:
            listener["bind"] = amqtt_bind(listener["bind"])
    check_plugin_options(options)
    sys.exit(asyncio.run(_serve(config)))


async def _serve(config: dict[str, Any]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        broker = Broker(config)
        await broker.start()
    except Exception as exc:  # port in use, store corrupt or locked, admin API address taken: one line, exit 1
        cause = exc.__cause__ or exc
        log.error("broker failed to start: %s", cause)
        return 1
    plugin = next(p for p in broker.plugins_manager.plugins if isinstance(p, EcqPlugin))
    _tune_python_runtime()
    loop.add_signal_handler(signal.SIGHUP, _reload_acl, plugin)
    log.info("broker running; SIGINT or SIGTERM stops it, SIGHUP reloads the ACL")
    await stop.wait()
    log.info("stopping broker")
    await broker.shutdown()
    return 0


def _tune_python_runtime() -> None:
    """Keep Python's cyclic garbage collector and the GIL from stalling the event loop (the latency benchmark showed both).

    With CPython's thresholds (700, 10, 10) objects that live a few ms (events on their way to the event
    buffer, rows being exported, GC steps) survive two young collections, and each time that old
    generation grew by 25 % a full collection walks the whole heap: with 1,000 clients connected that took
    250-650 ms, every ~5 s during a GC pass, and now and then without one. With young collections only
    every GC_YOUNG_THRESHOLD allocations such objects die before they are examined (a young collection then
    took under 20 ms during a GC pass, up to 50 ms while 1,000 clients connect). What start-up made
    (modules, classes, the plugin) is frozen out of all later collections.

    The event loop gives up the GIL on every socket send and receive; when a helper thread (event
    buffer, lake export, batched store reads) runs Python meanwhile, the loop gets the GIL back only after
    the switch interval. At CPython's 5 ms, an event loop writing to a socket beside one busy thread
    managed one write per 140 us instead of 11 us; at 0.5 ms, one per 32 us (measured on this machine).

    Start-up reads every stored row (the store check, the stored totals, the lag index), and glibc keeps the heap
    that freed mapped, counted in RSS, until it happens to release it: ``malloc_trim`` gives it back now (1M
    entries: anonymous memory 114 MB before the trim, 94 MB after). Elsewhere than glibc nothing is done.
    """
    pygc.freeze()
    pygc.set_threshold(GC_YOUNG_THRESHOLD, 20, 10)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _reload_acl(plugin: EcqPlugin) -> None:
    try:
        plugin.reload_acl()
    except AclError as exc:
        log.error("ACL reload failed, keeping the old rules: %s", exc)


@main.command("repair")
@click.option("--data-dir", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="the broker's data_dir (the broker must be stopped)")
def repair(data_dir: Path) -> None:
    """Rebuild a damaged store from what can still be read (LevelDB RepairDB), and accept the loss of writes
    that LevelDB no longer holds (its log truncated or deleted: the broker refuses to start until then).

    Repairs DATA_DIR/queues, or DATA_DIR itself in the old layout (in place: the broker moves it on its
    next start). Entries in damaged blocks and the tail of a cut log are dropped: queue rows and acked
    positions may be lost or move back (a consumer then gets some messages again). Prints the seqnos lost
    that ECQ had committed. Exit 1 when it cannot repair.
    """
    try:
        queues = leveldb_dir(data_dir) or data_dir / QUEUES
        repair_store(queues)
        store = LevelDbStore(queues, accept_lost_writes=True)
        try:
            rows, _seconds = store.verify()
            entries, _bytes = store.stored_totals()
        finally:
            store.close()
    except StoreError as exc:
        click.echo(f"ecq repair: {exc}", err=True)
        sys.exit(1)
    click.echo(f"repaired {queues}: {rows} rows readable, {entries} queue entries; unreadable files, if any, "
               f"are in {queues / 'lost'} and LevelDB's report in {queues / 'LOG'}")
    if store.accepted_loss:
        click.echo(f"accepted the loss of writes ECQ had committed: {describe_missing(store.accepted_loss)}")


# --- operator commands: talk to the admin API --------------------------------------------------------

def admin_options(func):
    """--admin HOST:PORT, --token and --json, shared by the operator commands."""
    func = click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")(func)
    func = click.option("--token", default=lambda: os.environ.get("ECQ_ADMIN_TOKEN"),
                        help="admin bearer token (default: $ECQ_ADMIN_TOKEN)")(func)
    return click.option("--admin", default=DEFAULT_ADMIN, show_default=True,
                        help="HOST:PORT of the broker's admin API")(func)


def read_data_dir(data_dir: Path, admin: str, reader):
    """Run ``reader(store)`` on the LevelDB of a data dir (either layout, read in place: see
    ecq.store.layout.leveldb_dir) when no broker answers; raises Unreachable if it cannot be read."""
    try:
        queues = leveldb_dir(data_dir)
        if queues is None:
            raise Unreachable(f"no broker answers at {admin} and {data_dir} holds no ECQ data")
        store = LevelDbStore(queues)
    except StoreError as exc:
        raise Unreachable(f"no broker answers at {admin} and {exc}") from exc
    try:
        return reader(store)
    finally:
        store.close()


@main.command()
@admin_options
@click.option("--data-dir", type=click.Path(path_type=Path, file_okay=False), default=Path("storage"),
              show_default=True, help="read this data dir when no broker answers")
def status(admin: str, token: str | None, as_json: bool, data_dir: Path) -> None:
    """Queues, stored messages and bytes, consumers online, first/last index entries, consumer states."""
    try:
        data = check_answer(*call_admin(admin, "/api/v1/status", token))
    except Unreachable:
        data = read_data_dir(data_dir, admin, broker_status)
        data["source"] = f"data dir {data_dir} (no broker running)"
    emit(data, as_json, render_status)


@main.command()
@click.argument("clientid")
@admin_options
@click.option("--data-dir", type=click.Path(path_type=Path, file_okay=False), default=Path("storage"),
              show_default=True, help="read this data dir when no broker answers")
def inspect(clientid: str, admin: str, token: str | None, as_json: bool, data_dir: Path) -> None:
    """One queue: acked seqno, last ack time, queue range such as [3,...,9], pending, inflight, online."""
    try:
        data = check_answer(*call_admin(admin, f"/api/v1/queues/{urllib.request.quote(clientid, safe='')}", token))
    except Unreachable:
        data = read_data_dir(data_dir, admin, lambda store: queue_info(store, clientid))
        if data is None:
            click.echo(f"no queue for clientid {clientid!r}", err=True)
            sys.exit(EXIT_NOT_FOUND)
    emit(data, as_json, render_queue)


@main.command()
@click.option("-n", "count", type=click.IntRange(1, TOP_MAX), default=20, show_default=True,
              help="how many queues to list")
@click.option("--by", type=click.Choice(TOP_ORDERS), default="pending", show_default=True,
              help="rank by pending entries, age of the oldest pending entry, or pending payload bytes")
@admin_options
@click.option("--data-dir", type=click.Path(path_type=Path, file_okay=False), default=Path("storage"),
              show_default=True, help="read this data dir when no broker answers")
def top(count: int, by: str, admin: str, token: str | None, as_json: bool, data_dir: Path) -> None:
    """The most lagging queues: pending entries (stored, not acked), their payload bytes, the oldest one's age."""
    try:
        data = check_answer(*call_admin(admin, f"/api/v1/top?n={count}&by={by}", token))
    except Unreachable:
        data = read_data_dir(data_dir, admin, lambda store: top_report(scan_lag(store, {}), count, by, now_ms()))
        data["source"] = f"data dir {data_dir} (no broker running)"
    emit(data, as_json, render_top)


@main.command()
@admin_options
def gc(admin: str, token: str | None, as_json: bool) -> None:
    """Run garbage collection now on the running broker."""
    data = check_answer(*call_admin(admin, "/api/v1/gc", token, method="POST"))
    emit(data, as_json, lambda d: f"GC deleted {d['deleted']} expired entries")


@main.command()
@click.argument("clientid")
@click.argument("point", metavar="(N|earliest|latest|since:MS)")
@admin_options
def rewind(clientid: str, point: str, admin: str, token: str | None, as_json: bool) -> None:
    """Rewind the queue of CLIENTID on the running broker, online or offline: the next delivery is the first stored
    entry after seqno N, the oldest stored entry (earliest), the next write (latest), or the first entry published
    at or after MS, ms since the Unix epoch (since:MS). Prints the new acked seqno. Exits 1 for an N above the
    queue's last seqno and for a queue the broker knows nothing of (nothing is created)."""
    try:
        parse_rewind_point(point)
    except BadWrite as exc:
        raise click.BadParameter(str(exc), param_hint="POINT") from None
    path = (f"/api/v1/queues/{urllib.request.quote(clientid, safe='')}/rewind"
            f"?to={urllib.request.quote(point, safe='')}")
    data = check_answer(*call_admin(admin, path, token, method="POST"))
    emit(data, as_json, lambda d: f"rewound {d['clientid']}: acked seqno {d['acked']}, the next delivery is the "
                                  f"first stored entry after it")


@main.command()
@click.argument("clientid")
@click.argument("key")
@admin_options
def delete(clientid: str, key: str, admin: str, token: str | None, as_json: bool) -> None:
    """Delete KEY from the queue of CLIENTID on the running broker: writes a tombstone (an empty payload), which the
    consumer gets once as an empty PUBLISH. Refused when the broker runs with tombstones: false. Prints its seqno."""
    path = (f"/api/v1/queues/{urllib.request.quote(clientid, safe='')}/delete"
            f"?key={urllib.request.quote(key, safe='')}")
    data = check_answer(*call_admin(admin, path, token, method="POST"))
    emit(data, as_json, lambda d: f"deleted {d['key']} of {d['clientid']}: tombstone seqno {d['seqno']}")


@main.command()
@click.argument("clientid")
@admin_options
def purge(clientid: str, admin: str, token: str | None, as_json: bool) -> None:
    """Delete every stored entry of the queue of CLIENTID on the running broker. Its seqno counter and acked position
    stay, so nothing is delivered twice and the next write is delivered. Prints how many entries were deleted."""
    path = f"/api/v1/queues/{urllib.request.quote(clientid, safe='')}/purge"
    data = check_answer(*call_admin(admin, path, token, method="POST"))
    emit(data, as_json, lambda d: f"purged {d['clientid']}: {d['purged']} entries deleted")


@main.command("show-config")
@click.argument("which", type=click.Choice(["origin", "inuse"]), default="inuse")
@admin_options
def show_config(which: str, admin: str, token: str | None, as_json: bool) -> None:
    """The ECQ plugin options of the running broker: as given (origin) or in effect (inuse, the default), as YAML
    (JSON with --json)."""
    data = check_answer(*call_admin(admin, f"/api/v1/config?which={which}", token))
    emit(data, as_json, lambda d: yaml.safe_dump(d, sort_keys=False).rstrip("\n"))
