"""What dispatch.lua reports with each grant: how much of the prompt's chain the backend's
prefix index held, and why the request went there (fairgate_dispatch_decisions_total)."""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.records import Grant, Locality, QueuedRequest
from gateway.storage.store import Store
from policies.locality import DISPATCH_REASONS

M = "m"
K = ModelKeys(M)
OPEN = {"interactive": 100, "default": 100, "batch": 100}
AFFINITY = Locality(slack=50.0, candidates=8, index_size=100, index_ttl_s=60.0,
                    max_imbalance=0, others=("b1", "b2"))


async def one(store: Store, backend: str, locality: Locality | None) -> Grant:
    grants, _ = await store.queue.dispatch(M, backend, OPEN, "r1", 1000.0, 10.0, locality=locality)
    assert len(grants) == 1
    assert grants[0].reason in DISPATCH_REASONS
    return grants[0]


async def enqueue(store: Store, rid: str, user: str, prefix: tuple[str, ...]) -> None:
    await store.queue.enqueue(
        M, QueuedRequest(rid, user, "default", "r1", 10.0, 1000.0, prefix), 10)


async def test_locality_reports_cache_hits_spills_and_fairness_order(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await redis.zadd(K.backend_prefixes("b1"), {"s1": 1000.0, "s2": 1000.0})
    await enqueue(store, "r-bob", "bob", ("s1", "s2", "s3"))
    hit = await one(store, "b1", AFFINITY)
    assert (hit.request_id, hit.matched_blocks, hit.prompt_blocks, hit.reason) == (
        "r-bob", 2, 3, "cache_hit")

    # carol's prefix is on b2, which is busier than b1 (1 in flight) allows: b1 takes it
    await redis.zadd(K.backend_prefixes("b2"), {"t1": 1000.0})
    await redis.set(K.backend_inflight("b2"), 5)
    await enqueue(store, "r-carol", "carol", ("t1", "t2"))
    spilled = await one(store, "b1", AFFINITY)
    assert (spilled.request_id, spilled.matched_blocks, spilled.prompt_blocks,
            spilled.reason) == ("r-carol", 0, 2, "load")

    # nothing of alice's prompt is cached anywhere: the fairness order's next
    await enqueue(store, "r-alice", "alice", ("n1",))
    fresh = await one(store, "b2", AFFINITY)
    assert (fresh.request_id, fresh.matched_blocks, fresh.prompt_blocks, fresh.reason) == (
        "r-alice", 0, 1, "fairness_order")
    # the index now holds what was sent: the next request with that prefix is a hit
    await enqueue(store, "r-alice2", "alice", ("n1", "n2"))
    again = await one(store, "b2", AFFINITY)
    assert (again.matched_blocks, again.prompt_blocks, again.reason) == (1, 2, "cache_hit")


async def test_least_loaded_routing_reports_load_and_predicts_nothing(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await redis.zadd(K.backend_prefixes("b1"), {"s1": 1000.0})
    await enqueue(store, "r-bob", "bob", ("s1",))
    grant = await one(store, "b1", None)
    assert (grant.matched_blocks, grant.prompt_blocks, grant.reason) == (0, 0, "load")
