"""Length-aware pools and the prefill-token gate in the Lua scripts, against a real
Redis: each case states what ``policies/prefill.py`` says the scripts must do."""

from __future__ import annotations

import dataclasses

import redis.asyncio as aioredis

from gateway.storage.records import BackendFit, Grant, Locality, QueuedRequest
from gateway.storage.store import Store
from policies.gates import BackendSnapshot
from policies.locality import chain
from policies.prefill import TOKENS_PER_BLOCK, PromptRange, still_pending
from tests.store.test_scripts import ALL_OPEN, K, M, alive, req

SHORT = PromptRange(0, 1000)
LONG = PromptRange(1001)


def sized(rid: str, user: str, tokens: int, **kw: object) -> QueuedRequest:
    return dataclasses.replace(req(rid, user, prompt=tokens, **kw),  # type: ignore[arg-type]
                               prompt_tokens=tokens)


async def grants(store: Store, backend: str, fit: BackendFit, want: int = 8,
                 locality: Locality | None = None, now: float = 1000.0) -> list[Grant]:
    found, _ = await store.queue.dispatch(M, backend, ALL_OPEN, "r1", now, 10.0, max_grants=want,
                                    fit=fit, locality=locality)
    return found


async def pending(redis: aioredis.Redis, backend: str) -> dict[str, int]:
    raw = await redis.hgetall(K.backend_prefill(backend))
    return {rid: int(v.split()[0]) for rid, v in raw.items()}


async def test_a_backend_takes_only_the_requests_its_range_holds(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    # alice (least served) has a long prompt first, then a short one; bob a short one
    await store.queue.enqueue(M, sized("a-long", "alice", 5000), 10)
    await store.queue.enqueue(M, sized("a-short", "alice", 200), 10)
    await store.queue.enqueue(M, sized("b-short", "bob", 300), 10)
    got = await grants(store, "short", BackendFit(SHORT), want=1)
    # alice is first in fairness order; her long head is not for this backend, so her
    # next request (within the lookahead) goes, not bob's
    assert [g.request_id for g in got] == ["a-short"]
    got = await grants(store, "short", BackendFit(SHORT))
    assert [g.request_id for g in got] == ["b-short"]  # the long one never goes here
    assert await store.reads.depths(M) == {"interactive": 0, "default": 1, "batch": 0}
    got = await grants(store, "long", BackendFit(LONG))
    assert [g.request_id for g in got] == ["a-long"]


async def test_the_locality_pick_also_keeps_to_the_range(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    text = "x" * 2048
    await store.queue.enqueue(M, dataclasses.replace(sized("long", "alice", 5000),
                                               prefix=chain(text)), 10)
    loc = Locality(10**6, 8, 1000, 600.0)
    assert await grants(store, "short", BackendFit(SHORT), locality=loc) == []
    got = await grants(store, "long", BackendFit(LONG), locality=loc)
    assert [g.request_id for g in got] == ["long"]


async def test_the_gate_holds_a_class_once_pending_prefill_would_pass_its_limit(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    for i, user in enumerate("abcd"):
        await store.queue.enqueue(M, sized(f"r{i}", user, 600), 10)
    fit = BackendFit(prefill_limits={"default": 1000})
    first = await grants(store, "b1", fit)
    assert [g.request_id for g in first] == ["r0"]  # 600 + 600 > 1000: the next one waits
    assert await pending(redis, "b1") == {"r0": 600}
    assert await grants(store, "b1", fit) == []
    await store.queue.mark_started(M, first[0])  # its prefill is done
    assert await pending(redis, "b1") == {}
    second = await grants(store, "b1", fit)
    assert [g.request_id for g in second] == ["r1"]
    await store.queue.settle(M, second[0], 0.0)  # ended before its first token: gone too
    assert await pending(redis, "b1") == {}
    # limit 0: no gate, everything left goes at once
    rest = await grants(store, "b1", BackendFit(prefill_limits={"default": 0}))
    assert sorted(g.request_id for g in rest) == ["r2", "r3"]


async def test_a_prompt_over_the_limit_goes_when_nothing_is_pending(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.queue.enqueue(M, sized("huge", "alice", 30_000), 10)
    await store.queue.enqueue(M, sized("small", "bob", 10), 10)
    fit = BackendFit(prefill_limits={"default": 8192})
    got = await grants(store, "b1", fit)
    assert [g.request_id for g in got] == ["huge"]  # alone, then it holds the small one
    assert await grants(store, "b1", fit) == []


async def test_held_prefix_blocks_are_not_counted_as_prefill(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    text = "system prompt " * 200  # > 8 blocks
    hashes = chain(text)
    loc = Locality(10**6, 8, 1000, 600.0)
    await store.queue.enqueue(M, dataclasses.replace(sized("t1", "alice", 800), prefix=hashes), 10)
    (g1,) = await grants(store, "b1", BackendFit(), locality=loc)
    assert (await pending(redis, "b1"))["t1"] == 800  # nothing cached yet
    await store.queue.mark_started(M, g1)
    await store.queue.enqueue(M, dataclasses.replace(sized("t2", "alice", 800), prefix=hashes), 10)
    (g2,) = await grants(store, "b1", BackendFit(), locality=loc)
    assert g2.matched_blocks == len(hashes)
    assert (await pending(redis, "b1"))["t2"] == max(0, 800 - len(hashes) * TOKENS_PER_BLOCK)


async def test_a_snapshot_keeps_what_it_may_not_have_scheduled(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    sent = []
    for i, at in enumerate((1000.0, 1001.0, 1002.0, 1004.0)):
        await store.queue.enqueue(M, sized(f"s{i}", f"u{i}", 100), 10)
        (g,) = await grants(store, "b1", BackendFit(), want=1, now=at)
        sent.append((g.request_id, at))
    # the scrape began at 1003 and saw one waiting, three running: of the three sent
    # before it, only the newest may still wait; the one sent after stays
    stored = await store.fleet.store_snapshot(M, "b1", BackendSnapshot(1, 3, 0.1, None, 1003.0))
    assert set(await pending(redis, "b1")) == still_pending(sent, 1003.0, 1) == {"s2", "s3"}
    assert stored[:3] == (True, False, 200)  # what is left, for the gauge and the read model
    await redis.delete(K.request("s3"))  # its request is gone (expired): so is its entry
    await store.fleet.store_snapshot(M, "b1", BackendSnapshot(0, 4, 0.1, None, 1003.5))
    assert await pending(redis, "b1") == {}


async def test_reap_clears_a_dead_replicas_pending_prefill(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1", "dead")
    await store.queue.enqueue(M, sized("d1", "alice", 500, owner="dead"), 10)
    found, _ = await store.queue.dispatch(M, "b1", ALL_OPEN, "r1", 1000.0, 10.0,
                                    fit=BackendFit())
    assert [g.request_id for g in found] == ["d1"] and await pending(redis, "b1") == {"d1": 500}
    await store.replicas.heartbeat([M], "r1", 1100.0)
    assert await store.queue.reap(M, 1100.0, 10.0) == 1
    assert await pending(redis, "b1") == {}


async def test_smaller_requests_pass_a_held_one_only_for_the_backfill_time(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    for rid, user, tokens in (("a", "alice", 600), ("big", "bob", 5000), ("c", "carol", 300),
                              ("d", "dave", 300)):
        await store.queue.enqueue(M, sized(rid, user, tokens), 10)
    fit = BackendFit(prefill_limits={"default": 1000}, backfill_s=1.0)
    first = await grants(store, "b1", fit, now=1000.0)
    # alice's goes (nothing pending); bob's 5,000 would pass the limit, so it is held and
    # carol's 300 fits the 400 left; dave's 300 would not fit the 100 then left
    assert [g.request_id for g in first] == ["a", "c"]
    assert await pending(redis, "b1") == {"a": 600, "c": 300}
    # 2 s later bob's has waited past backfill_s: nobody passes it any more
    assert await grants(store, "b1", fit, now=1002.0) == []
    for g in first:
        await store.queue.mark_started(M, g)
    # the backend drained: the held one goes first
    again = await grants(store, "b1", fit, now=1002.5)
    assert [g.request_id for g in again] == ["big"]


async def test_with_locality_the_backfill_takes_the_best_cached_request_that_fits(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    system = "system prompt of the help desk " * 70  # 8 full blocks
    warm = chain(system)
    loc = Locality(10**6, 8, 1000, 600.0)
    fit = BackendFit(prefill_limits={"default": 1000}, backfill_s=1.0)
    # the backend's index learns the system prompt; 300 tokens stay pending there
    await store.queue.enqueue(M, dataclasses.replace(sized("t0", "alice", 800), prefix=warm), 10)
    (t0,) = await grants(store, "b1", fit, locality=loc)
    await store.queue.mark_started(M, t0)
    await store.queue.enqueue(M, sized("x0", "zed", 300), 10)
    assert [g.request_id for g in await grants(store, "b1", fit, locality=loc)] == ["x0"]
    # bob's RAG prompt shares the cached prefix: locality's choice, but 4,488 uncached
    # tokens do not fit the 700 left, so it is held. Carol's cold 600 tokens would fit,
    # and she comes first in fairness order; alice's 900 tokens are 388 uncached here
    await store.queue.enqueue(M, dataclasses.replace(sized("big", "bob", 5000), prefix=warm), 10)
    await store.queue.enqueue(M, dataclasses.replace(
        sized("cold", "carol", 600), prefix=chain("another prompt " * 70)), 10)
    await store.queue.enqueue(M, dataclasses.replace(sized("warm", "alice", 900), prefix=warm), 10)
    got = await grants(store, "b1", fit, locality=loc)
    assert [g.request_id for g in got] == ["warm"] and got[0].matched_blocks == len(warm)
    assert (await pending(redis, "b1"))["warm"] == 900 - len(warm) * TOKENS_PER_BLOCK


async def test_over_the_limit_a_dead_replicas_request_is_dropped_not_held(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1", "gone")
    await store.queue.enqueue(M, sized("huge", "alice", 30_000), 10)
    await store.queue.enqueue(M, sized("orphan", "bob", 10, owner="gone"), 10)
    fit = BackendFit(prefill_limits={"default": 8192}, backfill_s=1.0)
    (huge,) = await grants(store, "b1", fit, want=1)
    assert huge.request_id == "huge"  # 30,000 pending: over the limit by itself
    await store.replicas.heartbeat([M], "r1", 1100.0)  # "gone" has not beaten since 1000
    assert await grants(store, "b1", fit, now=1100.0) == []
    # the orphan was taken out of the queue and its hash deleted, not left holding it
    assert await store.reads.depths(M) == {"interactive": 0, "default": 0, "batch": 0}
    assert not await store.reads.request_exists(M, "orphan")
