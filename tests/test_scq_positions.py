"""SCQ reader positions against a reference model (hypothesis): random histories of writes, readers attaching,
acking and dropping their connection, run on ``QueueEngine`` over a temp LevelDB with fake connections. Whatever the
history: a reader never gets again an entry it acked, each connection gets entries in seqno order, each once, and
once every reader is attached and acks everything, each has had the newest value of every key."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings as hypothesis_settings, strategies as st

from ecq.config import EcqSettings
from ecq.queue.engine import QueueEngine
from ecq.queue.topics import position_id, scq_queue_id
from ecq.store.backends import open_store
from ecq.store.protocol import AckState
from tests.fake_connection import FakeConnection, publish, settle

QUEUE = scq_queue_id("fleet")
READERS = ("r1", "r2", "r3")
KEYS = ("a", "b", "c")

steps = st.lists(st.one_of(
    st.tuples(st.just("write"), st.sampled_from(KEYS)),
    st.tuples(st.just("attach"), st.sampled_from(READERS)),
    st.tuples(st.just("ack"), st.sampled_from(READERS)),
    st.tuples(st.just("drop"), st.sampled_from(READERS)),
), max_size=30)


class Model:
    """What a history allows: the values written (their number is their seqno order), the newest per key, and
    per reader what it acked."""

    def __init__(self) -> None:
        self.written = 0
        self.newest: dict[str, int] = {}
        self.acked: dict[str, set[int]] = {reader: set() for reader in READERS}

    def write(self, key: str) -> int:
        self.written += 1
        self.newest[key] = self.written
        return self.written


async def run(history: list[tuple[str, str]], data_dir: Path) -> None:
    settings = EcqSettings(data_dir=data_dir, admin_bind=None, events=False, writer_pool_size=2, reader_batch_size=3)
    engine = QueueEngine(settings, open_store(settings), publish)
    await engine.start()
    model = Model()
    connections: dict[str, FakeConnection] = {}
    seen: dict[str, int] = {}  # connection id -> how many of its sends were checked
    try:
        for action, arg in history:
            if action == "write":
                value = model.write(arg)
                await engine.write(QUEUE, arg, str(value).encode())
            elif action == "attach" and arg not in connections:
                connections[arg] = FakeConnection()
                await engine.attach(position_id(QUEUE, arg), connections[arg], queue=QUEUE)
            elif action == "ack" and arg in connections:
                await asyncio.sleep(0.01)  # let deliveries start
                check(model, arg, connections[arg], seen)
                acked_now = [int(p) for _t, p in connections[arg].sent[len(connections[arg].sent)
                                                                         - connections[arg].unacked:]]
                connections[arg].ack()
                model.acked[arg].update(acked_now)
                consumer = engine.consumers[position_id(QUEUE, arg)]  # a PUBACK counts once the broker read it
                await settle(lambda: all(acked(consumer.state, seqno) for seqno in acked_now) and not consumer.saving)
            elif action == "drop" and arg in connections:
                check(model, arg, connections[arg], seen)
                connections.pop(arg).drop()
                engine.detach(position_id(QUEUE, arg))
                seen.pop(arg, None)
        for reader in READERS:  # the end: everyone attached, acking until nothing more comes
            if reader not in connections:
                connections[reader] = FakeConnection()
                await engine.attach(position_id(QUEUE, reader), connections[reader], queue=QUEUE)
        for reader, connection in connections.items():
            while not set(model.newest.values()) <= model.acked[reader]:  # a newest value not sent in 5 s fails
                await settle(lambda: connection.unacked > 0)
                check(model, reader, connection, seen)
                model.acked[reader].update(int(p) for _t, p in connection.sent[len(connection.sent)
                                                                                - connection.unacked:])
                connection.ack()
    finally:
        await engine.close()


def acked(state: AckState, seqno: int) -> bool:
    """True when ``state`` (a reader's position) holds the ack of entry ``seqno``."""
    return seqno <= state.acked or seqno in state.above


def check(model: Model, reader: str, connection: FakeConnection, seen: dict[str, int]) -> None:
    """The sends of ``connection`` not yet checked: on the SCQ's topics, in seqno order on this connection, none
    acked before by this reader, and none whose key had a newer value when the connection began reading."""
    values = [int(payload) for _topic, payload in connection.sent]
    assert values == sorted(values) and len(set(values)) == len(values), values
    for topic, payload in connection.sent[seen.get(reader, 0):]:
        assert topic.startswith(f"{QUEUE}/")
        assert int(payload) not in model.acked[reader], (reader, int(payload), model.acked[reader])
    seen[reader] = len(connection.sent)


@hypothesis_settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps)
@example([("write", "a"), ("attach", "r3"), ("ack", "r3"), ("drop", "r3")])  # a drop right after the PUBACK
def test_reader_positions_follow_the_model(history):
    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(run(history, Path(directory) / "db"))
