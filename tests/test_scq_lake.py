"""SCQ events in the lake (issue 33 point 6): every queue event says its queue's kind, an SCQ's event names the SCQ
by its queue id and its delivered, acked and rewound events the reader; over TCP with paho against a real broker
process exporting to a real Parquet lake, on both storage backends."""

from __future__ import annotations

import pyarrow.dataset as ds

from ecq.events.schema import COLUMNS
from tests.harness import topics_payloads, wait_until, write
from tests.test_scq import FILTER, Q, delivered, read_all, scq_write

QUEUE_ID = f"$SCQ/{Q}"
GROUP = "$share/workers"


def lake_rows(lake) -> list[dict]:
    if not any(lake.rglob("*.parquet")):
        return []
    return ds.dataset(lake, format="parquet", partitioning="hive").to_table(columns=list(COLUMNS)).to_pylist()


def owners(lake, event_type: str) -> set[tuple]:
    """(clientid, kind, reader) of the lake's events of ``event_type``."""
    return {(r["clientid"], r["kind"], r["reader"]) for r in lake_rows(lake) if r["type"] == event_type}


def test_scq_events_carry_the_kind_the_queue_id_and_the_reader(backend_broker, connect, tmp_path):
    """Writes (one compacting another), a reader, a group member, a rewind and a refused write on an SCQ beside an ECQ
    queue: the SCQ's rows are ``kind`` scq under ``$SCQ/<queue>`` (never a reader's position id), its deliveries,
    acks and rewinds name the reader or the group; the ECQ queue's rows are ``kind`` ecq with no reader."""
    lake = tmp_path / "lake"
    broker = backend_broker(lake_dir=str(lake), export_interval="200ms", lake_file_age="200ms")
    producer = connect(broker.port, "producer")
    for key, payload in (("a", "1"), ("b", "2"), ("a", "3")):
        scq_write(producer, key, payload)
    write(producer, "own", "k", "x")
    assert read_all(connect, broker.port, "r1", 2) == [delivered("b", b"2"), delivered("a", b"3")]
    member = connect(broker.port, "worker-1")
    assert member.subscribe(f"{GROUP}/{FILTER}") == 1
    assert len(member.expect(2)) == 2
    reader = connect(broker.port, "r1")
    assert reader.subscribe(FILTER) == 1
    reader.publish(f"$SCQ/ctl/{Q}/rewind", b"earliest", 1)
    assert len(reader.expect(2)) == 2
    producer.publish(f"$SCQ/w/{Q}/", b"x", 1)  # empty_key
    own = connect(broker.port, "own")
    assert own.subscribe("$ECQ/own/#") == 1
    assert topics_payloads(own.expect(1)) == [("$ECQ/own/k", b"x")]

    scq, ecq = (QUEUE_ID, "scq", None), ("own", "ecq", None)
    readers = {(QUEUE_ID, "scq", "r1"), (QUEUE_ID, "scq", GROUP)}
    assert wait_until(lambda: owners(lake, "rewound") == {(QUEUE_ID, "scq", "r1")}
                      and owners(lake, "acked") == readers | {ecq} and owners(lake, "refused"), 10), lake_rows(lake)
    assert owners(lake, "appended") == {scq, ecq}
    assert owners(lake, "compacted") == {scq}
    assert owners(lake, "delivered") == readers | {ecq}
    assert owners(lake, "refused") == {(QUEUE_ID, "scq", None)}
