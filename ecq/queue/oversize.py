"""Queue entries above what the attached connection takes, skipped for it: the gaps in what a consumer was handed.

An entry whose PUBLISH would exceed an MQTT 5 consumer's Maximum Packet Size (MQTT 5.0 section 3.1.2.11.4,
MQTT-3.1.2-24: the ``fits`` given to ``Consumer.attach``) is skipped for that connection: not sent, not acked, counted
(``DeliveryObserver.skipped``). It stays in the consumer's ``_handed`` as a gap that ``acked`` does not pass, so the
entries after it are acked out of order (``above``) and never sent again, while it stays pending in the store: the
next connection reads from ``acked`` and gets it if its maximum is larger. The gap closes when compaction or GC
deletes the entry (``Consumer.appended``, ``Consumer.forget``). While it stays, ``above`` grows by one seqno per entry
acked after it, a cost paid again by every ack save: past :data:`MAX_ACKED_PAST_A_GAP` of them the oldest skipped
entry is dropped (passed as if acked, counted with reason :data:`DROPPED_TOO_LARGE`, logged), so the stored ack state
stays within a few kilobytes.

An SCQ group's consumer (ecq.queue.groups) skips an entry no connected member takes, and the one whose member that
took it left before it was sent (:class:`NoConnectionTakes`, raised by its publish); a member joining hands the
skipped entries out again (``Consumer.attach`` of the same connection).

Each function takes a consumer's ``skipped`` map (seqno -> the entry skipped for its connection) and, where the gaps
close, its ack state.
"""

from __future__ import annotations

import logging
from typing import Any

from ecq.store.protocol import AckState, Message

log = logging.getLogger(__name__)

SKIPPED_TOO_LARGE = "packet_too_large"  # the reason of a skip: above the connection's Maximum Packet Size
DROPPED_TOO_LARGE = "packet_too_large_dropped"  # a skipped entry given up: too many entries acked past it
MAX_ACKED_PAST_A_GAP = 1024  # entries acked out of order past a skipped one: 8 bytes each in every ack save


class NoConnectionTakes(Exception):
    """Raised by a consumer's ``publish`` when no connection it may send on takes the entry (an SCQ group whose
    members that take it left): the entry is skipped as one ``fits`` refused."""


def skip(skipped: dict[int, Message], clientid: str, message: Message, observer: Any) -> None:
    """Leave ``message`` of ``clientid``'s queue pending, a gap in what its connection is handed; tell ``observer``
    (a ``DeliveryObserver``) and log the first skip of a run."""
    if not skipped:
        log.info("ECQ entry %d of %s skipped: its PUBLISH is above the Maximum Packet Size of the consumer's "
                 "connection; later entries go on, it stays stored for a connection that takes it",
                 message.seqno, clientid)
    skipped[message.seqno] = message
    observer.skipped(clientid, message, SKIPPED_TOO_LARGE)


def close_gaps(skipped: dict[int, Message], state: AckState, seqnos: list[int]) -> bool:
    """Skipped entries ``seqnos`` were deleted: nothing is left to deliver, so ``acked`` may pass them (marked as
    acked out of order in ``state``, which the next fold turns into ``acked``). True when a gap closed."""
    for seqno in seqnos:
        del skipped[seqno]
        state.above.add(seqno)
    return bool(seqnos)


def superseded(skipped: dict[int, Message], key: str, seqno: int) -> list[int]:
    """The skipped entries of ``key`` older than ``seqno``, a newer value of it: compaction deleted them."""
    return [gap for gap, message in skipped.items() if message.key == key and gap < seqno]


def drop_past_bound(skipped: dict[int, Message], state: AckState, clientid: str, observer: Any) -> bool:
    """Give up the oldest skipped entry once more than :data:`MAX_ACKED_PAST_A_GAP` entries were acked past it:
    ``acked`` passes it, it is counted and logged, never delivered. True when one was dropped."""
    if not skipped or len(state.above) <= MAX_ACKED_PAST_A_GAP:
        return False
    oldest = min(skipped)
    log.warning("ECQ entry %d of %s dropped: it was skipped as above the consumer's Maximum Packet Size while "
                "%d later entries were acked", oldest, clientid, len(state.above))
    observer.skipped(clientid, skipped[oldest], DROPPED_TOO_LARGE)
    return close_gaps(skipped, state, [oldest])
