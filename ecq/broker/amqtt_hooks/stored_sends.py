"""A QoS 1/2 message of an ordinary topic sent to a connected persistent session stays in the session store until its
client acknowledges it, so that a broker killed before that (``kill -9``, a crash) sends it again after its restart
(MQTT 3.1.1 section 4.4; Mosquitto with persistence keeps its in-flight messages the same way).

amqtt 0.12.1 holds what it sends a session only in ``Session.inflight_out`` and in the send not yet started; ECQ
stored them only at SIGTERM (``stored_sessions.save_at_shutdown``). Now the fan-out stores each one as it hands it
to the connection (``conformance._fan_out``, one write batch per fan-out, before the publisher's PUBACK), and so does
the sending of a resumed session's queue (``conformance.offline_messages_not_retained``, the keys its take returned,
``cluster.store_offline_queues_in_the_cluster``): the send carries the stored copy's key (:func:`sending`), amqtt's
message flow notes it under the packet id (:func:`note`, ``conformance.resend_unacked_on_reconnect``), and the copy
is settled as its client's PUBACK (a QoS 2 one's PUBCOMP) is decoded (:func:`delete_stored_copies_at_acknowledgement`;
the store deletes those of one event-loop turn in one write batch, ``StoredSessions.settle_sends``), when the session
drops it (``session_max_inflight``, the connection's outgoing bound) or when the send never reached the flow (an MQTT
5 message not sent: expired, No Local, too large). The session's stored queue then holds, oldest first, what its
client has not acknowledged: after a restart its CONNECT gets them as new PUBLISHes, before newer ones. A QoS 2
message whose PUBREC came stays stored until its PUBCOMP: a broker killed in between sends it again after its restart
as a new PUBLISH (at least once; the PUBREL with its packet id is resent only after a SIGTERM, which stores it).
On a cluster the same holds: its store (``cluster_state.ClusterState``, JetStream) keeps each send under its stream
sequence, and a node's ``kill -9`` loses none, whether the client reconnects to the restarted node or another one.
A key is None for a message not stored (a failed write, NATS unreachable): it is sent all the same.
"""

from __future__ import annotations

import collections
import contextvars
from collections.abc import Coroutine
from typing import Any

from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.session import OUTGOING

from ecq.broker.amqtt_hooks.seam import step
from ecq.broker.amqtt_hooks.target import find_target

SENDING: contextvars.ContextVar[Any] = contextvars.ContextVar("ecq_stored_send", default=None)  # the key of the
# stored copy of the message the current task sends, until amqtt's flow notes it under its packet id
_KEYS = "_ecq_stored_sends"  # Session.attributes: packet id -> key of the stored copy of the message in flight
_TAKEN = "_ecq_taken_sends"  # Session.attributes: the keys of the messages of its queue being taken, oldest first


def delete_stored_copies_at_acknowledgement() -> None:
    """amqtt 0.12.1's ``BrokerProtocolHandler.handle_puback`` and ``handle_pubcomp`` end an outgoing message's flow
    (MQTT 3.1.1 sections 4.3.2, 4.3.3) in a task of its own, later. The stored copy of the message they acknowledge
    is settled at once instead, while the reader decodes the packet, as ``acks.handle_puback_at_once`` resolves its
    waiter: its delete is in the store before the answer to a later packet (a PINGRESP) is written, both at the
    event loop's next turn in that order; then amqtt's (or ECQ's) handling goes on."""
    def settle_the_stored_copy(handler: BrokerProtocolHandler, acknowledgement: Any) -> None:
        header = acknowledgement.variable_header
        acknowledged(handler, header.packet_id if header else None)

    step(BrokerProtocolHandler, "handle_puback", before=settle_the_stored_copy)
    step(BrokerProtocolHandler, "handle_pubcomp", before=settle_the_stored_copy)


def sending(key: Any) -> None:
    """The current task (one send, in a task of its own) sends the message stored under ``key``."""
    SENDING.set(key)


def sent(handler: Any, key: Any) -> None:
    """The current task's send ended: settle ``key`` if amqtt's flow never took the message (nothing holds it)."""
    if SENDING.get() is key:
        SENDING.set(None)
        settle(handler, [key])


def note(handler: Any, message: Any) -> None:
    """At the start of amqtt's flow of ``message``: keep the key of its stored copy under its packet id; one left
    under that id by a message amqtt no longer holds is settled."""
    key = SENDING.get()
    if key is None or message.direction != OUTGOING or message.packet_id is None or handler.session is None:
        return
    SENDING.set(None)
    keys = handler.session.attributes.setdefault(_KEYS, {})
    if (earlier := keys.get(message.packet_id)) is not None and earlier is not key:
        settle(handler, [earlier])
    keys[message.packet_id] = key


def acknowledged(handler: Any, packet_id: int | None) -> None:
    """The outgoing message of ``packet_id`` is acknowledged (or dropped): delete its stored copy, if it has one."""
    session = handler.session
    keys = session.attributes.get(_KEYS) if session is not None else None
    if keys and (key := keys.pop(packet_id, None)) is not None:
        if not keys:  # an idle session keeps no table
            del session.attributes[_KEYS]
        settle(handler, [key])


def held_keys(session: Any) -> frozenset[Any]:
    """The keys of the stored copies of ``session``'s messages in flight (sent, not acknowledged)."""
    return frozenset(session.attributes.get(_KEYS, {}).values())


def settle(handler: Any, keys: list[Any]) -> None:
    """Delete the stored copies of ``keys`` (Nones: not stored) through the plugin of ``handler``'s broker."""
    keys = [key for key in keys if key is not None]
    plugin = find_target(handler.plugins_manager) if keys else None
    if plugin is not None:
        plugin.session_sends.settled(keys)


async def send_stored(handler: Any, key: Any, send: Coroutine[Any, Any, Any]) -> Any:
    """Await ``send``, an ``mqtt_publish`` of the message stored under ``key``, in a task of its own (``gather``)."""
    sending(key)
    try:
        return await send
    finally:
        sent(handler, key)


def queue_taken(session: Any, keys: list[Any]) -> None:
    """``session``'s queue is being taken for sending, its messages stored under ``keys``, oldest first."""
    session.attributes[_TAKEN] = collections.deque(keys)


def next_taken(session: Any) -> Any:
    """The key of the stored copy of the next message taken from ``session``'s queue (None: none)."""
    taken = session.attributes.get(_TAKEN)
    if not taken:
        return None
    if len(taken) == 1:
        del session.attributes[_TAKEN]
    return taken.popleft()
