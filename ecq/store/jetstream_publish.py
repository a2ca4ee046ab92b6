"""JetStream publishes of one group commit, pipelined on one reply subscription (runs on the NATS link's loop).

nats-py's ``request()`` costs, per message, a random token from ``secrets``, an ``asyncio.wait_for`` (a task and
a timer) and, through :meth:`ecq.store.link.NatsLink.request`, two more tasks that watch for a dropped
connection: on a 2-core machine that was most of the ECQ node's CPU per cluster write (py-spy, 6 producers).
:class:`BatchPublisher` sends every message of a batch with a reply subject ``<inbox>.<n>`` of one wildcard
subscription, keeps one future per message, and waits for all of them at once, bounded per try by
REQUEST_TIMEOUT_S and by the connection dropping. A message not stored (no answer in time, an error such as 503
during a leader election, a dropped connection) is sent again with the same ``Nats-Msg-Id`` until the
deadline, so one whose ack was lost is stored once (JetStream's duplicate window).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ecq.store.jsapi import REQUEST_TIMEOUT_S, RETRY_PAUSE_S
from ecq.store.link import NatsLink


class Publish(NamedTuple):
    """One message to store: ``subject``, ``payload`` bytes and ``headers`` (a ``Nats-Msg-Id`` among them)."""

    subject: str
    payload: bytes
    headers: dict[str, str]


class BatchPublisher:
    """Pipelined JetStream publishes over ``link`` (call :meth:`publish` on the link's loop).

    ``observe(seconds)`` is told each stored message's time from its first send to its ack."""

    def __init__(self, link: NatsLink, observe: Callable[[float], None]) -> None:
        self._link, self._observe = link, observe
        self._pending: dict[str, asyncio.Future] = {}
        self._tokens = itertools.count(1)
        self._inbox: str | None = None
        self._sub: Any = None

    async def publish(self, messages: Sequence[Publish], deadline: float) -> list[dict]:
        """JetStream's ack (``{"stream", "seq", ...}``) of each of ``messages``, in order, once every one is
        stored. Raises TimeoutError naming the last reason when some are still not stored at ``deadline``
        (time.monotonic()); those stored meanwhile stay stored."""
        started = time.monotonic()
        acks: list[dict | None] = [None] * len(messages)
        waiting = list(range(len(messages)))
        reason = "no answer"
        while True:
            reason = await self._try(messages, waiting, acks, deadline) or reason
            waiting = [i for i in waiting if acks[i] is None]
            if not waiting:
                break
            if time.monotonic() + RETRY_PAUSE_S >= deadline:
                raise TimeoutError(f"JetStream did not store {len(waiting)} of {len(messages)} messages: {reason}")
            await asyncio.sleep(RETRY_PAUSE_S)
        elapsed = time.monotonic() - started
        for _ in messages:
            self._observe(elapsed)
        return acks  # type: ignore[return-value]

    async def _try(self, messages: Sequence[Publish], indexes: list[int], acks: list[dict | None],
                   deadline: float) -> str | None:
        """Send ``messages[i]`` for each i of ``indexes`` and wait for their answers, at most REQUEST_TIMEOUT_S or
        until the connection drops; fills ``acks`` with the stored ones. Returns why some were not stored."""
        inbox = await self._reply_inbox()
        dropped = self._link.drop_event()
        sent: dict[str, tuple[int, asyncio.Future]] = {}
        for i in indexes:
            token = str(next(self._tokens))
            sent[token] = (i, asyncio.get_running_loop().create_future())
            self._pending[token] = sent[token][1]
            message = messages[i]
            await self._link.nc.publish(message.subject, message.payload, reply=f"{inbox}.{token}",
                                        headers=message.headers)
        answers = asyncio.gather(*(future for _i, future in sent.values()))
        drop = asyncio.ensure_future(dropped.wait())
        try:
            await asyncio.wait((answers, drop), timeout=max(0.05, min(REQUEST_TIMEOUT_S, deadline - time.monotonic())),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            drop.cancel()
            answers.cancel()  # the unanswered ones: sent again, with new reply subjects, by the next try
            for token in sent:
                self._pending.pop(token, None)
        return self._collect(sent, acks, dropped.is_set())

    @staticmethod
    def _collect(sent: dict[str, tuple[int, asyncio.Future]], acks: list[dict | None], dropped: bool) -> str | None:
        reason = None
        for i, future in sent.values():
            if not future.done() or future.cancelled():
                future.cancel()
                reason = "the NATS connection dropped" if dropped else f"no answer within {REQUEST_TIMEOUT_S:g} s"
                continue
            answer = json.loads(future.result().data or b"{}")
            if "error" in answer:  # e.g. 503 while the stream elects a leader
                reason = str(answer["error"].get("description"))
            elif "seq" in answer:
                acks[i] = answer
            else:
                reason = f"unexpected answer {answer}"
        return reason

    async def _reply_inbox(self) -> str:
        if self._sub is None:
            self._inbox = self._link.nc.new_inbox()
            self._sub = await self._link.nc.subscribe(f"{self._inbox}.*", cb=self._answered)
        return self._inbox

    async def _answered(self, msg: Any) -> None:
        future = self._pending.pop(msg.subject.rsplit(".", 1)[1], None)
        if future is not None and not future.done():
            future.set_result(msg)
