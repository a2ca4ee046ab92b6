"""The ``ecq`` command line (console script). ``ecq broker`` runs amqtt with the ECQ plugin in the foreground.

Exit codes: 0 ok, 1 runtime failure (cannot bind, cannot open the store), 2 usage or configuration error.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import click
import yaml
from amqtt.broker import Broker
from pydantic import ValidationError

from ecq.config import EcqSettings
from ecq.plugin import PLUGIN_PATH

log = logging.getLogger("ecq")


@click.group()
def main() -> None:
    """ECQ: exclusive compacted queues for MQTT (amqtt broker plugin on LevelDB)."""


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
    if not isinstance(plugins, dict) or PLUGIN_PATH not in plugins:
        raise click.UsageError(f"broker config {path} does not list {PLUGIN_PATH} under 'plugins:'")
    plugins[PLUGIN_PATH] = plugins[PLUGIN_PATH] or {}
    return config


def check_plugin_options(options: dict[str, Any]) -> EcqSettings:
    """Validate the ECQ plugin options; raises click.UsageError naming each bad option and its rule."""
    try:
        return EcqSettings(**options)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in exc.errors())
        raise click.UsageError(f"invalid {PLUGIN_PATH} option: {problems}") from exc


@main.command()
@click.option("-c", "--config", "config_path", type=click.Path(path_type=Path, dir_okay=False),
              help="amqtt broker YAML config listing ecq.plugin.EcqPlugin (default: the packaged one)")
@click.option("--bind", help="HOST:PORT of the MQTT TCP listener (overrides the config's default listener)")
@click.option("--data-dir", type=click.Path(path_type=Path, file_okay=False),
              help="LevelDB directory (overrides the plugin's data_dir)")
@click.option("-v", "--verbose", is_flag=True, help="debug logging")
def broker(config_path: Path | None, bind: str | None, data_dir: Path | None, verbose: bool) -> None:
    """Run the MQTT broker with the ECQ plugin in the foreground until SIGINT or SIGTERM."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("transitions").setLevel(logging.WARNING)
    if not verbose:  # amqtt logs every connection at INFO; keep the broker's own warnings and ECQ's INFO
        logging.getLogger("amqtt").setLevel(logging.WARNING)
    config = load_broker_config(config_path)
    options = config["plugins"][PLUGIN_PATH]
    if data_dir is not None:
        options["data_dir"] = str(data_dir)
    if bind is not None:
        config.setdefault("listeners", {}).setdefault("default", {"type": "tcp"})["bind"] = bind
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
    except Exception as exc:
        cause = exc.__cause__ or exc
        log.error("broker failed to start: %s", cause)
        return 1
    log.info("broker running; SIGINT or SIGTERM stops it")
    await stop.wait()
    log.info("stopping broker")
    await broker.shutdown()
    return 0
