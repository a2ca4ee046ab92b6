"""Starting the broker: amqtt run with a checked config (ecq.broker.config_file), the runtime tuned, until a signal.

``ecq broker`` (ecq.cli) parses its command line, calls ecq.broker.config_file.prepare, then :func:`serve`;
nothing here knows the command line, as uvicorn keeps ``server.py`` apart from ``main.py``. This is the module
that loads amqtt: ecq.cli imports it only to run the broker.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import signal
import sys
from typing import Any

from amqtt.broker import Broker

from ecq.broker.acl import AclError
from ecq.broker.plugin import EcqPlugin
from ecq.queue.topics import printable

GC_YOUNG_THRESHOLD = 50_000  # allocations between young collections of Python's cyclic GC (CPython: 700)
GIL_SWITCH_INTERVAL_S = 0.0005  # how long a thread may hold the GIL while another waits (CPython: 0.005)

log = logging.getLogger("ecq")


class EscapingFormatter(logging.Formatter):
    """Log lines whose message has its control characters escaped (ecq.queue.topics.printable): client ids,
    usernames and topics come from clients, and amqtt logs them raw; one holding a newline would fake a log line,
    an ESC sequence act on the terminal showing the log. A traceback keeps its lines."""

    def format(self, record: logging.LogRecord) -> str:
        record = logging.makeLogRecord({**record.__dict__, "msg": printable(record.getMessage()), "args": None})
        return super().format(record)


def configure_logging(verbose: bool) -> None:
    """Log to stderr through :class:`EscapingFormatter`: DEBUG with ``verbose``; otherwise INFO, with amqtt's
    per-connection INFO lines left out."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    logging.getLogger("transitions").setLevel(logging.WARNING)
    if not verbose:
        logging.getLogger("amqtt").setLevel(logging.WARNING)


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
        plugin.controls.reload_acl()
    except AclError as exc:
        log.error("ACL reload failed, keeping the old rules: %s", exc)
