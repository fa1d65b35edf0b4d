"""``scheduler``: the Redis scheduler alone, driven through ``QueueStore``.

Enqueues N requests spread over U backlogged users (VTC), reads ``INFO memory``
(``used_memory`` delta ÷ queued count), then measures dispatch decisions per second: one
caller at a time (what one dispatcher loop does; with and without the per-decision
``backend_states`` read) and several callers at once (several replicas). No HTTP and no
backend: there is no "direct" side to compare with.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.records import QueuedRequest
from gateway.storage.store import Store
from loadtest.bench import report
from loadtest.bench.env import Bench, Options
from loadtest.bench.loadgen import progress
from policies.classes import CLASS_ORDER
from policies.fairness import Vtc

MODEL = "bench-model"
BACKEND = "b0"
REPLICA = "bench-replica"
OPEN = dict.fromkeys(CLASS_ORDER, 10**12)


def params(opts: Options) -> dict[str, Any]:
    queued = opts.size or opts.pick(200_000, 2_000)
    return {
        "users": opts.pick(10_000, 100) if queued >= 10_000 else max(1, queued // 20),
        "queued": queued, "enqueue_concurrency": 64,
        "dispatches": min(queued // 3, opts.pick(20_000, 300)),
        "dispatch_concurrency": 8, "fairness": "vtc", "prompt_tokens": 200,
        "target_size": "10,000 users × 1,000,000 queued (use --size 1000000)",
    }


async def _memory(client: aioredis.Redis) -> int:
    info = await client.info("memory")
    return int(info["used_memory"])


async def _evalsha_usec(client: aioredis.Redis) -> dict[str, float]:
    stats = await client.info("commandstats")
    entry = stats.get("cmdstat_evalsha") or {}
    return {"calls": float(entry.get("calls", 0)), "usec": float(entry.get("usec", 0))}


async def _workers(count: int, concurrency: int, job: Callable[[int], Awaitable[Any]],
                   bar: Any) -> float:
    """Run ``job(i)`` for i < count on ``concurrency`` workers; returns seconds taken."""
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


async def _measure(opts: Options, p: dict[str, Any], client: aioredis.Redis) -> dict[str, Any]:
    store = Store.over(client, request_ttl_s=3600)
    policy = Vtc()
    await client.flushdb()
    await store.replicas.heartbeat([MODEL], REPLICA, time.time() + 3600)
    base = await _memory(client)
    users = [f"user{i:05d}" for i in range(p["users"])]

    async def enqueue(i: int) -> None:
        req = QueuedRequest(uuid.uuid4().hex, users[i % len(users)], "interactive", REPLICA,
                            policy.dispatch_cost(p["prompt_tokens"], 1.0), time.time())
        await store.queue.enqueue(MODEL, req, p["queued"])

    bar = progress(p["queued"], "scheduler enqueue", opts.progress)
    enqueue_s = await _workers(p["queued"], p["enqueue_concurrency"], enqueue, bar)
    bar.close()
    loaded = await _memory(client)
    depth = (await store.reads.depths(MODEL))["interactive"]
    active = await cast("Awaitable[int]", client.zcard(ModelKeys(MODEL).active("interactive")))
    out: dict[str, Any] = {
        "queued": depth, "active_users": active,
        "enqueue_per_s": round(p["queued"] / enqueue_s, 1),
        "used_memory_before": base, "used_memory_loaded": loaded,
        "bytes_per_queued_request": round((loaded - base) / max(depth, 1), 1),
    }
    per_phase = p["dispatches"]

    async def dispatch(_i: int) -> None:
        grants, _ = await store.queue.dispatch(MODEL, BACKEND, OPEN, REPLICA, time.time(), 3600.0)
        assert grants, "the queue ran dry"

    async def dispatch_with_read(_i: int) -> None:
        await store.fleet.backend_states(MODEL, [BACKEND])
        await dispatch(_i)

    phases = (("sequential", dispatch, 1), ("sequential_with_state_read", dispatch_with_read, 1),
              ("concurrent", dispatch, p["dispatch_concurrency"]))
    for name, job, concurrency in phases:
        before = await _evalsha_usec(client)
        bar = progress(per_phase, f"scheduler dispatch {name}", opts.progress)
        seconds = await _workers(per_phase, concurrency, job, bar)
        bar.close()
        after = await _evalsha_usec(client)
        calls = after["calls"] - before["calls"]
        out[f"dispatch_{name}"] = {
            "decisions": per_phase, "concurrency": concurrency,
            "per_s": round(per_phase / seconds, 1),
            "server_usec_per_script": round((after["usec"] - before["usec"]) / calls, 2)
            if calls else None,
        }
    out["queued_after"] = (await store.reads.depths(MODEL))["interactive"]
    await client.flushdb()
    return out


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    async with Bench(opts) as bench:
        client = aioredis.Redis.from_url(bench.redis_url, decode_responses=True,
                                         max_connections=256)
        try:
            runs = {"redis": await _measure(opts, p, client)}
        finally:
            await client.aclose()
    r = runs["redis"]
    headline = [
        report.Headline(f"dispatch decisions/s, 1 caller ({r['active_users']:,} backlogged "
                        f"users, {r['queued']:,} queued)", None,
                        r["dispatch_sequential"]["per_s"], None, "–", None),
        report.Headline("dispatch decisions/s, 1 caller incl. backend state read (= one "
                        "dispatcher loop)", None,
                        r["dispatch_sequential_with_state_read"]["per_s"], None, "–", None),
        report.Headline(f"dispatch decisions/s, {p['dispatch_concurrency']} callers", None,
                        r["dispatch_concurrent"]["per_s"], None, "–", None),
        report.Headline("Redis time per dispatch script (µs, server side)", None,
                        r["dispatch_sequential"]["server_usec_per_script"], None, "–", None),
        report.Headline("Redis memory per queued request (bytes)", None,
                        r["bytes_per_queued_request"], None, "–", None),
        report.Headline("enqueues/s (64 callers)", None, r["enqueue_per_s"], None, "–", None),
    ]
    fig, ax = report.figure("Dispatch decisions per second", "", "decisions/s")
    names = ["sequential", "sequential_with_state_read", "concurrent"]
    ax.bar(range(3), [r[f"dispatch_{n}"]["per_s"] for n in names])
    ax.set_xticks(range(3), ["1 caller", "1 caller + state read",
                             f"{p['dispatch_concurrency']} callers"])
    return report.write(opts, "scheduler", p, runs, headline, {"scheduler_dispatch.png": fig})
