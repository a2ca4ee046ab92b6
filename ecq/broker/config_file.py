"""The broker's config file: the amqtt YAML read, completed with the command line's overrides and checked,
before anything is bound. Imports nothing of amqtt at module level (its config field names are read when a
config is checked), so that the ``ecq`` operator commands can read the broker's config (``-c``) to find its
admin API without loading the broker.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ecq.broker.acl import AclError, load_acl
from ecq.config import EcqSettings, did_you_mean, explain_errors, split_host_port
from ecq.store.layout import QUEUES

PLUGIN_PATH = "ecq.broker.plugin.EcqPlugin"  # how a broker config enables ECQ (the class in ecq.broker.plugin)
OLD_PLUGIN_PATH = "ecq.plugin.EcqPlugin"  # before the package layout; named in the error for old configs


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


def load_broker_config(path: Path | None) -> dict[str, Any]:
    """Read an amqtt broker YAML config (the packaged default when ``path`` is None).

    Raises ConfigError when the file is unreadable, not YAML, or does not enable the ECQ plugin.
    """
    try:
        text = path.read_text() if path else resources.files("ecq").joinpath("default_broker.yaml").read_text()
        config = yaml.safe_load(text)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read broker config {path}: {_one_line(exc)}") from exc
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


def _one_line(exc: OSError | yaml.YAMLError) -> str:
    """PyYAML's errors span lines (the text around the mark, a caret): the problem and where, in one."""
    mark = getattr(exc, "problem_mark", None)
    if isinstance(exc, yaml.MarkedYAMLError) and mark is not None:
        context = f"{exc.context}: " if exc.context else ""
        return f"{context}{exc.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


@functools.cache
def amqtt_keys() -> tuple[frozenset[str], frozenset[str]]:
    """(top-level keys, listener keys) of an amqtt 0.12.1 broker config: its BrokerConfig and ListenerConfig
    fields (BrokerConfig also takes ``topic-check`` for ``topic_check``). Imports amqtt.contexts on first call."""
    from amqtt.contexts import BrokerConfig, ListenerConfig
    return (frozenset({f.name for f in dataclasses.fields(BrokerConfig)} | {"topic-check"}),
            frozenset(f.name for f in dataclasses.fields(ListenerConfig)))


def check_broker_keys(config: dict[str, Any], path: Path | None) -> None:
    """Refuse unknown top-level keys and listener keys of an amqtt broker config, and a listener ``bind``
    that is not ``HOST:PORT`` (amqtt 0.12.1 would bind every interface for ``:1883`` and port 1883 for
    ``127.0.0.1:``). Raises ConfigError naming the key."""
    broker_keys, listener_keys = amqtt_keys()
    if unknown := sorted(set(config) - broker_keys):
        raise ConfigError(f"broker config {path}: {_unknown(unknown, broker_keys)}; amqtt accepts "
                          f"{', '.join(sorted(broker_keys))}")
    listeners = config.get("listeners") or {}
    if not isinstance(listeners, dict):
        raise ConfigError(f"broker config {path}: 'listeners' must be a mapping of listener names")
    for name, listener in listeners.items():
        if not isinstance(listener, dict):
            raise ConfigError(f"broker config {path}: listeners.{name} must be a mapping")
        if unknown := sorted(set(listener) - listener_keys):
            raise ConfigError(f"broker config {path}: listeners.{name}: {_unknown(unknown, listener_keys)}")
        if "bind" in listener:
            try:
                split_host_port(listener["bind"])
            except ValueError as exc:
                raise ConfigError(f"broker config {path}: listeners.{name}.bind: {exc}") from exc


def _unknown(unknown: list[str], known: frozenset[str]) -> str:
    return f"unknown key(s) {', '.join(map(repr, unknown))}{did_you_mean(unknown[0], known, ' (did you mean {}?)')}"


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


def plugin_settings(options: dict[str, Any]) -> EcqSettings:
    """The ECQ plugin options as :class:`EcqSettings`; raises ConfigError naming each bad option and its rule
    in one line (an unknown option with the closest known one: ecq.config.explain_errors)."""
    try:
        return EcqSettings(**options)
    except ValidationError as exc:
        raise ConfigError(f"invalid {PLUGIN_PATH} option: {explain_errors(exc)}") from exc


def check_plugin_options(options: dict[str, Any]) -> EcqSettings:
    """Validate the ECQ plugin options and the ACL file they name.

    Raises ConfigError naming each bad option and its rule, or ``file:line: what is wrong``.
    """
    settings = plugin_settings(options)
    if settings.acl_file:
        try:
            load_acl(settings.acl_file)
        except AclError as exc:
            raise ConfigError(f"bad ACL file: {exc}") from exc
    check_data_dir(settings.data_dir)
    return settings


