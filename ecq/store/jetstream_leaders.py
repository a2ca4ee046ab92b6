"""Spreading the ECQ streams' leaders over the NATS servers.

JetStream places a stream's leader where its election happens to land (12 of 17 on one server was seen at a
start), and a leader does the stream's work: every publish, ack and stream info goes through it. :func:`plan`
picks moves that leave leaders per server differing by at most one, and :func:`rebalance` carries them out
with ``$JS.API.STREAM.LEADER.STEPDOWN.<stream>`` and ``{"placement": {"preferred": "<server>"}}`` (nats-server
2.11 and later), then waits for the new leaders.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from ecq.store.jetstream_health import StreamHealth, StreamState, leaders_per_server
from ecq.store.link import NatsLink

log = logging.getLogger(__name__)

STEPDOWN_TIMEOUT_S = 2.0    # one stepdown request
SETTLE_TIMEOUT_S = 5.0      # until every moved stream reports its new leader


def plan(states: Mapping[str, StreamState]) -> list[tuple[str, str]]:
    """Moves ``[(stream, new leader)]`` after which leaders per server differ by at most one: repeatedly the
    most loaded server hands one of its streams to the least loaded server holding a current replica of it."""
    load = {server: list(streams) for server, streams in leaders_per_server(states).items()}
    moves: list[tuple[str, str]] = []
    while load:
        busiest = max(load, key=lambda s: (len(load[s]), s))
        move = _one_move(states, load, busiest)
        if move is None:
            return moves
        stream, target = move
        load[busiest].remove(stream)
        load[target].append(stream)
        moves.append(move)
    return moves


def _one_move(states: Mapping[str, StreamState], load: dict[str, list[str]], busiest: str) -> tuple[str, str] | None:
    for target in sorted(load, key=lambda s: (len(load[s]), s)):
        if len(load[busiest]) - len(load[target]) <= 1:
            return None
        for stream in load[busiest]:
            if target in states[stream].current:
                return stream, target
    return None


async def rebalance(health: StreamHealth) -> dict[str, Any]:
    """Step down the leaders :func:`plan` moves, on the loop of ``health``'s link (await it there).

    Returns ``{"moved": [{"stream", "from", "to"}], "leaders": {server: count}}`` once the moved streams report
    their new leaders or SETTLE_TIMEOUT_S passed (then ``leaders`` says where they are). A stepdown JetStream
    refuses is logged and skipped."""
    await health.poll()
    before = dict(health.states)
    moved = []
    for stream, target in plan(before):
        if await _step_down(health.link, stream, target):
            moved.append({"stream": stream, "from": before[stream].leader, "to": target})
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while moved and time.monotonic() < deadline:
        await health.poll()
        if all(health.states[m["stream"]].leader == m["to"] for m in moved):
            break
        await asyncio.sleep(0.1)
    leaders = {server: len(streams) for server, streams in leaders_per_server(health.states).items()}
    if moved:
        log.info("ECQ moved %d stream leaders; leaders per server now %s", len(moved), leaders)
    return {"moved": moved, "leaders": leaders}


async def _step_down(link: NatsLink, stream: str, target: str) -> bool:
    request = json.dumps({"placement": {"preferred": target}}).encode()
    try:
        reply = await link.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", request,
                                      timeout=STEPDOWN_TIMEOUT_S)
        answer = json.loads(reply.data)
    except Exception as exc:  # timeout, no responders: the stream has no leader to step down now
        log.warning("ECQ could not move the leader of %s to %s: %s", stream, target, exc or type(exc).__name__)
        return False
    if "error" in answer:
        log.warning("ECQ could not move the leader of %s to %s: %s", stream, target,
                    answer["error"].get("description"))
        return False
    return True
