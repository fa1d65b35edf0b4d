"""``shards``: dispatch decisions per second on a Redis Cluster of one shard against
three, with the models spread over the shards (each model's keys live on the shard of
its hash tag).

For each topology a fresh Valkey Cluster on loopback (masters only: replicas add no
dispatch capacity), M models, each with N queued requests from U backlogged users, then
D dispatch decisions made by C concurrent callers, each taking the models in turn (what
one dispatcher loop per model on several replicas does), through the gateway's own
cluster client (``gateway/storage/redis_client.py``). No HTTP and no backend: there is
no "direct" side. On one machine the client and every shard share the cores: run it on
an otherwise idle machine, and read the ratio with the core count in mind.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from gateway.core.settings import RedisCluster
from gateway.storage.records import QueuedRequest
from gateway.storage.redis_client import connect_cluster
from gateway.storage.store import Store
from loadtest.bench import report
from loadtest.bench.env import Options
from loadtest.bench.loadgen import progress
from loadtest.valkey_cluster import ValkeyCluster, spread_models
from policies.classes import CLASS_ORDER
from policies.fairness import Vtc

BACKEND = "b0"
REPLICA = "bench-replica"
OPEN = dict.fromkeys(CLASS_ORDER, 10**12)
TOPOLOGIES = (1, 3)  # shards


def params(opts: Options) -> dict[str, Any]:
    queued = opts.size or opts.pick(20_000, 200)
    return {"models": opts.pick(6, 3), "queued_per_model": queued,
            "users_per_model": opts.pick(1_000, 20),
            "dispatches": min(queued, opts.pick(20_000, 150)) * opts.pick(6, 3) // 2,
            "concurrency": opts.pick(24, 6), "enqueue_concurrency": 64, "prompt_tokens": 200,
            "shards": list(TOPOLOGIES)}


async def _workers(count: int, concurrency: int, job: Any, bar: Any) -> float:
    next_i = [0]

    async def worker() -> None:
        while next_i[0] < count:
            i = next_i[0]
            next_i[0] += 1
            await job(i)
            bar.update(1)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started


async def _measure(opts: Options, p: dict[str, Any], shards: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fairgate-shards-") as tmp:
        cluster = await asyncio.to_thread(
            ValkeyCluster(Path(tmp), masters=shards, replicas_each=0).start)
        try:
            client = connect_cluster(RedisCluster(nodes=cluster.addresses))
            try:
                return await _run(opts, p, shards, Store.over(client, request_ttl_s=3600))
            finally:
                await client.aclose()
        finally:
            cluster.stop()


async def _run(opts: Options, p: dict[str, Any], shards: int, store: Store) -> dict[str, Any]:
    models = spread_models(max(TOPOLOGIES), p["models"], prefix="bench")
    policy = Vtc()
    for model in models:
        await store.replicas.heartbeat([model], REPLICA, time.time() + 3600)
    users = [f"user{i:05d}" for i in range(p["users_per_model"])]
    total = p["queued_per_model"] * len(models)

    async def enqueue(i: int) -> None:
        model = models[i % len(models)]
        req = QueuedRequest(uuid.uuid4().hex, users[(i // len(models)) % len(users)],
                            "interactive", REPLICA,
                            policy.dispatch_cost(p["prompt_tokens"], 1.0), time.time())
        await store.queue.enqueue(model, req, p["queued_per_model"])

    bar = progress(total, f"shards={shards} enqueue", opts.progress)
    enqueue_s = await _workers(total, p["enqueue_concurrency"], enqueue, bar)
    bar.close()

    async def dispatch(i: int) -> None:
        grants, _ = await store.queue.dispatch(models[i % len(models)], BACKEND, OPEN, REPLICA,
                                         time.time(), 3600.0)
        if not grants:
            raise RuntimeError("a model's queue ran dry: lower --size or the dispatches")

    bar = progress(p["dispatches"], f"shards={shards} dispatch", opts.progress)
    seconds = await _workers(p["dispatches"], p["concurrency"], dispatch, bar)
    bar.close()
    left = 0
    for model in models:
        left += (await store.reads.depths(model))["interactive"]
    return {"shards": shards, "models": models, "enqueue_per_s": round(total / enqueue_s, 1),
            "dispatch_per_s": round(p["dispatches"] / seconds, 1),
            "queued_after": left, "dispatched": total - left}


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    opts.out.mkdir(parents=True, exist_ok=True)
    runs = {f"shards_{n}": await _measure(opts, p, n) for n in TOPOLOGIES}
    one, three = runs["shards_1"], runs["shards_3"]
    headline = [
        report.Headline(f"dispatch decisions/s, 1 shard ({p['models']} models, "
                        f"{p['concurrency']} callers)", None, one["dispatch_per_s"], None,
                        "–", None),
        report.Headline(f"dispatch decisions/s, 3 shards (models spread, "
                        f"{p['concurrency']} callers)", None, three["dispatch_per_s"], None,
                        "–", None),
        report.Headline("3 shards ÷ 1 shard", None,
                        round(three["dispatch_per_s"] / one["dispatch_per_s"], 2), None, "–",
                        None),
    ]
    fig, ax = report.figure("Dispatch decisions per second by shards", "", "decisions/s")
    ax.bar(range(len(TOPOLOGIES)), [runs[f"shards_{n}"]["dispatch_per_s"] for n in TOPOLOGIES])
    ax.set_xticks(range(len(TOPOLOGIES)), [f"{n} shard{'s' if n > 1 else ''}"
                                          for n in TOPOLOGIES])
    return report.write(opts, "shards", p, runs, headline, {"shards_dispatch.png": fig})
