"""The floor of the cluster's write-to-delivery latency (issue 24 point 2): one JetStream publish acked by a
quorum, with no ECQ in the path, paced like the flow phase.

Every write ECQ stores on the cluster is such a publish to its shard stream (R3, with the stream's RePublish),
and a delivery can leave only after its ack, so the write-to-delivery latency of a JetStream node is this round
trip plus the MQTT hops a LevelDB broker also makes. Published from the bench process with nats-py, one write at
a time (the flow's writes are paced well below what a pipelined client reaches), to the namespace of the
jetstream-1 configuration under a clientid no consumer holds.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

import nats

from benchlib.cluster_idle import SHARDS
from benchlib.scenarios import progress, quantile
from ecq.store.jsapi import TS_HEADER, token

FLOOR_CLIENTID = "bench-publish-floor"


def publish_floor(urls: list[str], namespace: str, rate: float, seconds: float, size: int) -> dict[str, Any]:
    """p50/p99 (ms) of ``rate`` publishes per second for ``seconds`` of ``size`` bytes, each awaited before the
    next is due, to the shard stream of FLOOR_CLIENTID; the first second left out as the flow's is."""
    latencies_ms = asyncio.run(_paced_publishes(urls, namespace, rate, seconds, size))
    latencies_ms.sort()
    result = {"measured": len(latencies_ms), "p50_ms": quantile(latencies_ms, 0.50),
              "p99_ms": quantile(latencies_ms, 0.99)}
    progress(f"publish floor @{rate:g}/s: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms")
    return result


async def _paced_publishes(urls: list[str], namespace: str, rate: float, seconds: float, size: int) -> list[float]:
    nc = await nats.connect(urls)
    try:
        js = nc.jetstream(timeout=10.0)
        subject = f"{namespace}.q.{zlib.crc32(FLOOR_CLIENTID.encode()) % SHARDS}.{token(FLOOR_CLIENTID)}."
        payload, latencies = b"p" * size, []
        started, count = time.monotonic(), int(rate * seconds)
        for i in range(count):
            sent = time.perf_counter()
            await js.publish(subject + token(f"k{i}"), payload, headers={TS_HEADER: str(int(time.time() * 1000))})
            if i >= rate:  # after the first second
                latencies.append((time.perf_counter() - sent) * 1000)
            await asyncio.sleep(max(0.0, started + (i + 1) / rate - time.monotonic()))
        return latencies
    finally:
        await nc.close()

