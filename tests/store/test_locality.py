"""The locality choice inside dispatch.lua and the per-backend prefix index, on Redis."""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.records import BackendFit, Locality, QueuedRequest
from gateway.storage.store import Store
from policies.fairness import Vtc, with_locality
from policies.locality import choose
from policies.prefill import PromptRange

M = "m"
K = ModelKeys(M)
OPEN = {"interactive": 100, "default": 100, "batch": 100}
LOCAL = Locality(slack=50.0, candidates=8, index_size=100, index_ttl_s=60.0)


def req(rid: str, user: str, prefix: tuple[str, ...], cost: float = 10.0) -> QueuedRequest:
    return QueuedRequest(rid, user, "default", "r1", cost, 1000.0, prefix)


async def grant_user(store: Store, backend: str, locality: Locality | None = LOCAL,
                     now: float = 1000.0) -> str:
    grants, _ = await store.queue.dispatch(M, backend, OPEN, "r1", now, 10.0, locality=locality)
    assert len(grants) == 1
    return grants[0].user


async def test_dispatch_records_the_prefix_index_bounded_and_expiring(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await store.queue.enqueue(M, req("a1", "alice", ("p1", "p2", "p3")), 10)
    small = Locality(slack=50.0, candidates=8, index_size=2, index_ttl_s=60.0)
    assert await grant_user(store, "b1", small) == "alice"
    assert await redis.zrange(K.backend_prefixes("b1"), 0, -1) == ["p2", "p3"]  # LRU-trimmed
    assert 0 < await redis.ttl(K.backend_prefixes("b1")) <= 60
    assert not await redis.exists(K.backend_prefixes("b2"))
    await store.fleet.forget_prefixes(M, "b1")
    assert not await redis.exists(K.backend_prefixes("b1"))


async def test_least_loaded_routing_keeps_no_index(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await store.queue.enqueue(M, req("a1", "alice", ("p1",)), 10)
    assert await grant_user(store, "b1", None) == "alice"
    assert not await redis.exists(K.backend_prefixes("b1"))


async def test_within_the_slack_the_cached_head_goes_first(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await redis.zadd(K.backend_prefixes("b1"), {"s1": 1000.0, "s2": 1000.0})
    await redis.zadd(K.backend_prefixes("b2"), {"t1": 1000.0})
    await store.queue.enqueue(M, req("a1", "alice", ("n1", "n2")), 10)
    await store.queue.enqueue(M, req("b1", "bob", ("s1", "s2", "s3")), 10)
    await store.queue.enqueue(M, req("c1", "carol", ("t1",)), 10)
    await redis.zadd(K.active("default"), {"alice": 100.0, "bob": 140.0, "carol": 149.0})
    # b2 holds carol's prefix, b1 bob's (longer); alice, least served, has none cached
    assert await grant_user(store, "b1") == "bob"
    assert await grant_user(store, "b2") == "carol"
    assert await grant_user(store, "b2") == "alice"


async def test_a_user_beyond_the_slack_is_not_served_first(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await redis.zadd(K.backend_prefixes("b1"), {"s1": 1000.0})
    await store.queue.enqueue(M, req("a1", "alice", ("n1",)), 10)
    await store.queue.enqueue(M, req("b1", "bob", ("s1",)), 10)
    await redis.zadd(K.active("default"), {"alice": 100.0, "bob": 150.5})
    assert await grant_user(store, "b1") == "alice"  # bob is 50.5 above, the slack is 50


async def test_the_script_mirrors_the_pure_choice(redis: aioredis.Redis) -> None:
    cached = {"c1", "c2", "c3"}
    users = {"u0": (100.0, ("x",)), "u1": (110.0, ("c1",)), "u2": (120.0, ("c1", "c2")),
             "u3": (160.0, ("c1", "c2", "c3")), "u4": (120.0, ("c1", "c2", "x"))}
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await redis.zadd(K.backend_prefixes("b1"), dict.fromkeys(cached, 1000.0))
    for user, (_, chain) in users.items():
        await store.queue.enqueue(M, req(f"{user}-r", user, chain), 10)
    await redis.zadd(K.active("default"), {u: s for u, (s, _) in users.items()})
    order = sorted(users, key=lambda u: (users[u][0], u))
    chosen = choose([(users[u][0], [users[u][1]]) for u in order], cached, LOCAL.slack,
                    LOCAL.candidates)
    assert chosen is not None
    expected = order[chosen[0]]
    assert expected == "u2"
    assert await grant_user(store, "b1") == expected


async def test_a_session_waits_for_its_backend_unless_that_one_is_overloaded(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    affinity = Locality(slack=50.0, candidates=8, index_size=100, index_ttl_s=60.0,
                        max_imbalance=2, others=("b1", "b2"))
    await redis.zadd(K.backend_prefixes("b2"), {"s1": 1000.0})
    await store.queue.enqueue(M, req("a1", "alice", ("s1", "s2")), 10)
    # b1 has room, b2 holds alice's prefix and is not much busier: b1 leaves it
    await redis.set(K.backend_inflight("b2"), 2)
    grants, depth = await store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0, locality=affinity)
    assert grants == [] and depth == 1
    # b2 is now 3 requests busier than b1 (more than 2): b1 takes it
    await redis.set(K.backend_inflight("b2"), 3)
    assert await grant_user(store, "b1", affinity) == "alice"


async def test_fairness_bound_holds_when_one_users_prompts_are_all_cached(
        redis: aioredis.Redis) -> None:
    """Backlogged users on one backend whose index holds every prompt of "hot" (and none
    of the others'): locality serves "hot" ahead, but the gap in weighted service between
    any two users never exceeds VTC's bound plus the slack."""
    vtc = Vtc()
    prompt, output, slack = 500, 100, 2000.0
    locality = Locality(slack=slack, candidates=8, index_size=1000, index_ttl_s=600.0)
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await redis.zadd(K.backend_prefixes("b1"), {"hot1": 1000.0, "hot2": 1000.0})
    users = ("hot", "cold1", "cold2")
    for i in range(40):
        for user in users:
            chain = ("hot1", "hot2") if user == "hot" else (f"{user}-{i}",)
            await store.queue.enqueue(M, req(f"{user}-{i}", user, chain,
                                       vtc.dispatch_cost(prompt, 1.0)), 100)
    served = dict.fromkeys(users, 0.0)
    bound = with_locality(vtc.bound(vtc.service(prompt, output, 1.0), 0, 0.0), slack)
    for _ in range(60):
        grants, _ = await store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0, locality=locality)
        (grant,) = grants
        await store.queue.settle(M, grant, vtc.settle_charge(prompt, prompt, output, 1.0))
        served[grant.user] += vtc.service(prompt, output, 1.0)
        assert max(served.values()) - min(served.values()) <= bound
    assert served["hot"] > served["cold1"] + vtc.service(prompt, output, 1.0)  # it did bend


async def test_a_users_cached_later_request_passes_its_older_one(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await redis.zadd(K.backend_prefixes("b1"), {"s1": 1000.0})
    await store.queue.enqueue(M, req("a1", "alice", ("n1",)), 10)
    await store.queue.enqueue(M, req("a2", "alice", ("s1",)), 10)
    grants, _ = await store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0, locality=LOCAL)
    assert [g.request_id for g in grants] == ["a2"]
    assert await redis.lrange(K.queue("default", "alice"), 0, -1) == ["a1"]
    grants, _ = await store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0, locality=LOCAL)
    assert [g.request_id for g in grants] == ["a1"]


SHORT = BackendFit(PromptRange(0, 8192))
LONG = BackendFit(PromptRange(8193, None))
POOLED = Locality(slack=50.0, candidates=8, index_size=100, index_ttl_s=60.0,
                  max_imbalance=2, others=("short", "long"), fits={"short": SHORT, "long": LONG})


def sized(rid: str, user: str, prefix: tuple[str, ...], tokens: int) -> QueuedRequest:
    return QueuedRequest(rid, user, "default", "r1", 10.0, 1000.0, prefix,
                         prompt_tokens=tokens)


async def pooled_grants(store: Store, backend: str, fit: BackendFit) -> list[str]:
    grants, _ = await store.queue.dispatch(M, backend, OPEN, "r1", 1000.0, 10.0, locality=POOLED,
                                     fit=fit)
    return [g.request_id for g in grants]


async def test_a_conversation_grown_past_the_short_pool_is_not_left_to_it(
        redis: aioredis.Redis) -> None:
    """The short pool holds the conversation's earlier turns; grown past its range, the
    next turn is the long pool's, which must not leave it to the short one."""
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await redis.zadd(K.backend_prefixes("short"), {"s1": 1000.0, "s2": 1000.0})
    await store.queue.enqueue(M, sized("turn9", "alice", ("s1", "s2", "s3"), 9000), 10)
    assert await pooled_grants(store, "short", SHORT) == []  # out of its range
    served = await pooled_grants(store, "long", LONG)
    assert served == ["turn9"], f"the long pool granted {served}"


async def test_short_prompts_are_not_left_to_the_long_pool_holding_their_prefix(
        redis: aioredis.Redis) -> None:
    """A long request sharing a system prompt went to the long pool; short requests of
    other users with that system prompt are the short pool's."""
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await redis.zadd(K.backend_prefixes("long"), {"sys": 1000.0})
    for user in ("bob", "carol", "dave"):
        await store.queue.enqueue(M, sized(f"{user}-1", user, ("sys", f"{user}-q"), 300), 10)
    assert await pooled_grants(store, "long", LONG) == []  # out of its range
    served = [rid for _ in range(3) for rid in await pooled_grants(store, "short", SHORT)]
    assert sorted(served) == ["bob-1", "carol-1", "dave-1"], f"the short pool granted {served}"


async def test_a_request_is_still_left_to_the_backend_of_its_pool_holding_its_prefix(
        redis: aioredis.Redis) -> None:
    """Within one pool the bounded-load affinity is unchanged: a short prompt whose prefix
    another short backend holds waits for it."""
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    affinity = Locality(slack=50.0, candidates=8, index_size=100, index_ttl_s=60.0,
                        max_imbalance=2, others=("s0", "s1"), fits={"s0": SHORT, "s1": SHORT})
    await redis.zadd(K.backend_prefixes("s1"), {"sys": 1000.0})
    await store.queue.enqueue(M, sized("a1", "alice", ("sys", "q"), 300), 10)
    grants, depth = await store.queue.dispatch(M, "s0", OPEN, "r1", 1000.0, 10.0, locality=affinity,
                                         fit=SHORT)
    assert grants == [] and depth == 1, f"s0 granted {grants}"
