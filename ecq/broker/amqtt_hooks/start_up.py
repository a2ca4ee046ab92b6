"""Start-up failures are reported, not hidden: amqtt 0.12.1 logs "running" after the ECQ plugin failed to
start, and prints a traceback for an ordinary failure such as a port in use."""

from __future__ import annotations

import logging

from amqtt.broker import Broker

from ecq.broker.amqtt_hooks.seam import step
from ecq.broker.amqtt_hooks.target import find_target


def raise_pre_start_failure() -> None:
    """Make ``Broker.start`` raise the failure of the ECQ plugin's ``on_broker_pre_start`` before it opens any
    listener.

    amqtt 0.12.1's ``PluginManager.fire_event(PRE_START, wait=True)`` runs each plugin's handler in a task
    and only waits for it: an exception stays in the task, and ``Broker.start`` goes on to open the
    listeners, so a broker whose store, writers and admin API never started logged "running". The plugin
    keeps its failure in ``start_error``; ``Broker._start_listeners``, the next step of ``Broker.start``,
    raises it instead of opening the listeners (amqtt then marks the start failed and raises BrokerError from
    it).
    """

    def raise_the_plugins_failure(broker: Broker) -> None:
        if (plugin := find_target(broker.plugins_manager)) and plugin.start_error:
            raise plugin.start_error

    step(Broker, "_start_listeners", before=raise_the_plugins_failure)


class _NoStartFailureTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Broker startup failed"


def quiet_start_failure_traceback() -> None:
    """Drop amqtt 0.12.1's ``logger.exception("Broker startup failed")`` in ``Broker.start``: it prints a
    traceback for an ordinary failure such as a port in use, which ``ecq broker`` reports in one line."""
    logging.getLogger("amqtt.broker").addFilter(_NoStartFailureTraceback())
