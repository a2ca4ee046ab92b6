"""The ``ecq`` command line (console script): the commands only.

``ecq broker`` checks its config (ecq.broker.config_file) and runs amqtt with the ECQ plugin in the foreground
(ecq.broker.server, the one module here that loads amqtt, imported only by this command). ``ecq status``,
``ecq inspect``, ``ecq top``, ``ecq gc``, ``ecq rewind``, ``ecq delete``, ``ecq purge``, ``ecq drain`` and
``ecq show-config`` talk to a running broker through its admin API (ecq.ops.client), found from ``--admin``,
else $ECQ_ADMIN, else the ``admin_bind`` of the broker config given with ``-c``, else 127.0.0.1:18083; when no
broker answers, ``status``, ``inspect`` and ``top`` read the data directory directly. ``ecq repair`` rebuilds a
damaged store, or accepts the loss of writes whose LevelDB log was truncated or deleted.

Exit codes: 0 ok, 1 not found (a queue, or for ``delete`` a key the queue does not store; for ``broker``, a
runtime failure such as a port in use, a locked or corrupt store; for ``repair``, a store it cannot repair),
2 usage or configuration error, 3 broker unreachable or token refused.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import yaml

from ecq.broker import config_file
from ecq.config import split_host_port
from ecq.pipeline.cli import pipeline
from ecq.ops.client import (DEFAULT_ADMIN, EXIT_NOT_FOUND, Unreachable, admin_target, call_admin, check_answer,
                            emit, render_config, render_queue, render_scq, render_status, render_top)
from ecq.ops.status import broker_status, queue_info, scq_info
from ecq.queue.clock import now_ms
from ecq.queue.lag_reads import TOP_MAX, TOP_ORDERS, scan_lag, top_report
from ecq.store.protocol import StoreError
from ecq.queue.topics import BadWrite, parse_rewind_point, printable
from ecq.store.committed import describe as describe_missing
from ecq.store.leveldb import LevelDbStore
from ecq.store.leveldb_files import repair as repair_store
from ecq.store.layout import QUEUES, leveldb_dir

log = logging.getLogger("ecq")


@click.group()
@click.version_option(package_name="ecq", message="%(prog)s %(version)s")
def main() -> None:
    """ECQ: exclusive compacted queues for MQTT (amqtt broker plugin on LevelDB)."""


main.add_command(pipeline)


def _check_bind(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        try:
            split_host_port(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from exc
    return value


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
    try:
        config = config_file.prepare(config_path, bind=bind, data_dir=data_dir, acl_file=acl_file,
                                     admin_bind=admin_bind)
    except config_file.ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    from ecq.broker import server  # amqtt, loaded only to run the broker
    server.configure_logging(verbose)
    sys.exit(asyncio.run(server.serve(config)))


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
    """--admin HOST:PORT, --token, -c/--config and --json, shared by the operator commands: the command gets
    ``admin`` and ``token`` resolved by ecq.ops.client.admin_target (flag, environment, broker config, default)."""
    @functools.wraps(func)
    def resolved(*args, config_path: Path | None, **kwargs):
        kwargs["admin"], kwargs["token"] = admin_target(kwargs["admin"], kwargs["token"], config_path)
        return func(*args, **kwargs)

    resolved = click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")(resolved)
    resolved = click.option("-c", "--config", "config_path", type=click.Path(path_type=Path, dir_okay=False),
                            help="the broker's YAML config: its admin_bind and admin_token are used when --admin "
                                 "and --token (or their variables) are not given")(resolved)
    resolved = click.option("--token", envvar="ECQ_ADMIN_TOKEN", show_envvar=True,
                            help="admin bearer token [default: the config's admin_token]")(resolved)
    return click.option("--admin", envvar="ECQ_ADMIN", show_envvar=True,
                        help=f"HOST:PORT of the broker's admin API [default: the config's admin_bind, else "
                             f"{DEFAULT_ADMIN}]")(resolved)


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
@click.argument("clientid", required=False)
@click.option("--scq", "scq", default=None, help="the SCQ of this name and its readers instead of a queue")
@admin_options
@click.option("--data-dir", type=click.Path(path_type=Path, file_okay=False), default=Path("storage"),
              show_default=True, help="read this data dir when no broker answers")
def inspect(clientid: str | None, scq: str | None, admin: str, token: str | None, as_json: bool,
            data_dir: Path) -> None:
    """One queue: acked seqno, last ack time, queue range such as [3,...,9], pending, inflight, online. With --scq
    QUEUE (and no CLIENTID): that SCQ's range and its readers, each with its acked seqno and pending entries."""
    if (clientid is None) == (scq is None):
        raise click.UsageError("give a CLIENTID or --scq QUEUE")
    if scq is not None:
        data = _inspected(f"/api/v1/scq/{urllib.request.quote(scq, safe='')}", admin, token, data_dir,
                          lambda store: scq_info(store, scq), f"no SCQ {scq!r}")
        emit(data, as_json, render_scq)
        return
    data = _inspected(f"/api/v1/queues/{urllib.request.quote(clientid, safe='')}", admin, token, data_dir,
                      lambda store: queue_info(store, clientid), f"no queue for clientid {clientid!r}")
    emit(data, as_json, render_queue)


def _inspected(path: str, admin: str, token: str | None, data_dir: Path,
               offline: Callable[[Any], Any], missing: str) -> Any:
    """What the running broker answers at the admin API ``path``, or when none answers ``offline(store)`` read from
    ``data_dir``; exits EXIT_NOT_FOUND, saying ``missing``, when that finds nothing."""
    try:
        return check_answer(*call_admin(admin, path, token))
    except Unreachable:
        data = read_data_dir(data_dir, admin, offline)
        if data is None:
            click.echo(missing, err=True)
            sys.exit(EXIT_NOT_FOUND)
        return data


@main.command()
@click.option("-n", "count", type=click.IntRange(1, TOP_MAX), default=20, show_default=True,
              help="how many queues to list")
@click.option("--by", type=click.Choice(TOP_ORDERS), default="pending", show_default=True,
              help="rank by pending entries, age of the oldest pending entry, or pending payload bytes")
@click.option("--scq", "scq", default=None, help="only the readers of this SCQ: its slowest readers")
@admin_options
@click.option("--data-dir", type=click.Path(path_type=Path, file_okay=False), default=Path("storage"),
              show_default=True, help="read this data dir when no broker answers")
def top(count: int, by: str, scq: str | None, admin: str, token: str | None, as_json: bool, data_dir: Path) -> None:
    """The most lagging queues: pending entries (stored, not acked), their payload bytes, the oldest one's age; an
    SCQ's lag is its readers' (one row per reader)."""
    query = f"n={count}&by={by}" + (f"&scq={urllib.request.quote(scq, safe='')}" if scq is not None else "")
    try:
        data = check_answer(*call_admin(admin, f"/api/v1/top?{query}", token))
    except Unreachable:
        data = read_data_dir(data_dir, admin,
                             lambda store: top_report(scan_lag(store, {}), count, by, now_ms(), scq))
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
@click.option("--scq", "scq", default=None, help="rewind the position of the reader CLIENTID in this SCQ instead")
@admin_options
def rewind(clientid: str, point: str, scq: str | None, admin: str, token: str | None, as_json: bool) -> None:
    """Rewind the queue of CLIENTID on the running broker, online or offline: the next delivery is the first stored
    entry after seqno N, the oldest stored entry (earliest), the next write (latest), or the first entry published
    at or after MS, ms since the Unix epoch (since:MS). With --scq QUEUE, the position of the reader CLIENTID in
    that SCQ. Prints the new acked seqno. Exits 1 for an N above the queue's last seqno and for a queue (a reader's
    position) the broker knows nothing of (nothing is created)."""
    try:
        parse_rewind_point(point)
    except BadWrite as exc:
        raise click.BadParameter(str(exc), param_hint="POINT") from None
    target = (f"/api/v1/queues/{urllib.request.quote(clientid, safe='')}" if scq is None else
              f"/api/v1/scq/{urllib.request.quote(scq, safe='')}/readers/{urllib.request.quote(clientid, safe='')}")
    path = f"{target}/rewind?to={urllib.request.quote(point, safe='')}"
    data = check_answer(*call_admin(admin, path, token, method="POST"))
    emit(data, as_json, lambda d: f"rewound {_rewound_name(d)}: acked seqno {d['acked']}, the next delivery is the "
                                  f"first stored entry after it")


def _rewound_name(answer: dict) -> str:
    return answer["clientid"] if "clientid" in answer else f"the reader {answer['reader']} of the SCQ {answer['scq']}"


@main.command()
@click.argument("clientid")
@click.argument("key", required=False)
@click.option("--force", is_flag=True, help="write the tombstone even when the queue stores no value of KEY")
@click.option("--scq", "scq", default=None, help="delete from the SCQ of this name (then the one argument is KEY)")
@admin_options
def delete(clientid: str, key: str | None, force: bool, scq: str | None, admin: str, token: str | None,
           as_json: bool) -> None:
    """Delete KEY from the queue of CLIENTID on the running broker: writes a tombstone (an empty payload), which the
    consumer gets once as an empty PUBLISH. Prints its seqno. Exits 1, writing nothing, when the queue stores no
    value of KEY (never written, a typo, or deleted or expired since), unless --force. Refused when the broker runs
    with tombstones: false. ``ecq delete --scq QUEUE KEY`` deletes KEY from an SCQ, for every reader."""
    if scq is not None and key is None:
        clientid, key = scq, clientid
        target = f"/api/v1/scq/{urllib.request.quote(scq, safe='')}"
    elif scq is None and key is not None:
        target = f"/api/v1/queues/{urllib.request.quote(clientid, safe='')}"
    else:
        raise click.UsageError("give CLIENTID KEY, or --scq QUEUE KEY")
    path = f"{target}/delete?key={urllib.request.quote(key, safe='')}{'' if force else '&stored_only=1'}"
    status, data = call_admin(admin, path, token, method="POST")
    if status == 404:
        click.echo(f"{printable(str(data.get('error')))}; --force writes the tombstone anyway", err=True)
        sys.exit(EXIT_NOT_FOUND)
    data = check_answer(status, data)
    emit(data, as_json, lambda d: f"deleted {d['key']} of {d.get('clientid') or 'the SCQ ' + d['scq']}: tombstone "
                                  f"seqno {d['seqno']}")


@main.command()
@click.argument("clientid")
@admin_options
def purge(clientid: str, admin: str, token: str | None, as_json: bool) -> None:
    """Delete every stored entry of the queue of CLIENTID on the running broker. Its seqno counter and acked position
    stay, so nothing is delivered twice and the next write is delivered. Prints how many entries were deleted."""
    path = f"/api/v1/queues/{urllib.request.quote(clientid, safe='')}/purge"
    data = check_answer(*call_admin(admin, path, token, method="POST"))
    emit(data, as_json, lambda d: f"purged {d['clientid']}: {d['purged']} entries deleted")


DRAIN_ANSWER_TIMEOUT_S = 120.0  # a drain settles writes within write_timeout: far less, unless the node is stuck


@main.command()
@admin_options
def drain(admin: str, token: str | None, as_json: bool) -> None:
    """Drain the running broker before stopping it: it stops accepting connections, closes its clients so that
    they reconnect to another node, settles the writes it read (stored, or not PUBACKed so that they are sent
    again) and saves its consumers' acks; readiness is false from the start. Exit 0 once drained, 1 when writes
    were left unsettled."""
    status, data = call_admin(admin, "/api/v1/drain", token, method="POST", timeout=DRAIN_ANSWER_TIMEOUT_S)
    if status != 503:
        data = check_answer(status, data)
    emit(data, as_json, lambda d: (f"{'drained' if d['drained'] else 'NOT drained'} in {d['seconds']} s: "
                                   f"{d['connections_closed']} connections closed, {d['writes_in_flight']} writes "
                                   f"in flight settled ({d['writes_unsettled']} not), acks of "
                                   f"{d['consumers_released']} consumers saved"))
    if not data["drained"]:
        sys.exit(1)


@main.group()
def cluster() -> None:
    """Operations on the JetStream cluster behind the broker."""


@cluster.command()
@admin_options
def rebalance(admin: str, token: str | None, as_json: bool) -> None:
    """Spread the ECQ stream leaders over the NATS servers (leaders per server differ by at most one)."""
    data = check_answer(*call_admin(admin, "/api/v1/cluster/rebalance", token, method="POST"))
    emit(data, as_json, lambda d: f"moved {len(d['moved'])} stream leaders; leaders per server: " +
         ", ".join(f"{server} {count}" for server, count in sorted(d["leaders"].items())))


@main.command("show-config")
@click.argument("which", type=click.Choice(["origin", "inuse"]), default="inuse")
@admin_options
def show_config(which: str, admin: str, token: str | None, as_json: bool) -> None:
    """The ECQ plugin options of the running broker: as given (origin) or in effect (inuse, the default: computed
    values shown as computed, options the config does not set marked '# default'), as YAML (JSON with --json)."""
    data = check_answer(*call_admin(admin, f"/api/v1/config?which={which}", token))
    if which == "inuse" and not as_json:
        click.echo(render_config(data, check_answer(*call_admin(admin, "/api/v1/config?which=origin", token))))
    else:
        emit(data, as_json, lambda d: yaml.safe_dump(d, sort_keys=False).rstrip("\n"))
