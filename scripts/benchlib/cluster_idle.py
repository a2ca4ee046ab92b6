"""The cluster scenario's idle phase (issue 24): what nodes holding many stored entries cost while nothing
happens, and the JetStream preload that puts those entries there without going through MQTT.

The preload publishes straight to the shard streams from the bench process (nats-py, ``PRELOAD_WINDOW``
publishes awaiting their acks at a time), in the layout of ecq/store/jetstream.py: subject
``NS.q.<shard>.T(clientid).T(key)``, shard CRC32(clientid) modulo the shard count, header ``Ecq-Ts``.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

import nats

from benchlib.scenarios import Bench, broker_pids, progress
from ecq.config import EcqSettings
from ecq.store.jsapi import TS_HEADER, token

PRELOAD_WINDOW = 1000          # JetStream publishes in flight during the preload
SHARDS = EcqSettings.model_fields["jetstream_shards"].default   # the nodes run with the product default


def preload_jetstream(urls: list[str], namespace: str, cids: tuple[str, ...], key_names: tuple[str, ...],
                      size: int) -> dict[str, Any]:
    """Store len(cids) x len(key_names) entries of ``size`` bytes in the shard streams of ``namespace`` (made by
    the nodes at start); returns the count and the entries/s."""
    started = time.monotonic()
    stored = asyncio.run(_publish_all(urls, namespace, cids, key_names, size))
    seconds = time.monotonic() - started
    progress(f"preloaded {stored} entries through JetStream in {seconds:.1f} s")
    return {"entries": stored, "seconds": round(seconds, 3), "per_s": round(stored / seconds, 1)}


async def _publish_all(urls: list[str], namespace: str, cids: tuple[str, ...], key_names: tuple[str, ...],
                       size: int) -> int:
    nc = await nats.connect(urls)
    try:
        js = nc.jetstream(timeout=10.0)
        payload, headers = b"p" * size, {TS_HEADER: str(int(time.time() * 1000))}
        pending, stored = [], 0
        for cid in cids:
            prefix = f"{namespace}.q.{zlib.crc32(cid.encode()) % SHARDS}.{token(cid)}."
            for key in key_names:
                pending.append(js.publish(prefix + token(key), payload, headers=headers))
                if len(pending) >= PRELOAD_WINDOW:
                    stored += len(await asyncio.gather(*pending))
                    pending = []
        return stored + len(await asyncio.gather(*pending))
    finally:
        await nc.close()


def idle_cpu(bench: Bench, nodes: Any, phase: str, seconds: float) -> dict[str, Any]:
    """Wait until the nodes and NATS servers are idle (Bench.wait_idle), then CPU (% of one core) of each node
    and of the NATS servers summed over ``seconds`` of nothing happening."""
    waited = bench.wait_idle(nodes)
    start = time.monotonic()
    time.sleep(seconds)
    end = time.monotonic()
    per_node = [bench.sampler.cpu_percent(pid, start, end) for pid in broker_pids(nodes)]
    nats_pct = [bench.sampler.cpu_percent(pid, start, end) for pid in bench.nats_pids]
    result = {"settled_after_s": round(waited, 1), "seconds": round(end - start, 1),
              "node_cpu_pct": [None if v is None else round(v, 2) for v in per_node],
              "nats_cpu_pct": round(sum(v or 0.0 for v in nats_pct), 2) if bench.nats_pids else None}
    progress(f"{phase}: idle CPU per node {result['node_cpu_pct']} %, NATS {result['nats_cpu_pct']} %")
    return result
