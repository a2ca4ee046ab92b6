"""An acknowledged message stays acknowledged; a persistent-session takeover keeps the new connection.

A PUBACK counts the moment it is decoded, also when the client resets the connection right after it
(:func:`resolve_pubacks_at_once`, :func:`read_to_the_end_after_a_reset`); a takeover closes only the old
connection (:func:`keep_the_new_connection_on_persistent_takeover`). Each corrects amqtt 0.12.1 (or asyncio).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Coroutine
from typing import Any

from amqtt.broker import Broker
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.puback import PubackPacket
from amqtt.session import Session

from ecq.broker.amqtt_hooks.ecq_paths import client_id, no_op
from ecq.broker.amqtt_hooks.seam import Result, replace, step
from ecq.broker.amqtt_hooks.target import find_target

log = logging.getLogger(__name__)


def resolve_pubacks_at_once() -> None:
    """Install :func:`handle_puback_at_once` as amqtt's ``BrokerProtocolHandler.handle_puback`` (the body of its one
    wrapper, a plain function as this one)."""
    step(BrokerProtocolHandler, "handle_puback", body=handle_puback_at_once)


def handle_puback_at_once(handler: BrokerProtocolHandler, puback: PubackPacket) -> Coroutine[Any, Any, None]:
    """Resolve the waiter of an incoming PUBACK while the reader loop decodes it, not in a task of its own.

    amqtt 0.12.1's reader loop runs ``handle_puback`` in a new task and cancels every such task still
    pending when the stream ends, so a PUBACK that arrived together with DISCONNECT or the end of the
    connection (``mosquitto_sub -C 1``) was dropped and ECQ redelivered an acknowledged message. Here the
    waiter is resolved before the reader reads the next packet; what amqtt schedules is a finished no-op.
    """
    packet_id = puback.packet_id
    waiter = handler._puback_waiters.get(packet_id)
    if waiter is None or waiter.done():
        log.warning("PUBACK for unknown packet id %s from %s", packet_id, client_id(handler))
    else:
        waiter.set_result(puback)
    return no_op()


def read_to_the_end_after_a_reset() -> None:
    """When a TCP connection fails, its StreamReader ends the stream after the bytes already received, as a
    normal close does.

    asyncio's ``StreamReader.set_exception`` makes every later read raise at once, even while the bytes
    received before the failure are still buffered. A client that closes with unread data in its socket
    makes its kernel send RST instead of FIN (``mosquitto_sub -C 1`` with more messages in flight): the
    PUBACK it sent just before was in the buffer, amqtt 0.12.1's reader loop never decoded it, and ECQ
    redelivered an acknowledged message. The error itself is only logged (debug).
    """
    original = Broker.stream_connected

    async def stream_connected(broker: Broker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                               listener_name: str) -> None:
        def end_of_stream(exc: BaseException) -> None:
            log.debug("connection error %r: the stream ends after the bytes already received", exc)
            reader.feed_eof()

        reader.set_exception = end_of_stream
        try:
            return await original(broker, reader, writer, listener_name)
        finally:  # the closure and the reader refer to each other: without this, a closed connection's reader,
            del reader.set_exception  # transport and socket waited for Python's cyclic GC (1,853 of 2,000 seen)

    replace(Broker, "stream_connected", stream_connected)


def stop_readers_that_missed_their_cancel() -> None:
    """amqtt 0.12.1's ``ProtocolHandler.stop`` cancels the connection's reader task once, then waits for it. amqtt's
    reader reads each packet under ``asyncio.wait_for``, which on Python 3.11 can swallow a cancel that arrives as
    the read completes (CPython gh-86296): the reader reads on, and ``stop`` waits until the client sends again or
    its keepalive runs out. A broker's SIGTERM (and a takeover) waited 15 s and more with such a client connected.
    So the cancel is repeated every :data:`RECANCEL_S` until the reader begins its exit (``_reader_stopped``,
    which its exit path sets before it yields) or ends."""
    original = BrokerProtocolHandler.stop

    async def stop(handler: BrokerProtocolHandler) -> None:
        reader = handler._reader_task
        if (reader is not None and reader is not asyncio.current_task()
                and find_target(handler.plugins_manager) is not None):
            while not reader.done() and not handler._reader_stopped.is_set():
                reader.cancel()
                await asyncio.wait([reader], timeout=RECANCEL_S)
        await original(handler)

    replace(BrokerProtocolHandler, "stop", stop)


RECANCEL_S = 0.1


def keep_the_new_connection_on_persistent_takeover() -> None:
    """Keep the newest connection of a persistent session up when it takes over an older one.

    On a takeover amqtt 0.12.1 hands the one Session object of a clean-session-off client to the new
    connection and stops the old connection's handler; the old message loop then ends in
    ``Broker._handle_disconnect``, which marks that shared session disconnected, fires
    CLIENT_DISCONNECTED and publishes the session's Will (by then the new CONNECT's). The session monitor
    later deletes the "disconnected" session and closes the new connection too (the new
    client saw EOF 0.7 s after its takeover). MQTT 3.1.1 section 3.1.4 closes only the existing connection. So the
    handler being replaced is noted before amqtt's takeover starts, and its end only stops that handler.
    """
    taken_over: weakref.WeakSet[BrokerProtocolHandler] = weakref.WeakSet()

    def note_the_handler_taken_over(broker: Broker, reader: Any, writer: Any, session: Session,
                                    handler: BrokerProtocolHandler, *args: Any) -> None:
        _, previous = broker._sessions.get(session.client_id, (None, None))
        if previous is not None and previous is not handler and previous.session is session:
            taken_over.add(previous)

    async def only_stop_the_old_handler(broker: Broker, session: Session, handler: BrokerProtocolHandler,
                                        disconnect_waiter: asyncio.Future) -> Result | None:
        if handler not in taken_over:
            return None
        await broker._stop_handler(handler)
        return Result(None)  # amqtt's disconnect, and what the corrections inside this one add to it, skipped

    step(Broker, "_handle_client_session", before=note_the_handler_taken_over)
    step(Broker, "_handle_disconnect", before=only_stop_the_old_handler)

