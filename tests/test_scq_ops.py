"""Operating SCQs (issue 33, points 5 and 6): lag per reader (`ecq top`, GET /api/v1/top, the pending metrics),
over TCP with paho against a real broker process, on both storage backends."""

from __future__ import annotations

import json
import time
import urllib.error

import pytest

from tests.harness import free_port, topics_payloads, wait_until, write
from tests.test_operations import ecq, scrape
from tests.test_rewind import admin_post
from tests.test_scq import FILTER, Q, _refusals, delivered, read_all, scq_write
from tests.test_top import api, top


def reader_rows(report: dict) -> list[tuple[str, str, int, int]]:
    return [(row["kind"], row.get("reader", row["clientid"]), row["pending"], row["pending_bytes"])
            for row in report["queues"]]


def test_lag_is_counted_per_reader_and_the_slowest_readers_are_listed(backend_broker, connect):
    """Each reader's pending entries are the SCQ's entries above its position, minus what it acked out of order;
    the SCQ itself is no queue with everything pending; ``scq=<queue>`` lists that SCQ's slowest readers."""
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    for key in ("a", "b", "c"):
        scq_write(producer, key, key * 10)
    write(producer, "own", "k", "xyz")  # an ECQ queue beside it
    assert len(read_all(connect, broker.port, "fast", 3)) == 3
    slow = connect(broker.port, "slow", manual_ack=True)
    assert slow.subscribe(FILTER) == 1
    got = slow.expect(3)
    slow.ack(got[1])  # b acked out of order: a and c pending
    assert wait_until(lambda: ("scq", "slow", 2, 20) in reader_rows(api(broker, "/api/v1/top?n=10")))
    slow.close()

    scq_write(producer, "d", b"d" * 10)
    expected = [("scq", "slow", 3, 30), ("ecq", "own", 1, 3), ("scq", "fast", 1, 10)]
    assert wait_until(lambda: reader_rows(api(broker, "/api/v1/top?n=10")) == expected)
    assert reader_rows(top(broker, "--scq", Q)) == [("scq", "slow", 3, 30), ("scq", "fast", 1, 10)]
    slowest = api(broker, f"/api/v1/top?n=1&scq={Q}")
    assert (slowest["scq"], slowest["pending"], slowest["lagging"], reader_rows(slowest)) == (
        Q, 4, 2, [("scq", "slow", 3, 30)])
    assert slowest["queues"][0]["clientid"] == f"$SCQ/{Q}/slow"

    fast = connect(broker.port, "fast")
    assert fast.subscribe(FILTER) == 1
    assert topics_payloads(fast.expect(1)) == [(f"$SCQ/{Q}/d", b"d" * 10)]
    assert wait_until(lambda: scrape(broker)["ecq_pending_messages"] == 4)  # slow's 3 and own's 1, not 4 entries x 1
    assert reader_rows(api(broker, "/api/v1/top?n=10")) == [("scq", "slow", 3, 30), ("ecq", "own", 1, 3)]


def test_lag_per_reader_survives_a_restart_and_is_read_offline(make_broker, connect):
    """A restart builds the per-reader lag from the stored positions; `ecq top` reads it from the data dir too."""
    broker = make_broker()
    producer = connect(broker.port, "producer")
    for key in ("a", "b"):
        scq_write(producer, key, key)
    assert len(read_all(connect, broker.port, "r1", 2)) == 2
    scq_write(producer, "c", b"c")
    producer.close()
    broker.stop()
    result = ecq("top", "--json", "--scq", Q, "--data-dir", str(broker.data_dir), admin=free_port())
    assert result.returncode == 0, result.stderr
    offline = json.loads(result.stdout)
    assert reader_rows(offline) == [("scq", "r1", 1, 1)] and "source" in offline
    broker.start()
    assert reader_rows(api(broker, "/api/v1/top?n=10")) == [("scq", "r1", 1, 1)]


def test_top_refuses_a_bad_scq_name(broker):
    with pytest.raises(urllib.error.HTTPError) as refused:
        api(broker, "/api/v1/top?scq=w")
    assert refused.value.code == 400


def test_a_reader_rewinds_its_own_position_and_no_other(backend_broker, connect):
    """``$SCQ/ctl/<queue>/rewind`` (payload as ``$ECQ/ctl/<clientid>/rewind``) moves the publisher's position only;
    a bad payload or another command is refused."""
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    for key in ("a", "b", "c"):
        scq_write(producer, key, key)
    everything = [delivered(key, key.encode()) for key in ("a", "b", "c")]
    assert read_all(connect, broker.port, "r1", 3) == everything
    assert read_all(connect, broker.port, "r2", 3) == everything
    r1 = connect(broker.port, "r1")
    assert r1.subscribe(FILTER) == 1
    r1.publish(f"$SCQ/ctl/{Q}/rewind", b"earliest", 1)
    assert topics_payloads(r1.expect(3)) == everything
    r1.publish(f"$SCQ/ctl/{Q}/rewind", b"sometime", 1)
    r1.publish(f"$SCQ/ctl/{Q}/forward", b"earliest", 1)
    assert wait_until(lambda: _refusals(broker, "bad_rewind") == 1 and _refusals(broker, "not_a_write") == 1)
    assert topics_payloads(r1.quiet(0.5)) == []
    assert read_all(connect, broker.port, "r2", 0) == []


def test_operator_rewinds_one_reader_by_cli_and_api(backend_broker, connect):
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    for key in ("a", "b"):
        scq_write(producer, key, key)
    assert len(read_all(connect, broker.port, "r1", 2)) == 2
    assert len(read_all(connect, broker.port, "r2", 2)) == 2
    result = ecq("rewind", "--json", "--scq", Q, "r1", "earliest", admin=broker.admin_port)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert (answer["scq"], answer["reader"], isinstance(answer["acked"], int)) == (Q, "r1", True)
    assert read_all(connect, broker.port, "r1", 2) == [delivered("a", b"a"), delivered("b", b"b")]
    assert read_all(connect, broker.port, "r2", 0) == []
    status, answer = admin_post(broker, f"/api/v1/scq/{Q}/readers/r2/rewind?to=earliest")
    assert (status, answer["reader"]) == (200, "r2")
    assert read_all(connect, broker.port, "r2", 2) == [delivered("a", b"a"), delivered("b", b"b")]
    assert admin_post(broker, f"/api/v1/scq/{Q}/readers/nobody/rewind?to=earliest")[0] == 404
    assert admin_post(broker, "/api/v1/scq/ctl/readers/r1/rewind?to=earliest")[0] == 400
    assert admin_post(broker, f"/api/v1/scq/{Q}/readers/r1/rewind?to=999999999")[0] == 400


def test_an_idle_readers_position_is_forgotten_but_never_an_online_ones(backend_broker, connect):
    """State GC forgets the position of a reader offline without an ack for ``state_retention`` (its next subscribe
    starts at the oldest entry again), never an online reader's, nor the SCQ's entries or seqno counter."""
    broker = backend_broker(state_retention="1s", gc_interval="1h")
    producer = connect(broker.port, "producer")
    for key in ("a", "b"):
        scq_write(producer, key, key)
    both = [delivered("a", b"a"), delivered("b", b"b")]
    assert read_all(connect, broker.port, "gone", 2) == both
    online = connect(broker.port, "online")
    assert online.subscribe(FILTER) == 1
    assert topics_payloads(online.expect(2)) == both
    idle_since = time.monotonic()
    assert wait_until(lambda: time.monotonic() - idle_since > 1.5, 5)

    def forgotten() -> bool:
        admin_post(broker, "/api/v1/gc")
        return scrape(broker).get("ecq_scq_positions_forgotten_total", 0) >= 1
    assert wait_until(forgotten, 15, 0.3)
    admin_post(broker, "/api/v1/gc")
    metrics = scrape(broker)
    assert (metrics["ecq_scq_positions_forgotten_total"], metrics.get("ecq_queues_forgotten_total", 0)) == (1, 0)
    scq_write(producer, "c", b"c")
    assert topics_payloads(online.expect(1)) == [delivered("c", b"c")]
    assert read_all(connect, broker.port, "gone", 3) == [*both, delivered("c", b"c")]


def test_each_node_of_a_cluster_counts_the_lag_of_readers_on_the_other(cluster_nodes, connect):
    """JetStream, two brokers: a reader that read on node 2 is followed by node 1's lag index from the notice of its
    saved position, so node 1 counts the next write as pending for it."""
    node1, node2 = (node.start() for node in cluster_nodes())
    producer = connect(node1.port, "producer")
    for key in ("a", "b"):
        scq_write(producer, key, key)
    assert len(read_all(connect, node2.port, "far", 2)) == 2
    scq_write(producer, "c", b"cc")
    assert wait_until(lambda: reader_rows(api(node1, f"/api/v1/top?scq={Q}")) == [("scq", "far", 1, 2)], 15)
    assert reader_rows(api(node2, f"/api/v1/top?scq={Q}")) == [("scq", "far", 1, 2)]


def cli_json(broker, *args: str, **options) -> dict:
    result = ecq(*args, "--json", admin=options.get("admin", broker.admin_port))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.timeout(60)
def test_status_counts_consumers_online_as_the_metric_does(make_broker, connect):
    """`ecq status` and ``ecq_consumers_online`` give one figure: the ECQ consumers and the SCQ readers connected and
    subscribed (docs/operations.md), here one of each; the reader is listed under its SCQ, not as a consumer."""
    broker = make_broker()
    producer = connect(broker.port, "producer")
    scq_write(producer, "a", b"aaa")
    write(producer, "own", "k", "v")
    reader = connect(broker.port, "r1")
    assert reader.subscribe(FILTER) == 1 and len(reader.expect(1)) == 1
    consumer = connect(broker.port, "own")
    assert consumer.subscribe("$ECQ/own/#") == 1 and len(consumer.expect(1)) == 1

    status = cli_json(broker, "status")
    assert status["consumers_online"] == scrape(broker)["ecq_consumers_online"] == 2
    assert [(c["clientid"], c["online"]) for c in status["consumers"]] == [("own", True)]
    assert status["scqs"] == [{"kind": "scq", "queue": Q, "readers": 1, "readers_online": 1}]


def test_status_inspect_delete_and_metrics_show_scqs_with_their_readers(backend_broker, connect):
    """`ecq status` lists SCQs of kind scq with their readers (no reader as a consumer), `ecq inspect --scq` one SCQ
    and its readers' pending entries, `ecq delete --scq` a key for every reader; the ecq_scq_* metrics."""
    broker = backend_broker(tombstones=True)
    producer = connect(broker.port, "producer")
    for key in ("a", "b"):
        scq_write(producer, key, key * 3)
    write(producer, "own", "k", "v")
    assert len(read_all(connect, broker.port, "r1", 2)) == 2
    r2 = connect(broker.port, "r2", manual_ack=True)
    assert r2.subscribe(FILTER) == 1
    assert len(r2.expect(2)) == 2

    status = cli_json(broker, "status")
    assert not [c for c in status["consumers"] if c["clientid"].startswith("$SCQ/")]
    assert (status["scqs_total"], status["scqs"]) == (1, [{"kind": "scq", "queue": Q, "readers": 2,
                                                           "readers_online": 1}])
    assert status["consumers_online"] == scrape(broker)["ecq_consumers_online"] == 1  # r2, the reader online
    info = cli_json(broker, "inspect", "--scq", Q)
    assert (info["kind"], info["queue"], info["stored"], info["readers_total"], info["readers_online"]) == (
        "scq", Q, 2, 2, 1)
    assert [(r["reader"], r["pending"], r["pending_bytes"], r["online"]) for r in info["readers"]] == [
        ("r2", 2, 6, True), ("r1", 0, 0, False)]
    assert ecq("inspect", "--scq", "nosuch", admin=broker.admin_port).returncode == 1
    with pytest.raises(urllib.error.HTTPError) as refused:
        api(broker, "/api/v1/scq/w")
    assert refused.value.code == 400
    assert wait_until(lambda: (scrape(broker)["ecq_scq_readers"], scrape(broker)["ecq_scq_pending_messages"]) == (2, 2))

    deleted = cli_json(broker, "delete", "--scq", Q, "a")
    assert (deleted["scq"], deleted["key"]) == (Q, "a")
    assert ecq("delete", "--scq", Q, "never", admin=broker.admin_port).returncode == 1
    assert read_all(connect, broker.port, "r1", 1) == [delivered("a", b"")]
    r2.close()
    if broker.options.get("backend") == "jetstream":
        return  # the data dir holds no queue there
    broker.stop()
    result = ecq("inspect", "--json", "--scq", Q, "--data-dir", str(broker.data_dir), admin=free_port())
    assert result.returncode == 0, result.stderr
    offline = json.loads(result.stdout)
    assert (offline["stored"], [r["reader"] for r in offline["readers"]]) == (2, ["r1"])
