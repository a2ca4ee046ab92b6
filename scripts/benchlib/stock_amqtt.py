"""Run stock amqtt 0.12.1 (no ECQ plugin) from a YAML config until SIGTERM: the benchmark's baseline broker.

Usage: python stock_amqtt.py CONFIG.yaml. Logging matches `ecq broker` (INFO, amqtt itself at WARNING),
so both brokers pay the same logging cost; like `ecq broker` it runs on asyncio's default event loop
(``asyncio.run``), so that both brokers run on the same event loop.
"""

import asyncio
import logging
import signal
import sys
from pathlib import Path

import yaml
from amqtt.broker import Broker


async def serve(config: dict) -> None:
    """Start the broker, wait for SIGTERM or SIGINT, shut it down."""
    broker = Broker(config)
    await broker.start()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await broker.shutdown()


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("amqtt").setLevel(logging.WARNING)
    logging.getLogger("transitions").setLevel(logging.WARNING)
    config = yaml.safe_load(Path(sys.argv[1]).read_text())
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
