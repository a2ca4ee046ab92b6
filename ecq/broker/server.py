"""Starting the broker: the amqtt config checked and completed, the runtime tuned, amqtt run until a signal.

``ecq broker`` (ecq.cli) parses its command line and calls :func:`prepare` then :func:`serve`; nothing here
knows the command line, as uvicorn keeps ``server.py`` apart from ``main.py``.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import dataclasses
import gc
import logging
import os
import signal
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from amqtt.broker import Broker
from amqtt.contexts import BrokerConfig, ListenerConfig
from pydantic import ValidationError

from ecq.broker.acl import AclError, load_acl
from ecq.broker.plugin import PLUGIN_PATH, EcqPlugin
from ecq.config import EcqSettings, split_host_port
from ecq.store.layout import QUEUES

GC_YOUNG_THRESHOLD = 50_000  # allocations between young collections of Python's cyclic GC (CPython: 700)
GIL_SWITCH_INTERVAL_S = 0.0005  # how long a thread may hold the GIL while another waits (CPython: 0.005)
OLD_PLUGIN_PATH = "ecq.plugin.EcqPlugin"  # before the package layout; named in the error for old configs

log = logging.getLogger("ecq")


class ConfigError(ValueError):
    """A broker config, command-line override, plugin option, ACL file or data directory that cannot be used;
    the message names it and what is wrong."""


def prepare(config_path: Path | None, *, bind: str | None = None, data_dir: Path | None = None,
            acl_file: Path | None = None, admin_bind: str | None = None) -> dict[str, Any]:
    """The amqtt config ``ecq broker`` runs: the YAML at ``config_path`` (the packaged one when None) with the
    command line's overrides applied, its listener binds in amqtt's form and the plugin's options checked.
    Raises ConfigError naming what is wrong."""
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
    return config


def configure_logging(verbose: bool) -> None:
    """Log to stderr: DEBUG with ``verbose``; otherwise INFO, with amqtt's per-connection INFO lines left out."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("transitions").setLevel(logging.WARNING)
    if not verbose:
        logging.getLogger("amqtt").setLevel(logging.WARNING)


def load_broker_config(path: Path | None) -> dict[str, Any]:
    """Read an amqtt broker YAML config (the packaged default when ``path`` is None).

    Raises ConfigError when the file is unreadable, not YAML, or does not enable the ECQ plugin.
    """
    try:
        text = path.read_text() if path else resources.files("ecq").joinpath("default_broker.yaml").read_text()
        config = yaml.safe_load(text)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read broker config {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"broker config {path} is not a YAML mapping")
    plugins = config.get("plugins")
    if isinstance(plugins, list):  # amqtt also accepts a list of one-key mappings
        plugins = {k: v for item in plugins for k, v in (item.items() if isinstance(item, dict) else [(item, None)])}
        config["plugins"] = plugins
    if isinstance(plugins, dict) and OLD_PLUGIN_PATH in plugins:
        raise ConfigError(f"broker config {path}: the plugin {OLD_PLUGIN_PATH} is now {PLUGIN_PATH}; rename it "
                               "under 'plugins:'")
    if not isinstance(plugins, dict) or PLUGIN_PATH not in plugins:
        raise ConfigError(f"broker config {path} does not list {PLUGIN_PATH} under 'plugins:'")
    plugins[PLUGIN_PATH] = plugins[PLUGIN_PATH] or {}
    check_broker_keys(config, path)
    return config


# amqtt 0.12.1's BrokerConfig fields; it also takes `topic-check` for `topic_check`
_BROKER_KEYS = {f.name for f in dataclasses.fields(BrokerConfig)} | {"topic-check"}
_LISTENER_KEYS = {f.name for f in dataclasses.fields(ListenerConfig)}


def check_broker_keys(config: dict[str, Any], path: Path | None) -> None:
    """Refuse unknown top-level keys and listener keys of an amqtt broker config, and a listener ``bind``
    that is not ``HOST:PORT`` (amqtt 0.12.1 would bind every interface for ``:1883`` and port 1883 for
    ``127.0.0.1:``). Raises ConfigError naming the key."""
    unknown = sorted(set(config) - _BROKER_KEYS)
    if unknown:
        raise ConfigError(f"broker config {path}: unknown key(s) {', '.join(map(repr, unknown))}; "
                               f"amqtt accepts {', '.join(sorted(_BROKER_KEYS))}")
    listeners = config.get("listeners") or {}
    if not isinstance(listeners, dict):
        raise ConfigError(f"broker config {path}: 'listeners' must be a mapping of listener names")
    for name, listener in listeners.items():
        if not isinstance(listener, dict):
            raise ConfigError(f"broker config {path}: listeners.{name} must be a mapping")
        if unknown := sorted(set(listener) - _LISTENER_KEYS):
            raise ConfigError(f"broker config {path}: listeners.{name}: unknown key(s) {', '.join(map(repr, unknown))}")
        if "bind" in listener:
            try:
                split_host_port(listener["bind"])
            except ValueError as exc:
                raise ConfigError(f"broker config {path}: listeners.{name}.bind: {exc}") from exc


def amqtt_bind(bind: str) -> str:
    """A checked ``HOST:PORT`` (ecq.config.split_host_port) in the form amqtt 0.12.1 binds: an IPv6 host without
    brackets (``[::1]:1883`` -> ``::1:1883``). amqtt keeps the brackets of ``[::1]:1883`` in the host it hands
    to ``asyncio.start_server``, which then fails with ``Name or service not known``; it splits at the last colon."""
    host, port = split_host_port(bind)
    return f"{host}:{port}"


def check_data_dir(path: Path) -> None:
    """Refuse a ``data_dir`` that is a file, cannot be created or is not writable, or whose ``queues``
    (LevelDB's directory, see ecq.store.layout) is a file or not writable (ConfigError)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"data_dir {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"data_dir {path}: cannot create it: {exc.strerror or exc}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"data_dir {path}: not writable")
    queues = path / QUEUES
    if queues.exists() and not queues.is_dir():
        raise ConfigError(f"data_dir {path}: {queues} exists and is not a directory")
    if queues.exists() and not os.access(queues, os.W_OK | os.X_OK):
        raise ConfigError(f"data_dir {path}: {queues} is not writable")


def check_plugin_options(options: dict[str, Any]) -> EcqSettings:
    """Validate the ECQ plugin options and the ACL file they name.

    Raises ConfigError naming each bad option and its rule, or ``file:line: what is wrong``.
    """
    try:
        settings = EcqSettings(**options)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid {PLUGIN_PATH} option: {problems}") from exc
    if settings.acl_file:
        try:
            load_acl(settings.acl_file)
        except AclError as exc:
            raise ConfigError(f"bad ACL file: {exc}") from exc
    check_data_dir(settings.data_dir)
    return settings


async def serve(config: dict[str, Any]) -> int:
    """Start amqtt with ``config`` (from :func:`prepare`), run until SIGINT or SIGTERM, then shut down; SIGHUP
    reloads the ACL. Returns the exit code: 0 after a clean stop, 1 when the broker failed to start (a port in
    use, a locked or corrupt store, the admin API's address taken), logged in one line."""
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
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 10)
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
