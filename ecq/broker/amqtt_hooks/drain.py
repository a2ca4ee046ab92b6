"""What draining a node (``ecq drain``, :mod:`ecq.broker.drain`) needs of amqtt 0.12.1's broker: its listening
servers and its live connections. amqtt has no public way to stop accepting while it keeps running (its
listeners close only in ``Broker.shutdown``, together with every session), nor to list the connections."""

from __future__ import annotations

from amqtt.broker import BrokerContext
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

from ecq.broker.amqtt_hooks.ecq_paths import connection_is_open


def close_listeners(context: BrokerContext) -> int:
    """Stop accepting connections on every MQTT listener of the broker (TCP, TLS and WebSocket); returns how
    many were closed. A client connecting afterwards is refused by the kernel (ECONNREFUSED) and tries another
    node. Connections already accepted stay (close them with :func:`ecq.broker.amqtt_hooks.close_connection`).
    amqtt keeps each listener's server in ``Broker._servers``; its ``shutdown`` closes them again, harmlessly."""
    closed = 0
    for server in context._broker_instance._servers.values():
        if server.instance is not None:  # amqtt's ExternalServer (connections handed in by the host) has none
            server.instance.close()
            closed += 1
    return closed


def open_connections(context: BrokerContext) -> list[BrokerProtocolHandler]:
    """The handler of every client connection still open (amqtt keeps them in ``Broker._sessions``)."""
    return [handler for _session, handler in list(context._broker_instance._sessions.values())
            if connection_is_open(handler)]
