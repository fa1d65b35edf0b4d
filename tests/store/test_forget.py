"""Idle end users of trusted keys are forgotten (``lua/forget.lua``): their last-seen time
rides on their enqueue and settle, and a bounded pass drops every per-user field and key
of those idle past the setting, never of one with a request queued or in flight."""

from __future__ import annotations

import dataclasses

import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.records import Who
from gateway.storage.store import Store
from gateway.storage.values import SEEN
from tests.store.test_scripts import ALL_OPEN, M, alive, req

K = ModelKeys(M)
T0 = 1000.0
IDLE_S = 60.0
NO_BATCH = {**ALL_OPEN, "batch": 0}  # a batch request stays queued
END = "app/"  # every end user's name starts with its trusted key's user and "/"


async def end_user_state(redis: aioredis.Redis) -> dict[str, list[str]]:
    """Per key, its fields or members that name an end user (the key's own name when it
    names one)."""
    found: dict[str, list[str]] = {}
    async for key in redis.scan_iter(match="*"):
        kind = await redis.type(key)
        if END in key:
            found[key] = [key]
        elif kind == "hash":
            names = await redis.hkeys(key)
        elif kind == "zset":
            names = await redis.zrange(key, 0, -1)
        elif kind == "set":
            names = list(await redis.smembers(key))
        else:
            continue
        if END not in key:
            hits = [n for n in names if END in n]
            if hits:
                found[key] = hits
    return found


def count(state: dict[str, list[str]]) -> int:
    return sum(len(names) for names in state.values())


async def memory(redis: aioredis.Redis) -> int:
    """Bytes of every key (MEMORY USAGE), summed."""
    return sum([int(await redis.memory_usage(key) or 0)
                async for key in redis.scan_iter(match="*")])


async def serve(store: Store, user: str, rid: str, at: float, charge: float = 10.0,
                tenant: str = "") -> None:
    """One request of ``user`` queued, dispatched and settled at ``at``."""
    await store.queue.enqueue(M, dataclasses.replace(req(rid, user, at=at), tenant=tenant), 10)
    grants, _ = await store.queue.dispatch(M, "b1", NO_BATCH, "r1", at, 10.0)
    assert [g.request_id for g in grants] == [rid], grants
    released, _ = await store.queue.settle_and_dispatch(M, grants[0], charge, now=at)
    assert released, f"{rid} was not released"


async def test_idle_end_users_leave_nothing_while_active_ones_keep_their_state(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    users = [f"app/u{i}" for i in range(200)]
    for i, user in enumerate(users):  # every end user its own tenant, a tenant's users too
        await serve(store, user, f"r{i}", T0, tenant="acme" if i % 4 == 0 else "")
    await serve(store, "bob", "rb", T0)  # a key's own user: not an end user, kept
    await store.shares.add_service(M, {u: 1.0 for u in users[:5]}, T0, 60.0, 1000, 3600,
                            {u: Who() for u in users[:5]})
    running, queued = "app/a-running", "app/b-queued"
    await store.queue.enqueue(M, req("f1", running, at=T0), 10)
    await store.queue.enqueue(M, req("q1", queued, at=T0), 10)
    # equal scores: the first by name is served, the other stays queued
    await store.queue.dispatch(
        M, "b1", {"interactive": 0, "default": 1, "batch": 0}, "r1", T0, 10.0)
    assert await store.reads.user_inflight(M) == {running: 1}
    before, bytes_before = await end_user_state(redis), await memory(redis)
    fields_before = count(before)
    assert fields_before >= 3 * len(users), f"end-user state before: {before}"
    assert await redis.zcard(K.seen) == len(users) + 2

    # not idle long enough yet: nothing goes
    assert await store.queue.forget_idle(M, T0 + IDLE_S - 1, IDLE_S, 1000) == (0, 0)
    forgotten, kept = await store.queue.forget_idle(M, T0 + IDLE_S + 1, IDLE_S, 1000)

    after, bytes_after = await end_user_state(redis), await memory(redis)
    message = (f"{fields_before} end-user fields/keys, {bytes_before} B before; "
               f"{count(after)} and {bytes_after} B after: {after}")
    assert (forgotten, kept) == (len(users), 2), message
    assert not [k for k in after if "app/u" in k], message
    # what is left is the two active users' own state, and their last-seen entries
    assert all(running in n or queued in n for names in after.values() for n in names), \
        message
    assert len(after[K.seen]) == 2, message
    assert await redis.zscore(K.seen, SEEN.encode(queued, queued)) == T0 + IDLE_S + 1, message
    assert await redis.zscore(K.users("default", queued), queued) is not None, message
    assert await redis.hget(K.user_inflight, running) == "1", message
    assert await redis.hget(K.user_saved("default", "bob"), "bob") is not None, \
        "a key's own user was forgotten"
    assert bytes_after < bytes_before / 2, message


async def test_a_pass_forgets_at_most_its_limit_the_longest_idle_first(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.queue.enqueue(M, req("q0", "app/busy", "batch", at=T0 - 1), 10)  # oldest, queued
    for i in range(50):
        await serve(store, f"app/u{i}", f"r{i}", T0 + i)
    now = T0 + 100 + IDLE_S
    passes = []
    while True:
        forgotten, kept = await store.queue.forget_idle(M, now, IDLE_S, 20)
        passes.append((forgotten, kept))
        if forgotten == 0 and kept == 0:
            break
        if len(passes) == 1:  # the busy user seen again, then the 19 idle longest
            left = [e for e in await redis.zrange(K.seen, 0, -1)]
            assert [SEEN.decode(e)["user"] for e in left[:31]] == [
                f"app/u{i}" for i in range(19, 50)], left
        assert len(passes) < 10, passes
    assert passes == [(19, 1), (20, 0), (11, 0), (0, 0)], passes
    assert await redis.zrange(K.seen, 0, -1) == [SEEN.encode("app/busy", "app/busy")]
    assert not [k for k in await end_user_state(redis) if "app/u" in k]


async def test_enqueue_and_settle_mark_the_last_seen_time(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.queue.enqueue(M, dataclasses.replace(req("a", "app/x", at=T0), tenant="acme"), 10)
    entry = SEEN.encode("acme", "app/x")
    assert await redis.zscore(K.seen, entry) == T0
    grants, _ = await store.queue.dispatch(M, "b1", ALL_OPEN, "r1", T0, 10.0)
    await store.queue.settle_and_dispatch(M, grants[0], 5.0, now=T0 + 30)
    assert await redis.zscore(K.seen, entry) == T0 + 30
    await store.queue.enqueue(M, req("b", "carol", at=T0), 10)  # a key's user: not tracked
    assert await redis.zcard(K.seen) == 1


async def test_a_forgotten_end_user_returns_as_a_new_user(redis: aioredis.Redis) -> None:
    """Its saved score goes: it joins each level at the smallest active score, exactly
    as an end user of a new name would (which a trusted key may send at any time)."""
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await serve(store, "app/heavy", "h1", T0, charge=1000.0)
    saved = float(await redis.hget(K.saved("default"), "app/heavy") or 0)
    assert saved > 1000, saved
    await store.queue.enqueue(M, req("o1", "app/other", at=T0 + IDLE_S), 10)
    assert await store.queue.forget_idle(M, T0 + IDLE_S + 1, IDLE_S, 100) == (1, 0)
    await store.queue.enqueue(M, req("h2", "app/heavy", at=T0 + IDLE_S + 2), 10)
    await store.queue.enqueue(M, req("n1", "app/new", at=T0 + IDLE_S + 2), 10)
    scores = dict(await redis.zrange(K.active("default"), 0, -1, withscores=True))
    assert scores["app/heavy"] == scores["app/new"] == scores["app/other"], scores
