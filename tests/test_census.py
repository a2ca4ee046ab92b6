"""ecq.queue.census: the engine's totals and heartbeat from counts kept as consumers change, against the walk over
every consumer they replace, and the lag index's totals, summed again only after a change, against the sum over
every lagging queue (issue 32: idle costs nothing). A real engine over a temp LevelDB, fake connections,
random sequences of what clients and operators do; after each step the kept counts equal the walk's, and every
consumer the walk's heartbeat would act on (wake an idle one that is behind, forget an offline one with nothing
left to save or resend) is among those the heartbeat looks at."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings as hypothesis_settings, strategies as st

from ecq.config import EcqSettings
from ecq.queue.clock import now_ms
from ecq.queue.engine import QueueEngine
from ecq.queue.topics import RewindPoint
from ecq.store.backends import open_store
from tests.fake_connection import FakeConnection, publish, settle

CLIENTS = ("a", "b", "c")
STEP_TIMEOUT_S = 5.0

client = st.sampled_from(CLIENTS)
step = st.one_of(
    st.tuples(st.just("write"), client, st.sampled_from(("k1", "k2", "k3"))),
    st.tuples(st.just("attach"), client),
    st.tuples(st.just("detach"), client),
    st.tuples(st.just("ack"), client, st.integers(1, 3)),
    st.tuples(st.just("drop"), client),
    st.tuples(st.just("stop_sending"), client),
    st.tuples(st.just("rewind"), client),
    st.tuples(st.just("heartbeat"),),
)


def walked_totals(engine: QueueEngine) -> tuple[int, int]:
    """(inflight, online) as ``QueueEngine.totals`` counted them before the census: a walk over every consumer."""
    consumers = engine.consumers.values()
    return sum(len(c.inflight) for c in consumers), sum(1 for c in consumers if c.online)


def walk_would_act_on(consumer) -> bool:
    """The heartbeat's rule before the census, applied to every consumer: wake it, or forget it."""
    if consumer.online:
        return not consumer.inflight and consumer.behind
    return not consumer.saving and not consumer.resends.attempts


def walked_lag(engine: QueueEngine) -> tuple[int, float]:
    """(pending, age of the oldest pending entry in s) as ``LagIndex.totals`` summed them at every call."""
    queues = engine.lag.queues.values()
    oldest = min((lag.oldest_ms for lag in queues), default=0)
    return sum(lag.pending for lag in queues), max(0.0, (now_ms() - oldest) / 1000) if oldest else 0.0


def check(engine: QueueEngine) -> None:
    totals = engine.totals()
    assert (totals.inflight, totals.online) == walked_totals(engine)
    before = walked_lag(engine)
    pending, age_s = engine.lag.totals()
    after = walked_lag(engine)
    assert pending == before[0] and before[1] <= age_s <= after[1]  # the clock moves on between the three
    missed = [c.clientid for c in engine.consumers.values()
              if walk_would_act_on(c) and c not in engine.census.unsettled]
    assert not missed, f"the heartbeat would not look at {missed}"


async def run(steps: list[tuple], data_dir: Path) -> None:
    config = EcqSettings(data_dir=data_dir, admin_bind=None, events=False, writer_pool_size=2, reader_batch_size=2)
    engine = QueueEngine(config, open_store(config), publish)
    await engine.start()
    connections: dict[str, FakeConnection] = {}
    try:
        for kind, *args in steps:
            cid = args[0] if args else None
            if kind == "write":
                await asyncio.wait_for(engine.write(cid, args[1], b"v"), STEP_TIMEOUT_S)
            elif kind == "attach":
                connections[cid] = FakeConnection()
                await asyncio.wait_for(engine.attach(cid, connections[cid]), STEP_TIMEOUT_S)
            elif kind == "detach":
                engine.detach(cid)
            elif kind == "ack" and cid in connections:
                connections[cid].ack(args[1])
            elif kind == "drop" and cid in connections:
                connections[cid].drop()
            elif kind == "stop_sending":
                engine.stop_sending(cid)
            elif kind == "rewind":
                await asyncio.wait_for(engine.rewind(cid, RewindPoint("earliest")), STEP_TIMEOUT_S)
            elif kind == "heartbeat":
                await engine.heartbeat()  # the lag index re-reads its dirty queues too
            for _ in range(3):  # deliveries, acks and reads move on between the steps
                await asyncio.sleep(0)
            check(engine)
        await settle(lambda: not any(c.saving for c in engine.consumers.values()), STEP_TIMEOUT_S)
        check(engine)
        await engine.heartbeat()
        assert not [c for c in engine.consumers.values() if not c.online and walk_would_act_on(c)]
    finally:
        await engine.close()


@hypothesis_settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, min_size=1, max_size=25))
@example([("write", "a", "k1"), ("attach", "a"), ("ack", "a", 3), ("heartbeat",), ("detach", "a"), ("rewind", "a"),
          ("heartbeat",)])  # the recount after a rewind of an offline queue makes its acked entry pending again
def test_census_and_lag_totals_equal_the_walks_they_replace(steps):
    with tempfile.TemporaryDirectory() as scratch:
        asyncio.run(asyncio.wait_for(run(steps, Path(scratch) / "db"), 60))
