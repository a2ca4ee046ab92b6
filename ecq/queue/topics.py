"""ECQ topic grammar.

- producer PUBLISH   ``$ECQ/w/<clientid>/<key>``  (``<key>`` may itself contain ``/``)
- consumer SUBSCRIBE ``$ECQ/<clientid>/#``        (only by the client ``<clientid>``, QoS 1)
- broker PUBLISH     ``$ECQ/<clientid>/<key>``    (QoS 1, payload unchanged)
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "$ECQ/"
WRITE_PREFIX = "$ECQ/w/"
_FORBIDDEN = ("+", "#", "\x00")


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
    """True for every topic or filter in the ``$ECQ/`` namespace, which ECQ owns."""
    return topic.startswith(PREFIX)


def write_topic(clientid: str, key: str) -> str:
    """Topic a producer publishes a write on: ``$ECQ/w/<clientid>/<key>``; the inverse of :func:`parse_write`.

    It checks nothing: the broker's :func:`parse_write` refuses a malformed one (a ``clientid`` that is empty or
    holds ``/``, ``+``, ``#`` or NUL; an empty ``key`` or one holding ``+``, ``#`` or NUL).
    """
    return f"{WRITE_PREFIX}{clientid}/{key}"


def parse_write(topic: str, payload_size: int, max_payload_bytes: int) -> Write:
    """Parse ``$ECQ/w/<clientid>/<key>`` (payload size in bytes) into a :class:`Write`.

    Raises BadWrite with reason ``not_a_write`` (a PUBLISH to ``$ECQ/<clientid>/...``), ``empty_clientid``,
    ``empty_key``, ``bad_clientid``/``bad_key`` (``+``, ``#`` or NUL inside) or ``payload_too_large``.
    """
    if not topic.startswith(WRITE_PREFIX):
        raise BadWrite("not_a_write", f"refused PUBLISH to {topic!r}: ECQ writes go to $ECQ/w/<clientid>/<key>")
    clientid, _, key = topic[len(WRITE_PREFIX):].partition("/")
    if not clientid:
        raise BadWrite("empty_clientid", f"refused write to {topic!r}: empty clientid")
    if not key:
        raise BadWrite("empty_key", f"refused write to {topic!r}: empty key")
    for label, value in (("clientid", clientid), ("key", key)):
        if any(ch in value for ch in _FORBIDDEN):
            raise BadWrite(f"bad_{label}", f"refused write to {topic!r}: {label} contains '+', '#' or NUL")
    if payload_size > max_payload_bytes:
        raise BadWrite(
            "payload_too_large",
            f"refused write to {topic!r}: payload of {payload_size} bytes exceeds max_payload_bytes={max_payload_bytes}",
        )
    return Write(clientid, key)


def parse_target(topic: str) -> str | None:
    """The clientid a PUBLISH under ``$ECQ/w/`` was meant for, when one can be read from it (for logs and events)."""
    if not topic.startswith(WRITE_PREFIX):
        return None
    return topic[len(WRITE_PREFIX):].partition("/")[0] or None


def queue_filter(clientid: str) -> str:
    """The one subscription filter that reads the queue of ``clientid``: ``$ECQ/<clientid>/#``."""
    return f"{PREFIX}{clientid}/#"


def delivery_topic(clientid: str, key: str) -> str:
    """Topic the broker publishes a queued value on: ``$ECQ/<clientid>/<key>``."""
    return f"{PREFIX}{clientid}/{key}"
