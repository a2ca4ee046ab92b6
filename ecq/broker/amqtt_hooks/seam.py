"""The one seam between ECQ and amqtt: every amqtt method ECQ replaces goes through :func:`replace` or :func:`step`,
every private amqtt name it reads is declared in :data:`PRIVATE_READS`, and both were written against
:data:`AMQTT_VERSION`.

Modelled on gevent's ``monkey.patch_item``: the first replacement of ``(owner, name)`` keeps amqtt's own attribute in
:data:`saved` (:func:`get_original`), and each replacement records the ECQ correction that made it, so
:func:`corrections` and :func:`describe` answer at run time "what does ECQ replace in amqtt, and with which corrections
in which order" (issue 32's one table).

A method only one correction replaces gets that correction's wrapper (:func:`replace`). A method several corrections
correct is installed as ONE wrapper (:func:`step`): each correction gives its parts, plain or coroutine functions
named for what they do before amqtt's call (``before``: change its arguments, or answer in its place with a
:class:`Result`, or have another coroutine awaited :class:`Instead`), after it (``after``: look at the result or
replace it), however it ended (``always``, a ``finally``), or as amqtt's body (the first correction's ``body``, which
may call amqtt's own), and the wrapper runs them in the order of the chain of wrappers they stand for: the first
correction of :data:`amqtt_hooks.CORRECTIONS` innermost, the last one's ``before`` first. A chain would be a frame
per correction in every call, and a method a connection stays in for its whole life (``Broker._client_connected``,
``_handle_client_session``, ``ProtocolHandler._reader_loop``) would keep each of them suspended per connected client.
Every method corrected more than once is so corrected; ``tests/test_seam.py`` fails on a chain (there is no
correction a step could not express: those that wrap amqtt's call in ``asyncio.wait_for`` or decide whether to call
it give the ``body``, a ``with`` around the call is a ``before`` and an ``always``).

:func:`apply` runs a table of corrections (``amqtt_hooks.CORRECTIONS``) after :func:`check_amqtt_version`; a
replacement outside it, or of a name its owner lacks, raises :class:`AmqttSeamError` instead of being made, and the
broker does not start.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

AMQTT_VERSION = "0.12.1"  # the amqtt every correction and every declared read was written against

# The private names ECQ reads (the ones it replaces among them), by the class that defines them: amqtt's, and the
# asyncio StreamReader that amqtt's StreamReaderAdapter wraps (what a connection received and has not read), and the
# StreamWriter's protocol (its drain waiters).
PRIVATE_READS: dict[str, tuple[str, ...]] = {
    "amqtt.broker.Broker": (
        "_authenticate", "_broadcast_message", "_broadcast_queue", "_cleanup_session", "_client_connected",
        "_client_message_loop",
        "_create_server_instance", "_del_subscription", "_delete_session", "_get_handler",
        "_handle_client_session", "_handle_disconnect", "_handle_message_delivery", "_handle_subscription",
        "_handle_unsubscription", "_initialize_client_session", "_matches",
        "_publish_session_retained_messages", "_retain_broadcast_message",
        "_retained_messages", "_run_broadcast", "_servers", "_sessions", "_start_listeners",
        "_stop_handler", "_subscriptions", "_topic_filtering"),
    "amqtt.broker.BrokerContext": ("_broker_instance",),
    "amqtt.session.Session": ("_on_enter_connected", "_on_enter_disconnected"),
    "amqtt.mqtt.protocol.handler.ProtocolHandler": (
        "_handle_message_flow", "_is_attached", "_puback_waiters", "_pubcomp_waiters", "_pubrec_waiters",
        "_pubrel_waiters", "_reader_loop", "_reader_ready", "_reader_stopped", "_reader_task", "_retry_deliveries",
        "_send_packet"),
    "amqtt.mqtt.protocol.broker_handler.BrokerProtocolHandler": (
        "_disconnect_waiter", "_pending_subscriptions", "_pending_unsubscriptions"),
    "amqtt.plugins.manager.PluginManager": ("_auth_plugins",),
    "amqtt.adapters.StreamReaderAdapter": ("_reader",),
    "amqtt.adapters.StreamWriterAdapter": ("_writer",),
    "amqtt.adapters.BufferReader": ("_stream",),
    "amqtt.adapters.WebSocketsReader": ("_protocol", "_stream"),
    "amqtt.adapters.WebSocketsWriter": ("_protocol",),
    "asyncio.StreamReader": ("_buffer",),
    "asyncio.StreamWriter": ("_protocol",),
    "asyncio.StreamReaderProtocol": ("_drain_waiters",),
}

Owner = type | ModuleType  # a class of amqtt's, or one of its modules (for a name it looks up there, as Queue)
saved: dict[tuple[Owner, str], Any] = {}  # (owner, name) -> amqtt's own attribute, as found in the class or module
_corrections: dict[tuple[Owner, str], list[str]] = {}  # (owner, name) -> the corrections wrapping it, innermost first
_steps: dict[tuple[Owner, str], list[Step]] = {}  # (owner, name) -> its corrections' steps (step()), innermost first
_applying: list[str] = []  # the correction being applied, while apply() runs it


class AmqttSeamError(RuntimeError):
    """The installed amqtt is not the one ECQ's corrections were written for, or a correction misused the seam."""


def check_amqtt_version(installed: str | None = None) -> None:
    """Raise :class:`AmqttSeamError` naming both versions unless ``installed`` (default: the installed distribution's
    version, ``importlib.metadata``) is :data:`AMQTT_VERSION`: each correction replaces a method whose body it knows."""
    installed = importlib.metadata.version("amqtt") if installed is None else installed
    if installed != AMQTT_VERSION:
        raise AmqttSeamError(f"ECQ corrects amqtt {AMQTT_VERSION}, but amqtt {installed} is installed: its methods "
                             f"may not do what ECQ's corrections expect; install amqtt=={AMQTT_VERSION}")


def apply(table: Iterable[Callable[[], None]]) -> None:
    """Check the amqtt version, then run each correction of ``table`` in order (each one's replacements wrap what the
    ones before it installed); :func:`describe` is logged at debug. Raises :class:`AmqttSeamError` (version, or a name
    missing on its owner)."""
    check_amqtt_version()
    for correction in table:
        _applying.append(_name_of(correction))
        try:
            correction()
        finally:
            _applying.pop()
    log.debug("%s", describe())


def replace(owner: Owner, name: str, replacement: Any) -> None:
    """Set ``owner.name`` to ``replacement`` (a function, or a classmethod object for a classmethod), keeping amqtt's
    own attribute in :data:`saved` the first time and recording the correction being applied. Raises
    :class:`AmqttSeamError` outside :func:`apply`, when ``owner`` has no ``name`` (amqtt changed) or when ``name`` is
    corrected through :func:`step` (one wrapper)."""
    key = _record(owner, name)
    if key in _steps:
        raise AmqttSeamError(f"{_label(owner)}.{name} is corrected through seam.step() (one wrapper): "
                             f"{_applying[-1]} must give its correction as a step too")
    _corrections[key].append(_applying[-1])
    setattr(owner, name, replacement)


@dataclass(frozen=True, slots=True)
class Result:
    """What a step decides the corrected call returns: given by a ``before``, the call returns ``value`` without the
    inner steps and amqtt's method being called (a correction that answers in amqtt's place); given by an ``after``,
    ``value`` replaces the result the call had."""

    value: Any


@dataclass(frozen=True, slots=True)
class Instead:
    """Given by a ``before`` of a coroutine method: the call awaits ``awaitable`` in place of the inner steps and
    amqtt's method, with no frame of that step's kept while it runs (a reader that serves a connection's whole life)."""

    awaitable: Any


@dataclass(frozen=True, slots=True)
class Step:
    """One correction's part of the one wrapper :func:`step` installs, each part a function called with the method's
    arguments, all positional as amqtt's signature names them (``self`` or ``cls`` first, defaults filled in):

    - ``before(*args)`` runs before the call and returns None (go on), the arguments the call gets from there on
      (the inner steps, amqtt), a :class:`Result` (the call returns it; the inner steps and amqtt are skipped) or,
      for a coroutine method, :class:`Instead` (what the call awaits in their place);
    - ``after(result, *args)`` runs once the call returned (not when it raised) and returns None (the result stays)
      or a :class:`Result` replacing it;
    - ``always(*args)``, plain, runs once the call ended, however it ended (a ``finally``);
    - ``body`` replaces amqtt's own method (it may call amqtt's, kept by its correction).

    ``before`` and ``after`` of a coroutine method may be coroutine functions (awaited); a plain method's are plain."""

    before: Callable[..., Any] | None = None
    after: Callable[..., Any] | None = None
    always: Callable[..., None] | None = None
    body: Callable[..., Any] | None = None
    before_awaits: bool = False
    after_awaits: bool = False


def step(owner: type, name: str, *, before: Callable[..., Any] | None = None, after: Callable[..., Any] | None = None,
         always: Callable[..., None] | None = None, body: Callable[..., Any] | None = None) -> None:
    """Correct the amqtt method (or classmethod) ``owner.name`` by a :class:`Step` of the correction being applied,
    and install one wrapper running all of its steps as the chain of wrappers :func:`replace` would make runs them:
    the befores of the later corrections first, then the body (amqtt's own, or the first step's ``body``), then the
    afters of the earlier ones first, and the ``always`` of each step whose ``before`` ran, innermost first, each
    whatever the one before it raised, as nested ``finally`` clauses do. A before returning a :class:`Result` (or
    :class:`Instead`) ends the way in: the call returns it through the afters of the steps outside that one. One
    difference from that chain, so that a call allocates nothing but its frame: every ``after`` and ``always`` is
    given the arguments as the befores left them, also those an inner correction's ``before`` replaced. The wrapper
    is a coroutine function when the body is one. Raises :class:`AmqttSeamError` as :func:`replace` does, and when
    ``owner.name`` is replaced through :func:`replace` too, has its body replaced by a step other than its first,
    or is a plain method given a coroutine function (or an ``always`` that is one)."""
    key = _record(owner, name)
    steps = _steps.setdefault(key, [])
    if len(_corrections[key]) > len(steps):
        _refuse_step(owner, name, "is replaced through seam.replace() too")
    if body is not None and steps:
        _refuse_step(owner, name, "has its body replaced by an earlier correction's step")
    amqtt_function = getattr(saved[key], "__func__", saved[key])
    awaits = inspect.iscoroutinefunction(body or (steps[0].body if steps else None) or amqtt_function)
    if inspect.iscoroutinefunction(always) or (not awaits and any(map(inspect.iscoroutinefunction, (before, after)))):
        _refuse_step(owner, name, "is given a coroutine function where it calls a plain one")
    steps.append(Step(before, after, always, body, inspect.iscoroutinefunction(before),
                      inspect.iscoroutinefunction(after)))
    _corrections[key].append(_applying[-1])
    wrapper = _one_wrapper(owner, name, amqtt_function, tuple(steps), awaits)
    setattr(owner, name, classmethod(wrapper) if isinstance(saved[key], classmethod) else wrapper)


def _refuse_step(owner: type, name: str, problem: str) -> None:
    raise AmqttSeamError(f"{_label(owner)}.{name}, corrected by {_applying[-1]} through seam.step(), {problem}")


def _one_wrapper(owner: type, name: str, original: Callable[..., Any], steps: tuple[Step, ...],
                 awaits: bool) -> Callable[..., Any]:
    """The function (a coroutine function when ``awaits``) running ``steps`` (innermost first) around ``original``,
    amqtt's function (see :func:`step`)."""
    body = steps[0].body or original
    outermost_first = steps[::-1]
    positional = _positional_arguments(original)

    async def corrected(*args: Any, **kwargs: Any) -> Any:
        args = positional(args, kwargs)
        del kwargs  # a frame kept for a connection's life (_reader_loop) holds no empty dict
        ran = 0  # the steps of outermost_first whose before ran: their always is due
        try:
            decided = None
            for each in outermost_first:
                if each.before is not None:
                    given = each.before(*args)
                    decided, args = _taken(await given if each.before_awaits else given, args)
                ran += 1
                if decided is not None:
                    break
            if decided is None:
                result = await body(*args)
            else:
                result = decided.value if type(decided) is Result else await decided.awaitable
            for each in _afters_due(outermost_first, ran, decided):
                given = each.after(result, *args)
                if each.after_awaits:
                    given = await given
                if given is not None:
                    result = given.value
            return result
        finally:
            _leave(outermost_first, ran, args)

    def corrected_plain(*args: Any, **kwargs: Any) -> Any:
        args = positional(args, kwargs)
        ran = 0
        try:
            decided = None
            for each in outermost_first:
                if each.before is not None:
                    decided, args = _taken(each.before(*args), args)
                ran += 1
                if decided is not None:
                    break
            result = decided.value if decided is not None else body(*args)
            for each in _afters_due(outermost_first, ran, decided):
                if (given := each.after(result, *args)) is not None:
                    result = given.value
            return result
        finally:
            _leave(outermost_first, ran, args)

    wrapper = corrected if awaits else corrected_plain
    # its frames named as the method they stand for, in tracebacks and profiles (py-spy), not "corrected"
    wrapper.__code__ = wrapper.__code__.replace(co_name=name, co_qualname=f"{owner.__qualname__}.{name}")
    wrapper.__name__, wrapper.__qualname__ = name, f"{owner.__qualname__}.{name}"
    return wrapper


def _taken(given: Any, args: tuple[Any, ...]) -> tuple[Result | Instead | None, tuple[Any, ...]]:
    """What a ``before`` gave, as (the :class:`Result` or :class:`Instead` deciding the call, else None; the
    arguments to go on with: the new ones it gave, or ``args``)."""
    if type(given) is Result or type(given) is Instead:
        return given, args
    return None, args if given is None else given


def _afters_due(outermost_first: tuple[Step, ...], ran: int, decided: Result | Instead | None) -> list[Step]:
    """The steps whose ``after`` runs, innermost first: those among the first ``ran`` of ``outermost_first`` whose
    ``before`` ran, but the one whose before ``decided`` the result, and that have an ``after``."""
    due = outermost_first[:ran - 1 if decided is not None else ran]
    return [each for each in reversed(due) if each.after is not None]


def _positional_arguments(function: Callable[..., Any]) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, ...]]:
    """``complete(args, kwargs)``: the arguments of a call of amqtt's ``function`` as one tuple, in the order of its
    parameters (keywords placed, defaults filled in); ``args`` itself when the call gave them all by position."""
    signature = inspect.signature(function)
    parameters = list(signature.parameters.values())
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters):
        raise AmqttSeamError(f"seam.step() corrects methods of plain parameters only, not {function.__qualname__}")
    count = len(parameters)
    defaults = tuple(p.default for p in parameters)

    def complete(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        if not kwargs:
            if len(args) == count:
                return args
            if inspect.Parameter.empty not in defaults[len(args):]:  # amqtt's defaults left out (force_qos)
                return args + defaults[len(args):]
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.args

    return complete


def _leave(outermost_first: tuple[Step, ...], ran: int, args: tuple[Any, ...]) -> None:
    """Run the ``always`` of the first ``ran`` steps of ``outermost_first`` with ``args``, the innermost first, each
    one whatever the one before it raised (the last exception raised propagates), as nested ``finally`` clauses run."""
    if ran:
        always = outermost_first[ran - 1].always
        try:
            if always is not None:
                always(*args)
        finally:
            _leave(outermost_first, ran - 1, args)


def _record(owner: Owner, name: str) -> tuple[Owner, str]:
    """``(owner, name)``, amqtt's own attribute kept in :data:`saved` the first time. Raises :class:`AmqttSeamError`
    outside :func:`apply` or when ``owner`` has no ``name`` (amqtt changed)."""
    if not _applying:
        raise AmqttSeamError(f"{_label(owner)}.{name} replaced outside amqtt_hooks.install(): add the correction "
                             f"to amqtt_hooks.CORRECTIONS")
    if not hasattr(owner, name):
        raise AmqttSeamError(f"amqtt {AMQTT_VERSION}'s {_label(owner)} has no {name}, which "
                             f"ECQ's correction {_applying[-1]} replaces")
    key = (owner, name)
    saved.setdefault(key, inspect.getattr_static(owner, name))
    _corrections.setdefault(key, [])
    return key


def kept_on(obj: Any, name: str, make: Callable[[], Any]) -> Any:
    """What ECQ keeps on the amqtt object ``obj`` (a Broker, Session, handler or reader adapter) under the attribute
    ``name`` (``_ecq_...``: amqtt has none of that name), made by ``make()`` at its first use."""
    kept = getattr(obj, name, None)
    if kept is None:
        kept = make()
        setattr(obj, name, kept)
    return kept


def get_original(owner: Owner, name: str) -> Any:
    """amqtt's own ``owner.name`` as it was before ECQ replaced it (the class's attribute: a classmethod object for a
    classmethod); the current attribute when ECQ does not replace it."""
    return saved.get((owner, name), inspect.getattr_static(owner, name))


def is_replaced(owner: Owner, name: str) -> bool:
    """Whether an ECQ correction replaced ``owner.name``."""
    return (owner, name) in saved


def corrections() -> dict[str, list[str]]:
    """``{"Owner.name": ["module.correction", ...]}``: what ECQ replaces in amqtt, each with the corrections wrapping
    it, innermost (first installed) first (for a method corrected by :func:`step`, its steps in that order)."""
    return {f"{owner.__name__}.{name}": list(names) for (owner, name), names in _corrections.items()}


def describe() -> str:
    """:func:`corrections` as text, one amqtt name a paragraph, sorted by name."""
    lines = [f"What ECQ replaces in amqtt {AMQTT_VERSION}, with its corrections in order (innermost first; the last "
             f"runs first):"]
    one_wrapper = {f"{owner.__name__}.{name}" for owner, name in _steps}
    for target, names in sorted(corrections().items()):
        lines.append(f"{target} (one wrapper)" if target in one_wrapper else target)
        lines.extend(f"    {name}" for name in names)
    return "\n".join(lines)


def _label(owner: Owner) -> str:
    """``amqtt.broker.Broker`` for a class, ``amqtt.session`` for a module (a name amqtt looks up in its module, such
    as the ``Queue`` it builds a session's queues with)."""
    return owner.__name__ if isinstance(owner, ModuleType) else f"{owner.__module__}.{owner.__qualname__}"


def _name_of(correction: Callable[[], None]) -> str:
    return f"{correction.__module__.rsplit('.', 1)[-1]}.{correction.__qualname__}"
