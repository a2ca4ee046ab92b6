"""ECQ topic grammar.

- producer PUBLISH   ``$ECQ/w/<clientid>/<key>``  (``<key>`` may itself contain ``/``)
- consumer SUBSCRIBE ``$ECQ/<clientid>/#``        (only by the client ``<clientid>``, QoS 1)
- broker PUBLISH     ``$ECQ/<clientid>/<key>``    (QoS 1, payload unchanged)
- owner PUBLISH      ``$ECQ/ctl/<clientid>/rewind`` (payload: a :class:`RewindPoint`, see :func:`parse_rewind_point`)

``w`` and ``ctl`` name the write and control namespaces, so clients with those ids cannot own a queue.

SCQ, the shared compacted queue (issue 33): one queue ``<queue>`` written once and read by many clients, each
reader with its own position.

- producer PUBLISH   ``$SCQ/w/<queue>/<key>``
- reader SUBSCRIBE   ``$SCQ/<queue>/#``                 (any client the ACL lets read it, QoS 1)
- broker PUBLISH     ``$SCQ/<queue>/<key>``              (QoS 1, payload unchanged)
- reader PUBLISH     ``$SCQ/ctl/<queue>/rewind``          (its own position; payload as ``$ECQ/ctl/<clientid>/rewind``)

``<queue>`` follows the clientid rules above (no ``/``, ``+``, ``#``, NUL; not ``w`` nor ``ctl``). An SCQ is stored
as the queue id ``$SCQ/<queue>`` (:func:`scq_queue_id`), which no ECQ clientid can be (it holds ``/``); a reader's
position is stored as the ack state of ``$SCQ/<queue>/<reader clientid>`` (:func:`position_id`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "$ECQ/"
WRITE_PREFIX = "$ECQ/w/"
SCQ_PREFIX = "$SCQ/"
SCQ_WRITE_PREFIX = "$SCQ/w/"
SCQ_CTL_PREFIX = "$SCQ/ctl/"
CTL_PREFIX = "$ECQ/ctl/"
REWIND_COMMAND = "rewind"
RESERVED_CLIENTIDS = frozenset({"w", "ctl"})  # $ECQ/w/... and $ECQ/ctl/... are not queues
MAX_SEQNO = 2**63 - 1  # the largest seqno or time a rewind payload may name (the int64 event columns)
_FORBIDDEN = ("+", "#", "\x00")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1: Unicode's control characters (Cc)
_REWIND_PAYLOAD = re.compile(r"(?:(?P<seqno>[0-9]{1,19})|(?P<word>earliest|latest)|since:(?P<since>[0-9]{1,19}))")


class BadWrite(ValueError):
    """A PUBLISH under ``$ECQ/`` that ECQ refuses; ``reason`` is a short machine-friendly label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Write:
    """A parsed producer write: the queue it goes to and the compaction key."""

    clientid: str
    key: str


def is_ecq_topic(topic: str) -> bool:
    """True for every topic or filter in a namespace ECQ owns: ``$ECQ/`` and ``$SCQ/`` (nothing but ECQ's own
    writes and deliveries go there: no routing, retaining or Will by amqtt)."""
    return topic.startswith(PREFIX) or topic.startswith(SCQ_PREFIX)


def is_scq_topic(topic: str) -> bool:
    """True for every topic or filter in the ``$SCQ/`` namespace (shared compacted queues)."""
    return topic.startswith(SCQ_PREFIX)


def scq_queue_id(queue: str) -> str:
    """The queue id the SCQ ``queue`` is stored under: ``$SCQ/<queue>`` (its delivery topics' first two levels)."""
    return f"{SCQ_PREFIX}{queue}"


def scq_write_topic(queue: str, key: str) -> str:
    """Topic a producer publishes a write to the SCQ ``queue`` on: ``$SCQ/w/<queue>/<key>``."""
    return f"{SCQ_WRITE_PREFIX}{queue}/{key}"


def scq_filter(queue: str) -> str:
    """The subscription filter that reads the SCQ ``queue``: ``$SCQ/<queue>/#``."""
    return f"{SCQ_PREFIX}{queue}/#"


def parse_scq_filter(topic_filter: str) -> str | None:
    """The queue id (``$SCQ/<queue>``) that ``topic_filter`` reads when it is exactly ``$SCQ/<queue>/#`` with a
    valid ``<queue>`` (the clientid rules of ``$ECQ/``), otherwise None."""
    if not topic_filter.startswith(SCQ_PREFIX) or not topic_filter.endswith("/#"):
        return None
    queue = topic_filter[len(SCQ_PREFIX):-2]
    if not _valid_queue_name(queue):
        return None
    return scq_queue_id(queue)


def position_id(queue_id: str, reader: str) -> str:
    """The id a reader's position in an SCQ is saved under, as an ack state: ``$SCQ/<queue>/<reader clientid>``.
    Neither an ECQ queue nor an SCQ queue id can be one: it holds two ``/`` and starts ``$SCQ/``."""
    return f"{queue_id}/{reader}"


def is_position_id(stored_id: str) -> bool:
    """True for the id of an SCQ reader's position (see :func:`position_id`), False for a queue id."""
    return stored_id.startswith(SCQ_PREFIX) and "/" in stored_id[len(SCQ_PREFIX):]


def queue_of_position(stored_id: str) -> str:
    """The SCQ queue id (``$SCQ/<queue>``) a position id (:func:`position_id`) is a reader's position in; any other
    stored id (a queue id) unchanged. A reader's client id may hold ``/``; a queue name never does."""
    if not is_position_id(stored_id):
        return stored_id
    return SCQ_PREFIX + stored_id[len(SCQ_PREFIX):].partition("/")[0]


def is_scq_queue_id(stored_id: str) -> bool:
    """True for the queue id of an SCQ (``$SCQ/<queue>``, see :func:`scq_queue_id`), False for a position id or an
    ECQ queue."""
    return stored_id.startswith(SCQ_PREFIX) and "/" not in stored_id[len(SCQ_PREFIX):]


def check_scq_name(name: str) -> None:
    """Raise ValueError unless ``name`` is a valid SCQ name (the clientid rules of ``$ECQ/``, see the module doc)."""
    if not _valid_queue_name(name):
        raise ValueError(f"{name!r} is no SCQ name: one topic level without +, # or NUL, not w nor ctl")


def _valid_queue_name(name: str) -> bool:
    return bool(name) and "/" not in name and not any(ch in name for ch in _FORBIDDEN) \
        and name not in RESERVED_CLIENTIDS


def reading_filter(topic: str) -> str:
    """The filter whose subscription a delivery on ``topic`` (``$ECQ/<clientid>/<key>`` or ``$SCQ/<queue>/<key>``)
    answers: its first two levels, then ``/#``."""
    return "/".join(topic.split("/", 2)[:2]) + "/#"


def write_topic(clientid: str, key: str) -> str:
    """Topic a producer publishes a write on: ``$ECQ/w/<clientid>/<key>``; the inverse of :func:`parse_write`.

    It checks nothing: the broker's :func:`parse_write` refuses a malformed one (a ``clientid`` that is empty or
    holds ``/``, ``+``, ``#`` or NUL; an empty ``key`` or one holding ``+``, ``#`` or NUL).
    """
    return f"{WRITE_PREFIX}{clientid}/{key}"


def parse_write(topic: str, payload_size: int, max_payload_bytes: int) -> Write:
    """Parse ``$ECQ/w/<clientid>/<key>`` (payload size in bytes) into a :class:`Write`.

    A write to an SCQ, ``$SCQ/w/<queue>/<key>``, gives ``Write(scq_queue_id(queue), key)`` by the same rules.
    Raises BadWrite with reason ``not_a_write`` (a PUBLISH to ``$ECQ/<clientid>/...`` or ``$SCQ/<queue>/...``),
    ``empty_clientid``, ``empty_key``, ``bad_clientid``/``bad_key`` (``+``, ``#`` or NUL inside; a clientid or
    queue ``w`` or ``ctl``, whose queue nobody could read) or ``payload_too_large``.
    """
    if topic.startswith(SCQ_WRITE_PREFIX):
        write = _parse_write(topic, SCQ_WRITE_PREFIX, payload_size, max_payload_bytes, "queue name")
        return Write(scq_queue_id(write.clientid), write.key)
    if topic.startswith(SCQ_PREFIX):
        raise BadWrite("not_a_write", f"refused PUBLISH to {topic!r}: SCQ writes go to $SCQ/w/<queue>/<key>")
    if not topic.startswith(WRITE_PREFIX):
        raise BadWrite("not_a_write", f"refused PUBLISH to {topic!r}: ECQ writes go to $ECQ/w/<clientid>/<key>")
    return _parse_write(topic, WRITE_PREFIX, payload_size, max_payload_bytes)


def _parse_write(topic: str, prefix: str, payload_size: int, max_payload_bytes: int, name: str = "clientid"
                 ) -> Write:
    """The rules of :func:`parse_write` after ``prefix``; ``name`` is what the first level is called in messages
    (``clientid``, or ``queue name`` for an SCQ), whose reasons keep the ``clientid`` labels."""
    clientid, _, key = topic[len(prefix):].partition("/")
    if not clientid:
        raise BadWrite("empty_clientid", f"refused write to {topic!r}: empty {name}")
    if not key:
        raise BadWrite("empty_key", f"refused write to {topic!r}: empty key")
    for label, what, value in (("clientid", name, clientid), ("key", "key", key)):
        if any(ch in value for ch in _FORBIDDEN):
            raise BadWrite(f"bad_{label}", f"refused write to {topic!r}: {what} contains '+', '#' or NUL")
    if clientid in RESERVED_CLIENTIDS:
        raise BadWrite("bad_clientid", f"refused write to {topic!r}: {clientid!r} cannot own a queue ({prefix} and "
                                       f"{prefix[:-2]}ctl/ are ECQ's own topics)")
    if payload_size > max_payload_bytes:
        raise BadWrite(
            "payload_too_large",
            f"refused write to {topic!r}: payload of {payload_size} bytes exceeds max_payload_bytes={max_payload_bytes}",
        )
    return Write(clientid, key)


def printable(text: str) -> str:
    """``text`` for a terminal: each control character (C0, DEL, C1) written as its Python escape (``\\x1b``,
    ``\\r``, ``\\n``, ``\\t``, ``\\x9b``), every other character as it is.

    The grammar admits any character but ``+``, ``#``, NUL and ``/`` in a clientid, so any producer can name
    a queue with an ESC sequence, a CR or a newline, which a terminal would act on (clearing the screen,
    rewriting a line, faking one). Every human-readable output of names from the store or a client goes
    through this; JSON output needs nothing (``json.dumps`` escapes them)."""
    return _CONTROL.sub(lambda match: repr(match.group())[1:-1], text)


def parse_target(topic: str) -> str | None:
    """The clientid a PUBLISH under ``$ECQ/w/`` or ``$ECQ/ctl/`` was meant for, or the queue id (``$SCQ/<queue>``) of
    one under ``$SCQ/w/`` or ``$SCQ/ctl/``, when one can be read from it (for logs and events)."""
    for prefix in (WRITE_PREFIX, CTL_PREFIX):
        if topic.startswith(prefix):
            return topic[len(prefix):].partition("/")[0] or None
    for prefix in (SCQ_WRITE_PREFIX, SCQ_CTL_PREFIX):
        if topic.startswith(prefix) and (queue := topic[len(prefix):].partition("/")[0]):
            return scq_queue_id(queue)
    return None


@dataclass(frozen=True, slots=True)
class RewindPoint:
    """Where a rewind puts a queue's acked position. ``kind``: ``seqno`` (``value`` is the seqno N: the next
    delivery is the first stored entry with seqno > N), ``earliest`` (from the oldest stored entry), ``latest``
    (skip everything stored now) or ``since`` (``value`` in ms since the Unix epoch: from the first stored entry
    published at or after it). ``str()`` gives the payload form back."""

    kind: str
    value: int = 0

    def __str__(self) -> str:
        if self.kind == "seqno":
            return str(self.value)
        return f"since:{self.value}" if self.kind == "since" else self.kind


def is_ctl_topic(topic: str) -> bool:
    """True for ``$ECQ/ctl/...`` and ``$SCQ/ctl/...``, the control topics (only ``$ECQ/ctl/<clientid>/rewind`` and
    ``$SCQ/ctl/<queue>/rewind`` exist)."""
    return topic.startswith(CTL_PREFIX) or topic.startswith(SCQ_CTL_PREFIX)


def scq_rewind_topic(queue: str) -> str:
    """Topic a reader publishes a rewind of its own position in the SCQ ``queue`` on: ``$SCQ/ctl/<queue>/rewind``."""
    return f"{SCQ_CTL_PREFIX}{queue}/{REWIND_COMMAND}"


def parse_scq_rewind_target(topic: str, reader: str) -> str:
    """The position id (:func:`position_id`) that ``$SCQ/ctl/<queue>/rewind`` published by the client ``reader``
    rewinds: that reader's own position in ``<queue>``, never another reader's.

    Raises BadWrite with reason ``not_a_write`` (another command under ``$SCQ/ctl/``), ``empty_clientid`` (an empty
    queue name) or ``bad_clientid`` (a queue name against the rules, see the module doc), the labels of ECQ's.
    """
    queue, _, command = topic[len(SCQ_CTL_PREFIX):].partition("/")
    if not topic.startswith(SCQ_CTL_PREFIX) or command != REWIND_COMMAND:
        raise BadWrite("not_a_write", f"refused PUBLISH to {topic!r}: the SCQ control topic is "
                                      f"{SCQ_CTL_PREFIX}<queue>/{REWIND_COMMAND}")
    if not queue:
        raise BadWrite("empty_clientid", f"refused rewind {topic!r}: empty queue name")
    if not _valid_queue_name(queue):
        raise BadWrite("bad_clientid", f"refused rewind {topic!r}: queue name contains '+', '#' or NUL, or is "
                                       f"{' or '.join(sorted(RESERVED_CLIENTIDS))}")
    return position_id(scq_queue_id(queue), reader)


def rewind_topic(clientid: str) -> str:
    """Topic the owner publishes a rewind of its queue on: ``$ECQ/ctl/<clientid>/rewind``."""
    return f"{CTL_PREFIX}{clientid}/{REWIND_COMMAND}"


def parse_rewind_point(text: str | bytes) -> RewindPoint:
    """Parse a rewind payload: a decimal seqno ``N``, ``earliest``, ``latest`` or ``since:<unix ms>`` (ASCII,
    surrounding whitespace ignored; numbers up to ``MAX_SEQNO``). Raises BadWrite with reason ``bad_rewind`` (its
    message quotes at most the first 40 characters)."""
    decoded = text.decode("ascii", "replace") if isinstance(text, bytes) else text
    match = _REWIND_PAYLOAD.fullmatch(decoded.strip())
    number = int(match["seqno"] or match["since"] or 0) if match else 0
    if match is None or number > MAX_SEQNO:
        raise BadWrite("bad_rewind", f"refused rewind payload {text[:40]!r}: expected a seqno N (0..{MAX_SEQNO}), "
                                     "'earliest', 'latest' or 'since:<unix ms>'")
    if match["word"]:
        return RewindPoint(match["word"])
    return RewindPoint("seqno" if match["seqno"] else "since", number)


def parse_rewind_target(topic: str, publisher: str) -> str:
    """The clientid of ``$ECQ/ctl/<clientid>/rewind`` published by the client ``publisher``.

    Raises BadWrite with reason ``not_a_write`` (another topic, or another command under ``$ECQ/ctl/``),
    ``empty_clientid``, ``bad_clientid`` (``+``, ``#`` or NUL inside, or ``w``/``ctl``) or ``not_owner``
    (``publisher`` is not ``<clientid>``: only a queue's owner may rewind it).
    """
    clientid, _, command = topic[len(CTL_PREFIX):].partition("/")
    if not is_ctl_topic(topic) or command != REWIND_COMMAND:
        raise BadWrite("not_a_write", f"refused PUBLISH to {topic!r}: the control topic is "
                                      f"{CTL_PREFIX}<clientid>/{REWIND_COMMAND}")
    if not clientid:
        raise BadWrite("empty_clientid", f"refused rewind {topic!r}: empty clientid")
    if any(ch in clientid for ch in _FORBIDDEN) or clientid in RESERVED_CLIENTIDS:
        raise BadWrite("bad_clientid", f"refused rewind {topic!r}: clientid contains '+', '#' or NUL, or is "
                                       f"{' or '.join(sorted(RESERVED_CLIENTIDS))}")
    if publisher != clientid:
        raise BadWrite("not_owner", f"refused rewind {topic!r}: only the client {clientid!r} may rewind its queue, "
                                    f"not {publisher!r}")
    return clientid


def queue_filter(clientid: str) -> str:
    """The one subscription filter that reads the queue of ``clientid``: ``$ECQ/<clientid>/#``."""
    return f"{PREFIX}{clientid}/#"


def delivery_topic(clientid: str, key: str) -> str:
    """Topic the broker publishes a queued value on: ``$ECQ/<clientid>/<key>``; for an SCQ's queue id
    ``$SCQ/<queue>`` (:func:`scq_queue_id`), ``$SCQ/<queue>/<key>``."""
    if clientid.startswith(SCQ_PREFIX):
        return f"{clientid}/{key}"
    return f"{PREFIX}{clientid}/{key}"
