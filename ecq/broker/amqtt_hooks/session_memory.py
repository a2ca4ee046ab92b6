"""What a device's session and connection cost in memory: amqtt 0.12.1's objects replaced by ones that do the same
for a fraction of it (issue 32: a fleet node holds devices by the hundred thousand, most of them idle or offline).

Measured with ``scripts/benchlib/heapprobe.py`` (tracemalloc, 2,000 persistent consumers): each amqtt ``Session``
kept a ``transitions.Machine`` (3 States, 5 Events, 14 Transitions: 15.9 KB), online and offline alike, and
``Session`` and ``BrokerProtocolHandler`` four ``asyncio.Queue`` (5 deques and an Event each, 1.5 KB even when
empty), and ``Broker._client_message_loop`` four tasks per connection. :class:`SessionState` and :class:`SmallQueue`
offer what amqtt and ECQ call on them and nothing more; the loop waits on one future. A TCP connection's asyncio
protocol keeps its drain waiters in a list, not a deque (:func:`lean_drain_waiters`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from types import GenericAlias
from typing import Any

from amqtt import session as amqtt_session
from amqtt.adapters import StreamWriterAdapter
from amqtt.broker import Broker
from amqtt.mqtt.protocol import broker_handler
from amqtt.session import Session
from transitions import MachineError

from ecq.broker.amqtt_hooks.conformance import _resolved
from ecq.broker.amqtt_hooks.seam import replace, step
from ecq.broker.amqtt_hooks.target import find_target

CONNECTED, DISCONNECTED, NEW = "connected", "disconnected", "new"


class SessionState:
    """The life of an amqtt session, as ``Session._init_states``'s ``transitions.Machine`` ran it: ``state`` is
    ``"new"``, ``"connected"`` or ``"disconnected"``; :meth:`connect` from ``new`` or ``disconnected``,
    :meth:`disconnect` from any state (``disconnected`` again too); entering a state calls the session's
    ``_on_enter_connected`` / ``_on_enter_disconnected`` (its connect and disconnect times). :meth:`connect` on a
    connected session raises ``transitions.MachineError``, which ``Broker._handle_client_session`` catches to take
    the session over (or, if the session is not connected, make a client reconnecting too quickly wait)."""

    __slots__ = ("_session", "state")

    def __init__(self, session: Session) -> None:
        self._session = session
        self.state = NEW

    def connect(self) -> None:
        """``new``/``disconnected`` -> ``connected``; raises MachineError when already connected."""
        if self.state == CONNECTED:
            raise MachineError(f"Can't trigger event connect from state {CONNECTED}!")
        self.state = CONNECTED
        self._session._on_enter_connected()

    def disconnect(self) -> None:
        """Any state -> ``disconnected``."""
        self.state = DISCONNECTED
        self._session._on_enter_disconnected()

    def is_new(self) -> bool:
        return self.state == NEW

    def is_connected(self) -> bool:
        return self.state == CONNECTED

    def is_disconnected(self) -> bool:
        return self.state == DISCONNECTED


class SmallQueue:
    """An unbounded FIFO with the ``asyncio.Queue`` methods amqtt and ECQ call (``put``, ``put_nowait``, ``get``,
    ``get_nowait`` raising ``asyncio.QueueEmpty``, ``qsize``, ``empty``, ``full``), in order and with ``get``'s
    cancellation handled as asyncio's, holding no container while empty and no waiter list while nobody waits
    (``asyncio.Queue``: five deques and an Event from the start, 1.5 KB). Bounded queues are not offered
    (amqtt's session and handler queues are unbounded): a ``maxsize`` raises ValueError."""

    __slots__ = ("_items", "_getters")
    __class_getitem__ = classmethod(GenericAlias)
    maxsize = 0

    def __init__(self, maxsize: int = 0) -> None:
        if maxsize:
            raise ValueError("SmallQueue is unbounded")
        self._items: deque | None = None
        self._getters: list[asyncio.Future] | None = None

    def qsize(self) -> int:
        return len(self._items) if self._items else 0

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return False

    def items(self) -> list[Any]:
        """What is queued, oldest first, left in the queue."""
        return list(self._items or ())

    def put_nowait(self, item: Any) -> None:
        if self._items is None:
            self._items = deque()
        self._items.append(item)
        self._wake_next()

    async def put(self, item: Any) -> None:
        self.put_nowait(item)

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        if not self._items:
            self._items = None
        return item

    async def get(self) -> Any:
        while not self._items:
            getter = asyncio.get_running_loop().create_future()
            if self._getters is None:
                self._getters = []
            self._getters.append(getter)
            try:
                await getter
            except BaseException:
                getter.cancel()
                self.forget(getter)
                if self._items and not getter.cancelled():
                    self._wake_next()  # woken, then cancelled: the item goes to the next getter
                raise
        return self.get_nowait()

    def wake_on_put(self, waiter: asyncio.Future) -> None:
        """Resolve ``waiter`` (to None) at the next put, unless it is done by then; items stay queued."""
        if self._getters is None:
            self._getters = []
        self._getters.append(waiter)

    def forget(self, waiter: asyncio.Future) -> None:
        """Stop waking ``waiter`` (a getter's future, or one given to :meth:`wake_on_put`)."""
        if self._getters is not None:
            with contextlib.suppress(ValueError):
                self._getters.remove(waiter)
            if not self._getters:
                self._getters = None

    def _wake_next(self) -> None:
        while self._getters:
            getter = self._getters.pop(0)
            if not getter.done():
                getter.set_result(None)
                break
        if not self._getters:
            self._getters = None


def light_session_state() -> None:
    """amqtt 0.12.1's ``Session._init_states`` gives every session a ``transitions.Machine`` (3 States, 5
    Events, 14 Transitions, callbacks: 15.9 KB per session, kept while it is offline): a :class:`SessionState`
    takes its place, with the same states, transitions, callbacks and MachineError."""
    def init_states(session: Session) -> None:
        session.transitions = SessionState(session)
    replace(Session, "_init_states", init_states)


def small_session_queues() -> None:
    """amqtt 0.12.1 gives each ``Session`` two ``asyncio.Queue`` (``retained_messages``, ``delivered_message_queue``)
    and each ``BrokerProtocolHandler`` two (``_pending_subscriptions``, ``_pending_unsubscriptions``), 1.5 KB each
    while empty: they are made :class:`SmallQueue` (the ``Queue`` name those two modules call)."""
    replace(amqtt_session, "Queue", SmallQueue)
    replace(broker_handler, "Queue", SmallQueue)


def one_waiter_per_connection() -> None:
    """amqtt 0.12.1's ``Broker._client_message_loop`` keeps four tasks per connection for its whole life (the
    DISCONNECT, the handler's pending SUBSCRIBE and UNSUBSCRIBE queues, the session's delivered messages), each with
    its coroutine, future and context: about 4 KB. The loop is run as amqtt runs it, each round handling the
    DISCONNECT (``_handle_disconnect``), then one SUBSCRIBE, one UNSUBSCRIBE and one message of those ready when the
    round began, a failed delivery (``_handle_message_delivery`` False) or a cancel ending it quietly; but between
    rounds it waits on one future, resolved by the DISCONNECT's future or a put into one of the three queues
    (:class:`SmallQueue`; any other queue gets amqtt's loop). What is queued stays queued until the loop takes it, so
    a round's DISCONNECT no longer drops what amqtt's waiters had already taken: the disconnect handling routes it
    (``conformance.route_what_was_read_before_the_disconnect``)."""
    original = Broker._client_message_loop

    async def client_message_loop(broker: Broker, session: Session, handler: Any) -> None:
        queues = (handler._pending_subscriptions, handler._pending_unsubscriptions, session.delivered_message_queue)
        if not all(isinstance(queue, SmallQueue) for queue in queues):
            return await original(broker, session, handler)
        disconnect = handler._disconnect_waiter or _resolved(None)
        subscriptions, unsubscriptions, messages = queues
        try:
            while True:
                await _next_round(disconnect, queues, handler)
                ready = [not queue.empty() for queue in queues]
                ended = disconnect.done()
                if ended:
                    await broker._handle_disconnect(session, handler, disconnect)
                if ready[0] and not subscriptions.empty():
                    await broker._handle_subscription(session, handler, _resolved(subscriptions.get_nowait()))
                if ready[1] and not unsubscriptions.empty():
                    await broker._handle_unsubscription(session, handler, _resolved(unsubscriptions.get_nowait()))
                if ready[2] and not messages.empty() and handler._is_attached():
                    if not await broker._handle_message_delivery(session, handler, _resolved(messages.get_nowait())):
                        return
                if ended:
                    return
        except asyncio.CancelledError:
            return

    replace(Broker, "_client_message_loop", client_message_loop)


async def _next_round(disconnect: asyncio.Future, queues: tuple[SmallQueue, ...], handler: Any) -> None:
    """Return once the DISCONNECT came or one of ``queues`` holds something to handle (the delivered messages only
    while ``handler`` is attached, as amqtt's ``mqtt_deliver_next_message``)."""
    if disconnect.done() or any(not queue.empty() for queue in queues[:2]) or (
            not queues[2].empty() and handler._is_attached()):
        return
    wake = asyncio.get_running_loop().create_future()

    def on_disconnect(_: asyncio.Future) -> None:
        if not wake.done():
            wake.set_result(None)

    disconnect.add_done_callback(on_disconnect)
    for queue in queues:
        queue.wake_on_put(wake)
    try:
        await wake
    finally:
        disconnect.remove_done_callback(on_disconnect)
        for queue in queues:
            queue.forget(wake)


def lean_drain_waiters() -> None:
    """amqtt 0.12.1 serves a TCP connection through asyncio's streams, whose protocol (``FlowControlMixin``, Python
    3.11) makes a ``collections.deque`` for the writers waiting in ``drain()`` as the connection opens: 760 bytes,
    empty for nearly every connection's whole life (a writer waits only while the client reads slower than it is
    sent to). As ``Broker._client_connected`` starts serving a connection of a broker with ECQ, that empty deque
    becomes an empty list (56 bytes), which does all asyncio does with it (append, remove, iterate)."""
    def with_a_lean_drain_list(broker: Broker, listener_name: str, reader: Any, writer: Any) -> None:
        if isinstance(writer, StreamWriterAdapter) and find_target(broker.plugins_manager) is not None:
            protocol = writer._writer._protocol
            if isinstance(protocol._drain_waiters, deque) and not protocol._drain_waiters:
                protocol._drain_waiters = []

    step(Broker, "_client_connected", before=with_a_lean_drain_list)
