"""Sessions, the third fairness level, in the scripts on a real Redis: the order within a
user, the user's share against other users, the per-user cap over its sessions, cancel
and settle, and the keys left behind (none once a user is idle; none at all when off)."""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.records import Grant, QueuedRequest
from gateway.storage.store import Store

M = "m"
K = ModelKeys(M)
OPEN = {"interactive": 100, "default": 100, "batch": 100}


def req(rid: str, user: str, session: str | None) -> QueuedRequest:
    return QueuedRequest(rid, user, "default", "r1", 10.0, 1000.0, session=session)


async def drain(store: Store, sessions: bool) -> list[Grant]:
    order = []
    while True:
        grants, _ = await store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0,
                                         sessions=sessions)
        if not grants:
            return order
        order += grants


async def session_keys(redis: aioredis.Redis) -> list[str]:
    found = []
    for pattern in ("sess:", "ssaved:", "sq:", "uq:"):
        found += [k async for k in redis.scan_iter(match=f"{K.prefix}{pattern}*")]
    return sorted(found)


async def test_sessions_take_turns_within_a_user_whose_share_is_unchanged(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    for i in range(1, 5):
        await store.queue.enqueue(M, req(f"a{i}", "alice", "agent"), 100)
    for i in range(1, 3):
        await store.queue.enqueue(M, req(f"b{i}", "alice", "chat"), 100)
    for i in range(1, 4):
        await store.queue.enqueue(M, req(f"bob{i}", "bob", ""), 100)
    order = [g.request_id for g in await drain(store, sessions=True)]
    # alice and bob alternate as without sessions; alice's turns alternate her sessions
    assert order == ["a1", "bob1", "b1", "bob2", "a2", "bob3", "b2", "a3", "a4"], order
    assert await session_keys(redis) == [], await session_keys(redis)


async def test_without_sessions_a_user_is_one_queue(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    for i in range(1, 5):
        await store.queue.enqueue(M, req(f"a{i}", "alice", None), 100)
    for i in range(1, 3):
        await store.queue.enqueue(M, req(f"b{i}", "alice", None), 100)
    for i in range(1, 4):
        await store.queue.enqueue(M, req(f"bob{i}", "bob", None), 100)
    assert await session_keys(redis) == []
    order = [g.request_id for g in await drain(store, sessions=False)]
    assert order == ["a1", "bob1", "a2", "bob2", "a3", "bob3", "a4", "b1", "b2"], order
    assert await session_keys(redis) == [], await session_keys(redis)


async def test_the_cap_counts_a_users_requests_over_its_sessions(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    got = [await store.queue.enqueue(M, req(f"r{i}", "alice", f"s{i}"), 3) for i in range(4)]
    assert got == [1, 2, 3, -1], got
    assert await store.queue.cancel(M, "r0", "alice", "default", "alice", "s0")
    assert await store.queue.enqueue(M, req("r9", "alice", "s9"), 3) == 3


async def test_cancel_leaves_the_session_then_the_user(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.queue.enqueue(M, req("x1", "alice", "s1"), 10)
    await store.queue.enqueue(M, req("x2", "alice", ""), 10)
    assert await redis.zrange(K.sessions("default", "alice", "alice"), 0, -1) == ["", "s1"]
    # the hash names the session: an operator's cancel finds its queue
    assert await store.queue.cancel(M, "x1", "alice", "default")
    assert await redis.zrange(K.sessions("default", "alice", "alice"), 0, -1) == [""]
    assert await redis.hget(K.session_saved("default", "alice", "alice"), "s1") == "0"
    assert await store.queue.cancel(M, "x2", "alice", "default", "alice", "")
    assert await redis.zscore(K.users("default", "alice"), "alice") is None
    assert await session_keys(redis) == [], await session_keys(redis)
    assert await store.reads.depths(M) == {"interactive": 0, "default": 0, "batch": 0}


async def test_settle_charges_the_session_while_its_user_is_queued(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await store.queue.enqueue(M, req("a1", "alice", "agent"), 10)
    await store.queue.enqueue(M, req("a2", "alice", "agent"), 10)
    await store.queue.enqueue(M, req("c1", "alice", "chat"), 10)
    first = await drain_one(store)
    assert first.request_id == "a1"
    await store.queue.settle(M, first, 100.0)
    sessions = dict(await redis.zrange(K.sessions("default", "alice", "alice"), 0, -1,
                                       withscores=True))
    assert sessions == {"agent": 110.0, "chat": 0.0}, sessions
    assert [g.request_id for g in await drain(store, sessions=True)] == ["c1", "a2"]


async def drain_one(store: Store) -> Grant:
    grants, _ = await store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0, sessions=True)
    assert len(grants) == 1, grants
    return grants[0]


async def test_a_returning_session_is_lifted_to_its_users_least_session(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    for i in range(3):
        await store.queue.enqueue(M, req(f"a{i}", "alice", "agent"), 10)
    assert (await drain_one(store)).request_id == "a0"
    assert (await drain_one(store)).request_id == "a1"
    # a new session joins at the agent's score (20), not at 0: no credit banked
    await store.queue.enqueue(M, req("c1", "alice", "chat"), 10)
    score = await redis.zscore(K.sessions("default", "alice", "alice"), "chat")
    assert score == 20.0, score
