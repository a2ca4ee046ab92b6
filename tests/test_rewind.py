"""Rewind end to end (issue 13 part 2), over TCP against real `ecq broker` processes: the owner's
`$ECQ/ctl/<clientid>/rewind` PUBLISH (paho and Debian's mosquitto clients), `ecq rewind` and the admin API,
the refusals, the ACL, the `w`/`ctl` subscription refusal, the metric and the queue event.

The flows that depend on the store run on both backends (LevelDB, JetStream: seqnos with gaps); the refusals
are decided before the store is asked and run on LevelDB only.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request

import pyarrow.dataset as ds

from ecq.events.schema import COLUMNS
from tests.harness import RawClient, drain, topics_payloads, wait_until, write
from tests.test_operations import ecq, scrape


def rewind(client, clientid: str, payload: str) -> None:
    """The owner's rewind: a QoS 1 PUBLISH to ``$ECQ/ctl/<clientid>/rewind``, its PUBACK awaited."""
    client.publish(f"$ECQ/ctl/{clientid}/rewind", payload, qos=1)


def queue(broker, clientid: str) -> dict:
    """The admin API's view of one queue (acked, range, inflight, ...)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.admin_port}/api/v1/queues/{clientid}", timeout=10) as r:
        return json.load(r)


def admin_post(broker, path: str) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{broker.admin_port}{path}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def consume_and_leave(broker, connect, clientid: str, count: int) -> list[tuple[str, bytes]]:
    """Connect as ``clientid``, take (and ack) exactly ``count`` messages, disconnect; returns (topic, payload)s
    once the broker has the queue offline with nothing pending."""
    consumer = connect(broker.port, clientid)
    assert consumer.subscribe(f"$ECQ/{clientid}/#") == 1
    messages = topics_payloads(consumer.expect(count)) + topics_payloads(consumer.quiet(0.5))
    consumer.close()
    assert wait_until(lambda: not queue(broker, clientid)["online"] and queue(broker, clientid)["pending"] == 0, 5)
    return messages


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def test_the_owner_rewinds_while_online_inflight_is_forgotten_and_delivery_restarts_at_once(
        backend_broker, connect, tmp_path):
    lake = tmp_path / "lake"
    broker = backend_broker(lake_dir=str(lake), export_interval="200ms", lake_file_age="200ms")
    producer = connect(broker.port, "producer")
    for i in range(3):
        write(producer, "rw1", f"k{i}", f"v{i}")
    consumer = connect(broker.port, "rw1", manual_ack=True)
    assert consumer.subscribe("$ECQ/rw1/#") == 1
    first, second, third = consumer.expect(3)
    consumer.ack(first)
    assert wait_until(lambda: queue(broker, "rw1")["acked"] > 0, 5)
    rewind(consumer, "rw1", "earliest")  # k1 and k2 are in flight: not waited for
    again = consumer.expect(3)
    assert topics_payloads(again) == [(f"$ECQ/rw1/k{i}", f"v{i}".encode()) for i in range(3)]
    assert queue(broker, "rw1")["acked"] == 0
    consumer.ack(second)  # PUBACKs of the forgotten sends count for nothing
    consumer.ack(third)
    for message in again[:2]:
        consumer.ack(message)
    assert wait_until(lambda: queue(broker, "rw1")["pending"] == 1, 5), queue(broker, "rw1")
    assert scrape(broker)["ecq_rewinds_total"] == 1
    assert wait_until(lambda: _rewound_events(lake) == [("rw1", 0, "earliest")], 10), _rewound_events(lake)


def test_the_owner_rewinds_with_mosquitto_clients_since_a_time(backend_broker):
    broker = backend_broker()
    port = str(broker.port)
    pub = ["mosquitto_pub", "-h", "127.0.0.1", "-p", port, "-q", "1"]
    subprocess.run([*pub, "-t", "$ECQ/w/mqr/k0", "-m", "before"], check=True, timeout=10)
    since = now_ms() + 1  # k0 was stamped before its PUBACK, so before this
    assert wait_until(lambda: now_ms() > since, 1)
    for key in ("k1", "k2"):
        subprocess.run([*pub, "-t", f"$ECQ/w/mqr/{key}", "-m", "after"], check=True, timeout=10)

    def consume(count: int) -> list[str]:
        out = subprocess.run(["mosquitto_sub", "-h", "127.0.0.1", "-p", port, "-i", "mqr", "-q", "1", "-t",
                              "$ECQ/mqr/#", "-C", str(count), "-W", "10", "-F", "%t %p"],
                             capture_output=True, text=True, timeout=15)
        return out.stdout.splitlines()

    assert consume(3) == ["$ECQ/mqr/k0 before", "$ECQ/mqr/k1 after", "$ECQ/mqr/k2 after"]
    assert wait_until(lambda: queue(broker, "mqr")["pending"] == 0, 5)
    subprocess.run([*pub, "-i", "mqr", "-t", "$ECQ/ctl/mqr/rewind", "-m", f"since:{since}"], check=True, timeout=10)
    assert consume(2) == ["$ECQ/mqr/k1 after", "$ECQ/mqr/k2 after"]


def test_ecq_rewind_and_the_admin_api_rewind_an_offline_queue(backend_broker, connect):
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    for i in range(3):
        write(producer, "off", f"k{i}", f"v{i}")
        write(producer, "other", f"k{i}", "x")  # on JetStream, seqnos of the shard's other queues fall in between
    everything = [(f"$ECQ/off/k{i}", f"v{i}".encode()) for i in range(3)]
    assert consume_and_leave(broker, connect, "off", 3) == everything
    result = ecq("rewind", "off", "earliest", "--json", admin=broker.admin_port)
    assert result.returncode == 0, result.stderr
    first_seqno = json.loads(result.stdout)["acked"] + 1
    assert json.loads(result.stdout) == {"clientid": "off", "acked": first_seqno - 1}
    assert queue(broker, "off")["acked"] == first_seqno - 1
    assert consume_and_leave(broker, connect, "off", 3) == everything
    status, body = admin_post(broker, f"/api/v1/queues/off/rewind?to={first_seqno}")
    assert (status, body) == (200, {"clientid": "off", "acked": first_seqno})
    broker.kill()  # the answer came once the rewind was stored: it survives kill -9
    broker.start()
    assert consume_and_leave(broker, connect, "off", 2) == everything[1:]
    latest = ecq("rewind", "off", "latest", admin=broker.admin_port)
    assert latest.returncode == 0 and f"acked seqno {queue(broker, 'off')['last_seqno']}" in latest.stdout


def test_a_rewind_by_another_client_or_with_a_bad_payload_is_refused_and_the_publisher_kept(broker, connect):
    producer = connect(broker.port, "producer")
    write(producer, "victim", "k", "v")
    assert drain(connect, broker.port, "victim", 1) == [("$ECQ/victim/k", b"v")]
    assert wait_until(lambda: queue(broker, "victim")["acked"] == 1, 5)
    intruder = RawClient(broker.port, "intruder")
    owner = RawClient(broker.port, "victim")
    try:
        assert intruder.publish_qos1(b"$ECQ/ctl/victim/rewind", b"earliest", 3) == (0x40, b"\x00\x03")
        assert owner.publish_qos1(b"$ECQ/ctl/victim/rewind", b"earliest!", 4) == (0x40, b"\x00\x04")
        assert owner.publish_qos1(b"$ECQ/ctl/victim/rewind", b"-1", 5) == (0x40, b"\x00\x05")
        assert intruder.ping() and owner.ping()
    finally:
        intruder.close()
        owner.close()
    assert queue(broker, "victim")["acked"] == 1
    metrics = scrape(broker)
    assert metrics['ecq_writes_refused_total{reason=not_owner}'] == 1
    assert metrics['ecq_writes_refused_total{reason=bad_rewind}'] == 2
    assert metrics.get("ecq_rewinds_total") == 0
    log = broker.log()
    assert "only the client 'victim' may rewind its queue, not 'intruder'" in log and "reason not_owner" in log
    assert "reason bad_rewind" in log


def test_the_acl_may_deny_a_rewind_to_its_owner(make_broker, connect, tmp_path):
    acl = tmp_path / "acl.conf"
    acl.write_text('{deny, {clientid, "locked"}, publish, ["$ECQ/ctl/#"]}.\n{allow, all}.\n')
    broker = make_broker(acl_file=str(acl))
    producer = connect(broker.port, "producer")
    for owner in ("locked", "free"):
        write(producer, owner, "k", "v")
        assert drain(connect, broker.port, owner, 1) == [(f"$ECQ/{owner}/k", b"v")]
        rewind(connect(broker.port, owner), owner, "earliest")
    assert "reason acl_denied" in broker.log()
    assert (queue(broker, "locked")["acked"], queue(broker, "free")["acked"]) == (1, 0)


def test_clients_w_and_ctl_cannot_subscribe_to_their_queue_filter(broker, connect):
    for clientid in ("w", "ctl"):
        assert connect(broker.port, clientid).subscribe(f"$ECQ/{clientid}/#") == 0x80
        assert f"ECQ refused SUBSCRIBE of {clientid} to '$ECQ/{clientid}/#': the clientids ctl and w cannot own" \
               in broker.log()
    status, body = admin_post(broker, "/api/v1/queues/w/rewind?to=0")
    assert status == 400 and "cannot own a queue" in body["error"]


def test_ecq_rewind_refuses_a_bad_point_before_asking_the_broker(broker):
    result = ecq("rewind", "c1", "yesterday", admin=broker.admin_port)
    assert result.returncode == 2 and "'earliest'" in result.stderr
    status, body = admin_post(broker, "/api/v1/queues/c1/rewind?to=yesterday")
    assert status == 400 and "'earliest'" in body["error"]


def _rewound_events(lake) -> list[tuple]:
    if not any(lake.rglob("*.parquet")):
        return []
    rows = ds.dataset(lake, format="parquet", partitioning="hive").to_table(columns=list(COLUMNS)).to_pylist()
    return [(r["clientid"], r["seqno"], r["reason"]) for r in rows if r["type"] == "rewound"]


def test_a_rewind_on_one_cluster_node_then_acks_on_the_other_are_not_undone_by_the_first(cluster_nodes, connect):
    # Node 1 rewinds the offline queue (and so holds its consumer in memory); the consumer then reads and acks
    # everything through node 2. Coming back to node 1, it must get nothing: node 1 reads the acks node 2 saved
    # instead of resuming from the state it remembered.
    node1, node2 = (node.start() for node in cluster_nodes(2))
    producer = connect(node1.port, "producer")
    for i in range(3):
        write(producer, "hop", f"k{i}", f"v{i}")
    assert ecq("rewind", "hop", "earliest", admin=node1.admin_port).returncode == 0
    assert len(consume_and_leave(node2, connect, "hop", 3)) == 3
    assert consume_and_leave(node1, connect, "hop", 0) == []


def _refused_events(lake) -> list[tuple]:
    if not any(lake.rglob("*.parquet")):
        return []
    rows = ds.dataset(lake, format="parquet", partitioning="hive").to_table(columns=list(COLUMNS)).to_pylist()
    return [(r["clientid"], r["reason"], r["topic"]) for r in rows if r["type"] == "refused"]


def test_a_rewind_to_a_seqno_past_the_end_is_refused_and_later_writes_are_delivered(backend_broker, tmp_path):
    # docs/topics.md's example without `since:`: a time taken for a seqno, far above the last one. Stored, it made every
    # later write count as acked: PUBACKed, never delivered, pending 0. It is refused as bad_rewind (PUBACKed,
    # counted, logged, a refused event), the position stays, and the next write is delivered.
    lake = tmp_path / "lake"
    broker = backend_broker(lake_dir=str(lake), export_interval="200ms", lake_file_age="200ms")
    port = str(broker.port)
    pub = ["mosquitto_pub", "-h", "127.0.0.1", "-p", port, "-q", "1"]

    def consume(count: int) -> list[str]:
        out = subprocess.run(["mosquitto_sub", "-h", "127.0.0.1", "-p", port, "-i", "car7", "-q", "1", "-t",
                              "$ECQ/car7/#", "-C", str(count), "-W", "10", "-F", "%t %p"],
                             capture_output=True, text=True, timeout=15)
        return out.stdout.splitlines()

    for key in ("k0", "k1"):
        subprocess.run([*pub, "-t", f"$ECQ/w/car7/{key}", "-m", "old"], check=True, timeout=10)
    assert consume(2) == ["$ECQ/car7/k0 old", "$ECQ/car7/k1 old"]
    assert wait_until(lambda: queue(broker, "car7")["pending"] == 0, 5)
    acked, last = queue(broker, "car7")["acked"], queue(broker, "car7")["last_seqno"]
    for payload in ("1767225600000", str(last + 1)):
        subprocess.run([*pub, "-i", "car7", "-t", "$ECQ/ctl/car7/rewind", "-m", payload], check=True, timeout=10)
    assert queue(broker, "car7")["acked"] == acked
    subprocess.run([*pub, "-t", "$ECQ/w/car7/k2", "-m", "new"], check=True, timeout=10)
    assert queue(broker, "car7")["pending"] == 1
    assert consume(1) == ["$ECQ/car7/k2 new"]
    assert scrape(broker)["ecq_writes_refused_total{reason=bad_rewind}"] == 2
    assert f"to seqno 1767225600000: above its last seqno {last}" in broker.log()
    assert "(publisher car7, reason bad_rewind)" in broker.log()
    refused = [("car7", "bad_rewind", "$ECQ/ctl/car7/rewind")] * 2
    assert wait_until(lambda: _refused_events(lake) == refused, 10), _refused_events(lake)
    subprocess.run([*pub, "-i", "car7", "-t", "$ECQ/ctl/car7/rewind", "-m", str(last)], check=True, timeout=10)
    assert queue(broker, "car7")["acked"] == last  # the last seqno itself is a position like any


def test_ecq_rewind_and_the_admin_api_refuse_a_seqno_past_the_end(broker, connect):
    producer = connect(broker.port, "producer")
    write(producer, "far", "k", "v")
    result = ecq("rewind", "far", "1767225600000", admin=broker.admin_port)
    assert result.returncode == 1
    assert "to seqno 1767225600000: above its last seqno 1" in result.stderr
    status, body = admin_post(broker, "/api/v1/queues/far/rewind?to=2")
    assert status == 400 and "to seqno 2: above its last seqno 1" in body["error"]
    assert queue(broker, "far")["acked"] == 0 and queue(broker, "far")["pending"] == 1
    assert "ECQ admin API refused rewind of the queue of 'far' to seqno 2" in broker.log()
    status, body = admin_post(broker, "/api/v1/queues/far/rewind?to=1")
    assert (status, body) == (200, {"clientid": "far", "acked": 1})


def test_ecq_rewind_of_an_unknown_queue_is_refused_and_creates_nothing(broker, connect):
    producer = connect(broker.port, "producer")
    write(producer, "known", "k", "v")
    for point in ("latest", "earliest", "0", "since:0"):
        result = ecq("rewind", "nosuch", point, admin=broker.admin_port)
        assert result.returncode == 1, (point, result.stdout)
        assert "no queue for clientid 'nosuch'" in result.stderr
    status, body = admin_post(broker, "/api/v1/queues/nosuch/rewind?to=latest")
    assert status == 404 and "no queue for clientid 'nosuch'" in body["error"]
    status = json.loads(ecq("status", "--json", admin=broker.admin_port).stdout)
    assert [c["clientid"] for c in status["consumers"]] == []
    assert ecq("inspect", "nosuch", admin=broker.admin_port).returncode == 1
    assert scrape(broker).get("ecq_rewinds_total") == 0
    assert ecq("rewind", "known", "latest", admin=broker.admin_port).returncode == 0  # a write is enough to know it
