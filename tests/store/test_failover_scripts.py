"""What a failover leaves behind, on the scripts (real server): a request queued again
goes in only if the store forgot it, with its first arrival time and past the cap; an
enqueue sent twice (a call retried after its reply was lost) queues it once; a queue
entry for a request dispatched already is never granted again; a request that ran
although the store still queues it leaves the queue at its settle; a settle releases the
backend its hash names."""

from __future__ import annotations

import dataclasses

import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.records import QueuedRequest
from gateway.storage.store import Store

M = "m"
K = ModelKeys(M)
OPEN = {"interactive": 10, "default": 10, "batch": 10}


def req(rid: str, at: float = 1000.0) -> QueuedRequest:
    return QueuedRequest(rid, "u", "default", "r1", 1.0, at)


async def test_requeue_goes_in_only_when_forgotten(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    assert await store.queue.enqueue(M, req("a"), 1) == 1
    positions, _ = await store.queue.enqueue_many(M, [req("a"), req("b", at=990.0)], 1,
                                            requeue=True)
    assert positions == [0, 2], f"known one skipped, forgotten one past the cap: {positions}"
    assert await redis.lrange(K.queue("default", "u", "u"), 0, -1) == ["a", "b"]
    assert await redis.hget(K.request("b"), "enqueued_at") == "990.0"
    assert await redis.hget(K.depth, "default") == "2"


async def test_an_enqueue_sent_twice_queues_the_request_once(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    first = await store.queue.enqueue(M, req("a"), 10)
    again = await store.queue.enqueue(M, req("a"), 10)  # the same call, retried
    assert (first, again) == (1, 0), f"positions {first}, {again}"
    queue = await redis.lrange(K.queue("default", "u", "u"), 0, -1)
    assert queue == ["a"], f"queue {queue}"
    grants, _ = await store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0)
    assert [g.request_id for g in grants] == ["a"], grants
    inflight = await store.reads.user_inflight(M)
    depths = await store.reads.depths(M)
    assert inflight == {"u": 1} and not any(depths.values()), (inflight, depths)


async def test_a_stale_queue_entry_is_dropped_not_granted(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await store.queue.enqueue(M, req("a"), 10)
    grants, _ = await store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0)
    assert len(grants) == 1, grants
    # what a failover or a retried call can leave: the dispatched request queued again
    await store.queue.enqueue(M, req("b"), 10)
    await redis.lpush(K.queue("default", "u", "u"), "a")
    await redis.hincrby(K.depth, "default", 1)
    again, _ = await store.queue.dispatch(M, "b1", OPEN, "r1", 1001.0, 10.0)
    assert [g.request_id for g in again] == ["b"], f"granted {again}"
    inflight = await store.reads.user_inflight(M)
    assert inflight == {"u": 2}, f"a counted once, b once: {inflight}"
    assert await redis.hget(K.request("a"), "state") == "dispatched"
    assert await store.queue.settle(M, grants[0], 1.0) is True
    assert await store.queue.settle(M, again[0], 1.0) is True
    inflight, depths = await store.reads.user_inflight(M), await store.reads.depths(M)
    assert inflight == {} and not any(depths.values()), (inflight, depths)


async def test_settle_of_a_request_still_queued_takes_it_out(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await store.queue.enqueue(M, req("a"), 10)
    grants, _ = await store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0)
    # the store failed over without that dispatch: "a" is queued again there
    await redis.flushdb()
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await store.queue.enqueue(M, req("a"), 10)
    assert await store.queue.settle(M, grants[0], 5.0) is True
    assert await redis.llen(K.queue("default", "u", "u")) == 0
    assert await redis.hget(K.depth, "default") == "0"
    assert not await redis.exists(K.request("a"), K.user_inflight, K.backend_inflight("b1"))
    assert (await store.queue.dispatch(M, "b1", OPEN, "r1", 1001.0, 10.0))[0] == []


async def test_settle_releases_the_backend_the_hash_names(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await store.queue.enqueue(M, req("a"), 10)
    grants, _ = await store.queue.dispatch(M, "b2", OPEN, "r1", 1000.0, 10.0)
    assert await redis.get(K.backend_inflight("b2")) == "1"
    # the replica's own grant named b1 (the dispatch the failed-over store forgot)
    assert await store.queue.settle(M, dataclasses.replace(grants[0], backend="b1"), 0.0)
    assert not await redis.exists(K.backend_inflight("b2"), K.backend_inflight("b1"))
