"""Nothing reaches ``$ECQ/<clientid>/...`` but ECQ's delivery: Wills, broadcasts and retained messages.

amqtt 0.12.1 would deliver any of the three to a queue subscription as if ECQ had sent it (a forged queue
delivery). Each function below closes one of these paths on a broker that runs the ECQ plugin.
"""

from __future__ import annotations

import logging
from typing import Any

from amqtt.broker import Broker
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

from ecq.broker.amqtt_hooks.authentication import refuse_connect
from ecq.broker.amqtt_hooks.seam import Result, step
from ecq.broker.amqtt_hooks.target import find_target
from ecq.queue.topics import is_ecq_topic

log = logging.getLogger(__name__)


def refuse_forbidden_wills() -> None:
    """Refuse a CONNECT whose Will the ECQ plugin forbids with CONNACK 0x05 (MQTT 3.1.1 section 3.2.2.3).

    amqtt 0.12.1 accepts any Will topic and, on an abnormal disconnect, broadcasts the Will (and with the
    Will Retain flag stores it) without asking the topic filters: a Will on ``$ECQ/<victim>/<key>`` reached
    the victim as a forged queue delivery. The check runs right after amqtt read the CONNECT, before it
    touches any existing session of that clientid (:func:`authentication.refuse_connect`: CONNACK, close, an
    error that ends the connection); the refusal is logged by ``AccessControl.will_refusal``, rate-limited.
    """

    async def refuse_a_forbidden_will(connected: tuple[BrokerProtocolHandler, Any], cls: type, reader: Any,
                                      writer: Any, plugins_manager: Any, loop: Any) -> None:
        _, session = connected
        plugin = find_target(plugins_manager)
        reason = plugin.will_refusal(session) if plugin is not None and session.will_flag else None
        if reason is not None:
            await refuse_connect(plugins_manager, writer, reason)

    step(BrokerProtocolHandler, "init_from_connect", after=refuse_a_forbidden_will)


def keep_ecq_out_of_broadcasts() -> None:
    """Drop, with a warning, any amqtt broadcast to an ``$ECQ/`` topic.

    amqtt 0.12.1's ``Broker._broadcast_message`` sends a topic to every matching subscription: a Will,
    ``BrokerContext.broadcast_message`` of any plugin, or ``internal_message_broadcast`` would reach the
    subscription ``$ECQ/<clientid>/#`` as if ECQ delivered it (or wait in an offline session's queue).
    ECQ's delivery does not go through it (see ``ecq_paths.publish_qos1``).
    """

    def drop_ecq_topics(broker: Broker, session: Any, topic: str | None, data: Any,
                        force_qos: int | None) -> Result | None:
        if topic is not None and is_ecq_topic(topic) and find_target(broker.plugins_manager) is not None:
            log.warning("ECQ dropped an amqtt broadcast to %r from %s: only ECQ delivers under $ECQ/",
                        topic, session.client_id if session else "the broker")
            return Result(None)
        return None

    step(Broker, "_broadcast_message", before=drop_ecq_topics)


def keep_ecq_out_of_retained_store() -> None:
    """Never store (nor clear) an ``$ECQ/`` topic in amqtt's retained messages; log a warning instead.

    amqtt 0.12.1's ``Broker.retain_message`` keeps the last retained message of a topic (from a Will with
    Will Retain, a PUBLISH with RETAIN, or a plugin) and replays it on every SUBSCRIBE that matches, so a
    retained ``$ECQ/<clientid>/<key>`` would come back on each re-subscribe to the queue. ECQ writes with
    RETAIN are stored as ordinary writes by ECQ and never reach this method.
    """

    def keep_ecq_out(broker: Broker, source_session: Any, topic_name: str, data: Any, qos: int | None) -> Result | None:
        if is_ecq_topic(topic_name) and find_target(broker.plugins_manager) is not None:
            log.warning("ECQ did not retain a message on %r from %s: amqtt never retains under $ECQ/",
                        topic_name, source_session.client_id if source_session else "the broker")
            return Result(None)
        return None

    step(Broker, "retain_message", before=keep_ecq_out)
