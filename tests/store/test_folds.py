"""The dispatch decision folded into the calls a request makes anyway: a settle or a
started whose slot frees grants the backend's next request in the same script call, a
tick's enqueues go in one call with their dispatch; grants for another replica's clients
travel through its grant list, whichever script made them."""

from __future__ import annotations

from dataclasses import replace
from datetime import date

import redis.asyncio as aioredis

from gateway.core.settings import ApiKey
from gateway.scheduling.usage import UsageLedger
from gateway.storage.dispatch_call import dispatch_args
from gateway.storage.keys import ModelKeys
from gateway.storage.records import Grant, Start
from gateway.storage.store import Store
from gateway.storage.values import GRANT
from policies.gates import BackendSnapshot
from tests.store.test_scripts import alive, dispatch, req

M = "m"
K = ModelKeys(M)
ONE = {"interactive": 1, "default": 1, "batch": 1}  # one request in transit at a time


def then(limits: dict[str, int] = ONE, want: int = 1) -> dict[str, object]:
    return dispatch_args(M, "b1", limits, "r1", 1000.0, 10.0, max_grants=want)


async def first_granted(store: Store) -> Grant:
    await alive(store, "r1", "r2")
    await store.queue.enqueue(M, req("a1", "alice"), 10)
    await store.queue.enqueue(M, req("b1", "bob"), 10)
    grant = await dispatch(store, ONE)
    assert grant is not None and grant.request_id == "a1", grant
    assert await dispatch(store, ONE) is None  # the gate is full: bob waits
    return grant


async def test_a_settle_grants_the_next_queued_request_in_the_same_call(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    grant = await first_granted(store)
    released, done = await store.queue.settle_and_dispatch(M, grant, 5.0, then=then())
    assert released, "the settle did not release a1"
    assert done is not None and [g.request_id for g in done.grants] == ["b1"], done
    assert done.depth == 0, done
    assert await redis.zrange(K.backend_sent("b1"), 0, -1) == ["b1"]
    assert await store.reads.user_inflight(M) == {"bob": 1}
    # settled once: a second settle releases nothing and grants nothing more
    released, done = await store.queue.settle_and_dispatch(M, grant, 5.0, then=then())
    assert not released and done is not None and done.grants == [], done


async def test_a_settle_without_a_decision_only_settles(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    grant = await first_granted(store)
    released, done = await store.queue.settle_and_dispatch(M, grant, 5.0)
    assert released and done is None, done
    assert await store.reads.depths(M) == {"interactive": 0, "default": 1, "batch": 0}


async def test_a_started_request_frees_its_slot_and_grants_the_next(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    grant = await first_granted(store)
    # the gate counts requests in transit: a1's first token takes it out
    done = await store.queue.mark_started(M, grant, 1001.0, then=then())
    assert done is not None and [g.request_id for g in done.grants] == ["b1"], done
    assert await redis.zrange(K.backend_sent("b1"), 0, -1) == ["b1"]
    # a second first token frees nothing, so decides nothing
    assert await store.queue.mark_started(M, grant, 1002.0, then=then()) is None


async def test_a_fold_grants_another_replicas_request_through_its_grant_list(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1", "r2")
    await store.queue.enqueue(M, req("a1", "alice"), 10)
    await store.queue.enqueue(M, req("c1", "carol", owner="r2"), 10)
    grant = await dispatch(store, ONE)
    assert grant is not None and grant.request_id == "a1"
    _, done = await store.queue.settle_and_dispatch(M, grant, 5.0, then=then())
    assert done is not None and [(g.request_id, g.owner) for g in done.grants] == [
        ("c1", "r2")], done
    pushed = [GRANT.decode(e) for e in await redis.lrange(K.grants("r2"), 0, -1)]
    assert [(e["request_id"], e["backend"]) for e in pushed] == [("c1", "b1")], pushed
    assert await redis.llen(K.grants("r1")) == 0
    assert await redis.smembers(K.running("r2")) == {"c1"}


async def test_a_ticks_enqueues_and_their_dispatch_are_one_call(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    positions, done = await store.queue.enqueue_many(
        M, [req("a1", "alice"), req("a2", "alice"), req("b1", "bob")], 10,
        then=then({"interactive": 2, "default": 2, "batch": 2}, want=3))
    assert positions == [1, 2, 1], positions
    assert done is not None and [g.request_id for g in done.grants] == ["a1", "b1"], done
    assert done.depth == 1 and done.backlogged_since.keys() == {"default"}, done
    assert done.recent == ["default", "default"], done


async def test_a_settle_adds_the_requests_usage(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    grant = await first_granted(store)
    ledger = UsageLedger(redis, 30, lambda: [M])  # type: ignore[arg-type]
    key = ApiKey(key="sk-x", user="alice")
    usage = ledger.counts(key, M, "default", 12, 3, error=False, now=86400.0)
    await store.queue.settle_and_dispatch(M, grant, 5.0, usage=usage)
    rows = await ledger.rows(date(1970, 1, 2), date(1970, 1, 2))
    assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"], r["errors"])
            for r in rows] == [(1, 12, 3, 0)], rows
    assert 0 < await redis.ttl(usage.key) <= usage.ttl_s


async def test_a_late_start_the_snapshot_already_shows_takes_no_other_requests_unseen(
        redis: aioredis.Redis) -> None:
    """A start sent late (its replica held it while nothing was queued) after a snapshot
    whose scrape began after the first token: the snapshot counts it running, so it must
    not take another request out of the snapshot's "unseen" (that would loosen the gate)."""
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.queue.enqueue(M, req("a1", "alice"), 10)
    await store.queue.enqueue(M, req("b1", "bob"), 10)
    first, second = await dispatch(store), await dispatch(store)
    assert first is not None and second is not None
    # the scrape began at 1005: a1 (first token at 1003) runs, b1 is not registered yet
    assert (await store.fleet.store_snapshot(
        M, "b1", BackendSnapshot(0, 1, 0.1, None, 1005.0))).stored
    assert await redis.hget(K.backend_snapshot("b1"), "unseen") == "1"
    await store.queue.mark_started(M, first, 1003.0)
    unseen = await redis.hget(K.backend_snapshot("b1"), "unseen")
    assert unseen == "1", f"a start the snapshot showed took another's unseen: {unseen}"
    assert await redis.zrange(K.backend_started("b1"), 0, -1) == []
    assert await redis.hget(K.request("a1"), "started") == "1"
    # b1 starts after the scrape began: it took a batch slot (the started set), and it
    # stays the snapshot's unseen until the next snapshot (its start cannot tell whether
    # the scrape saw it: tests/test_pacing.py, late starts)
    await store.queue.mark_started(M, second, 1006.0)
    assert await redis.hget(K.backend_snapshot("b1"), "unseen") == "1"
    assert await redis.zrange(K.backend_started("b1"), 0, -1) == ["b1"]


async def test_starts_ride_on_a_settle_before_its_release(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.queue.enqueue(M, req("a1", "alice"), 10)
    await store.queue.enqueue(M, req("b1", "bob"), 10)
    first, second = await dispatch(store), await dispatch(store)
    assert first is not None and second is not None
    released, _ = await store.queue.settle_and_dispatch(
        M, first, 1.0, starts=[Start("a1", "b1", 1001.0), Start("b1", "b1", 1002.0)])
    assert released
    assert await redis.hget(K.request("b1"), "started") == "1", "b1's start was not marked"
    assert await redis.zrange(K.backend_sent("b1"), 0, -1) == []
    assert await redis.zrange(K.backend_started("b1"), 0, -1) == ["b1"]
    assert await store.reads.user_inflight(M) == {"bob": 1}


async def test_a_continued_segment_leaves_its_backend_when_its_continuation_is_queued(
        redis: aioredis.Redis) -> None:
    """A stream moved off b1 (preempted, drained, or b1 failed): vLLM freed its slot, so
    the in-flight count must drop as its continuation is queued, not when the whole answer
    ends (else every snapshot counts it "unseen" and the gates stay closed). Its hash
    stays (the answer's preemption count), a late start of it changes nothing, and the
    answer's settle releases nothing twice."""
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.queue.enqueue(M, req("a1", "alice"), 10)
    grant = await dispatch(store)
    assert grant is not None and grant.request_id == "a1", grant
    await store.queue.mark_started(M, grant, 1001.0)
    await redis.hset(K.request("a1"), "preempted", 1)
    assert await redis.get(K.backend_inflight("b1")) == "1"
    cont = replace(req("a1~1", "alice"), cost=0.0, leaves=("a1", "b1"))
    assert await store.queue.enqueue(M, cont, 10) == 1
    fields = await redis.hgetall(K.request("a1"))
    assert (await redis.get(K.backend_inflight("b1")), fields.get("left"),
            fields.get("preempted")) == (None, "1", "1"), fields
    assert await store.reads.user_inflight(M) == {}
    # the snapshot after the move shows b1 empty: nothing reads as unseen
    snap = BackendSnapshot(waiting=0, running=0, kv_usage=0.0, tpot_s=None,
                           taken_at_s=1002.0)
    await store.fleet.store_snapshot(M, "b1", snap)
    assert await redis.hget(K.backend_snapshot("b1"), "unseen") == "0"
    # the continuation runs on b1 again; a late start of the segment that left is ignored
    second = await dispatch(store)
    assert second is not None and second.request_id == "a1~1", second
    await store.queue.mark_starts(M, [Start("a1", "b1", 1003.0)])
    assert await redis.zcard(K.backend_started("b1")) == 0
    # each segment settles once: the in-flight count ends at 0, not below
    assert await store.queue.settle(M, second, 0.0)
    assert await store.queue.settle(M, grant, 5.0)
    assert (await redis.get(K.backend_inflight("b1")), await store.reads.user_inflight(M),
            await redis.exists(K.request("a1"))) == (None, {}, 0)
    assert await redis.smembers(K.running("r1")) == set()
