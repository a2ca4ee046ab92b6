"""Failover timing on a LocalNatsCluster (issue 24 point 5), shared by tests/test_cluster_health.py and the
benchmark's ``failover`` scenario: a paced QoS 1 producer over TCP (paho), kill -9 of one NATS server chosen by
its role, and the time from the kill to the first PUBACK of a write sent after it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import nats
import paho.mqtt.client as mqtt

from ecq.testing import wait_until
from ecq.testing.nats import LocalNatsCluster, NatsServer, monitor_json

ROLES = ("stream leader", "follower", "meta leader")


class PacedWriter:
    """A paho QoS 1 producer writing ``rate`` keys per second to the queue of ``clientid`` on 127.0.0.1:``port``
    from its own thread; paho reconnects by itself and sends unacknowledged PUBLISHes again. :meth:`first_ack_after`
    answers when the first write sent after a moment was PUBACKed."""

    def __init__(self, port: int, clientid: str, rate: float = 50.0) -> None:
        self._sent: dict[int, float] = {}     # packet id -> time.monotonic() of the publish
        self._acked: dict[int, float] = {}    # packet id -> time.monotonic() of its PUBACK
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._clientid, self._rate = clientid, rate
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{clientid}-writer",
                                   protocol=mqtt.MQTTv311)
        self._client.max_inflight_messages_set(0)
        self._client.max_queued_messages_set(0)
        self._client.reconnect_delay_set(0.1, 0.5)
        self._client.on_publish = self._on_publish
        self._client.connect("127.0.0.1", port, keepalive=30)
        self._thread = threading.Thread(target=self._run, daemon=True, name="paced-writer")

    def start(self) -> PacedWriter:
        """Connect's loop and the pacing thread; returns self."""
        self._client.loop_start()
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop writing and disconnect (bounded: a few seconds)."""
        self._stop.set()
        self._thread.join(5)
        self._client.disconnect()
        self._client.loop_stop()

    def first_ack_after(self, moment: float) -> float | None:
        """time.monotonic() of the first PUBACK of a write sent after ``moment``, None while there is none."""
        with self._lock:
            times = [self._acked[mid] for mid, sent in self._sent.items() if sent > moment and mid in self._acked]
        return min(times) if times else None

    def _on_publish(self, _client, _userdata, mid, _reason, _properties) -> None:
        with self._lock:
            self._acked.setdefault(mid, time.monotonic())

    def _run(self) -> None:
        started, i = time.monotonic(), 0
        while not self._stop.is_set():
            sent = time.monotonic()
            info = self._client.publish(f"$ECQ/w/{self._clientid}/k{i % 1000}", b"x" * 64, qos=1)
            with self._lock:
                self._sent.pop(info.mid, None)  # packet ids wrap at 65535
                self._acked.pop(info.mid, None)
                self._sent[info.mid] = sent
            i += 1
            time.sleep(max(0.0, started + i / self._rate - time.monotonic()))


def victim(cluster: LocalNatsCluster, stream: str, role: str, node_name: str) -> tuple[NatsServer, str]:
    """The server to kill for ``role`` (one of ROLES), for the ECQ node ``node_name`` writing to ``stream``, and
    what it is: "stream leader" (it leads ``stream``, whatever the role asked: the meta leader may lead it
    too), "meta leader" (it leads the meta group only) or "follower" (neither; the one the node is connected to
    when it can, so that the kill drops the node's connection). Raises RuntimeError when the leaders are not
    known. The stream's leader is not moved off the meta leader first: a leader killed right after a stepdown
    stalled its stream's writes for 2.5-7 s (JetStream), which is not what a kill of the meta leader costs."""
    leader, meta = cluster.stream_leader(stream), cluster.meta_leader()
    if leader is None or meta is None:
        raise RuntimeError(f"leaders not known: stream {stream} {leader}, meta {meta}")
    if role == "stream leader":
        server = cluster.server(leader)
    elif role == "meta leader":
        server = cluster.server(meta)
    else:
        followers = [s for s in cluster.servers if s.name not in (leader, meta)] or \
            [s for s in cluster.servers if s.name != leader]
        server = next((s for s in followers if holds_connection(s, f"ecq {node_name}")), followers[0])
    kind = "stream leader" if server.name == leader else "meta leader" if server.name == meta else "follower"
    return server, kind


def move_leader(cluster: LocalNatsCluster, stream: str, server: str, timeout: float = 10.0) -> None:
    """Make ``server`` the leader of ``stream`` (a stepdown with a preferred placement, nats-server 2.11+) and
    wait until it is and every replica is current again; raises RuntimeError when that is not so within
    ``timeout`` seconds."""
    if cluster.stream_leader(stream) == server:
        return

    async def step_down() -> None:
        client = await nats.connect(cluster.urls)
        try:
            await client.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                                 json.dumps({"placement": {"preferred": server}}).encode(), timeout=5)
        finally:
            await client.close()
    asyncio.run(step_down())
    if not wait_until(lambda: cluster.stream_leader(stream) == server and all_current(cluster, stream), timeout, 0.1):
        raise RuntimeError(f"{server} did not become the leader of {stream} with every replica current "
                           f"(leader: {cluster.stream_leader(stream)})")


def all_current(cluster: LocalNatsCluster, stream: str) -> bool:
    """True when the leader of ``stream`` reports every other replica current (its monitor's /jsz)."""
    leader = cluster.stream_leader(stream)
    if leader is None:
        return False
    jsz = monitor_json(cluster.server(leader).ports.http, "/jsz?streams=true", 1.0) or {}
    for account in jsz.get("account_details") or []:
        for detail in account.get("stream_detail") or []:
            if detail.get("name") == stream:
                return all(r.get("current") for r in (detail.get("cluster") or {}).get("replicas") or [])
    return False


def holds_connection(server: NatsServer, client_name: str) -> bool:
    """True when ``server``'s monitor lists a client connection named ``client_name``."""
    connections = (monitor_json(server.ports.http, "/connz", 1.0) or {}).get("connections") or []
    return any(c.get("name") == client_name for c in connections)


def time_to_first_puback(writer: PacedWriter, server: NatsServer, timeout: float = 30.0) -> float | None:
    """kill -9 ``server``; seconds from the kill to the first PUBACK of a write sent after it (None when none
    comes within ``timeout``). The server stays down: restart it afterwards."""
    killed_at = time.monotonic()
    server.kill()
    if not wait_until(lambda: writer.first_ack_after(killed_at) is not None, timeout, 0.02):
        return None
    return writer.first_ack_after(killed_at) - killed_at
