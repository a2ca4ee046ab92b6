"""Start-up failures are reported, not hidden: amqtt 0.12.1 logs "running" after the ECQ plugin failed to
start, and prints a traceback for an ordinary failure such as a port in use."""

from __future__ import annotations

import logging
from typing import Any

from amqtt.events import BrokerEvents
from amqtt.plugins.manager import PluginManager

from ecq.broker.amqtt_hooks.target import find_target


def raise_pre_start_failure() -> None:
    """Make ``Broker.start`` raise the failure of the ECQ plugin's ``on_broker_pre_start``.

    amqtt 0.12.1's ``PluginManager.fire_event(PRE_START, wait=True)`` runs each plugin's handler in a task
    and only waits for it: an exception stays in the task, and ``Broker.start`` goes on to open the
    listeners, so a broker whose store, writers and admin API never started logged "running". The plugin
    keeps its failure in ``start_error``; this wrapper raises it before any listener is opened.
    """
    original_fire_event = PluginManager.fire_event

    async def fire_event(manager: PluginManager, event_name: Any, *, wait: bool = False, **kwargs: Any) -> None:
        await original_fire_event(manager, event_name, wait=wait, **kwargs)
        if event_name == BrokerEvents.PRE_START and (plugin := find_target(manager)) and plugin.start_error:
            raise plugin.start_error

    PluginManager.fire_event = fire_event


class _NoStartFailureTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Broker startup failed"


def quiet_start_failure_traceback() -> None:
    """Drop amqtt 0.12.1's ``logger.exception("Broker startup failed")`` in ``Broker.start``: it prints a
    traceback for an ordinary failure such as a port in use, which ``ecq broker`` reports in one line."""
    logging.getLogger("amqtt.broker").addFilter(_NoStartFailureTraceback())
