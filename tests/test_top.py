"""Lag you can see, over TCP against a real broker process: `ecq top` (and GET /api/v1/top) and the lag metrics
follow writes, compaction, acks, purge, GC and rewind, agree with `ecq inspect` queue by queue, survive a
restart, and `ecq top` works offline from the data dir."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from tests.harness import free_port, wait_until, write
from tests.test_operations import ecq, scrape


def top(broker, *args: str) -> dict:
    result = ecq("top", "--json", *args, admin=broker.admin_port)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def lag_rows(report: dict) -> list[tuple[str, int, int]]:
    return [(q["clientid"], q["pending"], q["pending_bytes"]) for q in report["queues"]]


def api(broker, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.admin_port}{path}", timeout=10) as response:
        return json.load(response)


def assert_top_matches_inspect(broker) -> None:
    """Every queue `ecq top` lists has the pending count, bytes and oldest age `ecq inspect` gives (both read
    through the admin API, back to back: the ecq command itself takes about a second to start)."""
    for row in api(broker, "/api/v1/top?n=1000")["queues"]:
        info = api(broker, f"/api/v1/queues/{row['clientid']}")
        assert (row["pending"], row["pending_bytes"]) == (info["pending"], info["pending_bytes"]), row
        assert abs(row["oldest_pending_age_s"] - info["oldest_pending_age_s"]) < 0.5, (row, info)


def fill(connect, broker) -> None:
    producer = connect(broker.port, "producer")
    for i in range(6):
        write(producer, "many", f"k{i}", "x")
    for i in range(3):
        write(producer, "big", "same", "y" * (100 + i))  # compaction: one pending value of 102 bytes
    write(producer, "big", "other", "y" * 50)
    time.sleep(1.1)  # "new" is at least a second younger than the others
    write(producer, "new", "k", "zz")


def test_top_follows_writes_compaction_acks_purge_and_rewind_and_matches_inspect(backend_broker, connect):
    broker = backend_broker()
    fill(connect, broker)
    report = top(broker)
    assert lag_rows(report) == [("many", 6, 6), ("big", 2, 152), ("new", 1, 2)]
    assert (report["by"], report["pending"], report["lagging"]) == ("pending", 9, 3)
    assert report["oldest_pending_age_s"] >= 1.0
    assert_top_matches_inspect(broker)
    assert [row[0] for row in lag_rows(top(broker, "--by", "bytes"))] == ["big", "many", "new"]
    assert [row[0] for row in lag_rows(top(broker, "--by", "age", "-n", "2"))] == ["many", "big"]

    consumer = connect(broker.port, "many", manual_ack=True)
    assert consumer.subscribe("$ECQ/many/#") == 1
    first, second, *_rest = consumer.expect(5)
    consumer.ack(first)
    consumer.ack(second)
    assert wait_until(lambda: lag_rows(top(broker))[0] == ("many", 4, 4), 10)
    assert_top_matches_inspect(broker)

    purged = ecq("purge", "big", admin=broker.admin_port)
    assert purged.returncode == 0, purged.stderr
    assert [row[0] for row in lag_rows(top(broker))] == ["many", "new"]

    rewound = ecq("rewind", "many", "earliest", admin=broker.admin_port)
    assert rewound.returncode == 0, rewound.stderr
    assert lag_rows(top(broker))[0] == ("many", 6, 6)
    assert_top_matches_inspect(broker)


def test_gc_and_a_restart(make_broker, connect):
    broker = make_broker(data_retention=1.0)
    fill(connect, broker)
    before = top(broker)
    broker.stop()
    broker.start()
    after = top(broker)
    assert lag_rows(after) == lag_rows(before) == [("many", 6, 6), ("big", 2, 152), ("new", 1, 2)]
    time.sleep(1.1)  # everything is past data_retention now
    assert ecq("gc", admin=broker.admin_port).returncode == 0
    assert top(broker)["queues"] == [] and top(broker)["pending"] == 0


def test_the_lag_metrics_and_histogram(broker, connect):
    fill(connect, broker)
    samples = scrape(broker)
    assert samples["ecq_pending_messages"] == 9
    assert samples["ecq_oldest_pending_age_seconds"] >= 1.0
    buckets = {name: value for name, value in samples.items() if name.startswith("ecq_queue_pending_messages_bucket")}
    assert buckets == {"ecq_queue_pending_messages_bucket{le=0.0}": 0, "ecq_queue_pending_messages_bucket{le=1.0}": 1,
                       "ecq_queue_pending_messages_bucket{le=10.0}": 3, "ecq_queue_pending_messages_bucket{le=100.0}": 3,
                       "ecq_queue_pending_messages_bucket{le=1000.0}": 3,
                       "ecq_queue_pending_messages_bucket{le=10000.0}": 3,
                       "ecq_queue_pending_messages_bucket{le=+Inf}": 3}
    assert (samples["ecq_queue_pending_messages_count"], samples["ecq_queue_pending_messages_sum"]) == (3, 9)
    consumer = connect(broker.port, "new")
    assert consumer.subscribe("$ECQ/new/#") == 1
    consumer.expect(1)
    assert wait_until(lambda: scrape(broker)["ecq_pending_messages"] == 8, 10)
    samples = scrape(broker)
    assert samples["ecq_queue_pending_messages_bucket{le=0.0}"] == 1  # "new" has a queue and nothing pending
    assert samples["ecq_queue_pending_messages_count"] == 3


def test_bad_requests_text_output_and_offline(broker, connect):
    fill(connect, broker)
    for query in ("n=0", "n=1001", "n=ten", "by=size"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{broker.admin_port}/api/v1/top?{query}", timeout=10)
        assert refused.value.code == 400 and "bad top request" in json.load(refused.value)["error"]
    assert ecq("top", "-n", "0", admin=broker.admin_port).returncode == 2
    text = ecq("top", admin=broker.admin_port).stdout
    assert text.splitlines()[0].startswith("pending: 9 entries in 3 queues, oldest ")
    assert text.splitlines()[2].split() == ["many", "6", "6", text.splitlines()[2].split()[3]]
    online = top(broker)
    broker.stop()
    offline = ecq("top", "--json", "--data-dir", str(broker.data_dir), admin=free_port())
    assert offline.returncode == 0, offline.stderr
    assert lag_rows(json.loads(offline.stdout)) == lag_rows(online)
    assert "no broker running" in json.loads(offline.stdout)["source"]
