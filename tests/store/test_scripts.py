"""Each Lua script against a real Redis server."""

from __future__ import annotations

import dataclasses

import pytest
import redis.asyncio as aioredis

from gateway.core.errors import StoreUnavailable
from gateway.storage.dispatch_call import dispatch_args
from gateway.storage.keys import ModelKeys
from gateway.storage.records import Grant, QueuedRequest
from gateway.storage.store import Store
from policies.fairness import FairnessPolicy, Vtc
from policies.gates import BackendSnapshot

M = "m"
K = ModelKeys(M)
ALL_OPEN = {"interactive": 100, "default": 100, "batch": 100}
VTC = Vtc()


def req(rid: str, user: str, klass: str = "default", prompt: int = 10, weight: float = 1.0,
        owner: str = "r1", policy: FairnessPolicy = VTC, at: float = 1000.0) -> QueuedRequest:
    return QueuedRequest(rid, user, klass, owner, policy.dispatch_cost(prompt, weight), at)


async def alive(store: Store, *replicas: str) -> None:
    for r in replicas:
        await store.replicas.heartbeat([M], r, 1000.0)


async def dispatch(store: Store, limits: dict[str, int] = ALL_OPEN,
                   backend: str = "b1") -> Grant | None:
    grants, _ = await store.queue.dispatch(M, backend, limits, "r1", 1000.0, 10.0)
    assert len(grants) <= 1
    return grants[0] if grants else None


async def test_enqueue_caps_per_user_and_counts_depth(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    assert await store.queue.enqueue(M, req("a1", "a"), max_queued=2) == 1
    assert await store.queue.enqueue(M, req("a2", "a"), max_queued=2) == 2
    assert await store.queue.enqueue(M, req("a3", "a"), max_queued=2) == -1
    assert await store.reads.depths(M) == {"interactive": 0, "default": 2, "batch": 0}
    assert await redis.lrange(K.queue("default", "a"), 0, -1) == ["a1", "a2"]
    assert await redis.ttl(K.request("a1")) > 0


async def test_enqueue_vtc_lifts_returning_user_to_min_active(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await redis.zadd(K.active("default"), {"busy": 500.0})
    await redis.hset(K.saved("default"), "idle", 20.0)
    await store.queue.enqueue(M, req("x", "idle"), 10)
    assert await redis.zscore(K.active("default"), "idle") == 500.0


async def test_dispatch_serves_class_order_then_smallest_score(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.queue.enqueue(M, req("b1", "bob", "batch"), 10)
    await store.queue.enqueue(M, req("a1", "alice", prompt=100), 10)
    await store.queue.enqueue(M, req("a2", "alice", prompt=100), 10)
    await store.queue.enqueue(M, req("c1", "carol", prompt=5), 10)
    await store.queue.enqueue(M, req("i1", "ivan", "interactive"), 10)
    order = []
    while (g := await dispatch(store)) is not None:
        order.append(g.request_id)
    # interactive first; in default, alice (charged 100) yields to carol; batch last
    assert order == ["i1", "a1", "c1", "a2", "b1"]
    assert await store.reads.depths(M) == {"interactive": 0, "default": 0, "batch": 0}


async def test_dispatch_ranks_grow_with_user_inflight(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    for i in range(3):
        await store.queue.enqueue(M, req(f"a{i}", "a"), 10)
    await store.queue.enqueue(M, req("b0", "b"), 10)
    grants = [await dispatch(store) for _ in range(4)]
    assert [(g.request_id, g.rank) for g in grants if g] == [
        ("a0", 0), ("b0", 0), ("a1", 1), ("a2", 2)]
    assert await store.reads.user_inflight(M) == {"a": 3, "b": 1}


async def test_dispatch_respects_gate_limit_per_class(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    for i in range(5):
        await store.queue.enqueue(M, req(f"d{i}", "u"), 10)
    await store.queue.enqueue(M, req("bt", "v", "batch"), 10)
    limits = {"interactive": 3, "default": 3, "batch": 1}
    got = [await dispatch(store, limits) for _ in range(5)]
    assert [g.request_id if g else None for g in got] == ["d0", "d1", "d2", None, None]
    assert await redis.zcard(K.backend_sent("b1")) == 3
    # another backend has its own budget
    other = await dispatch(store, limits, backend="b2")
    assert other is not None and other.backend == "b2"


async def test_dispatch_skips_requests_of_dead_replicas(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.replicas.heartbeat([M], "dead", 900.0)  # older than the 10 s ttl
    await store.queue.enqueue(M, req("x", "a", owner="dead", at=850.0), 10)
    await store.queue.enqueue(M, req("y", "a", owner="gone", at=890.0), 10)  # enqueued, then died
    await store.queue.enqueue(M, req("z", "a", owner="r1"), 10)
    g = await dispatch(store)
    assert g is not None and g.request_id == "z"
    assert not await redis.exists(K.request("x"), K.request("y"))


async def test_enqueue_and_dispatch_register_the_replica(redis: aioredis.Redis) -> None:
    # a Redis restarted empty has no heartbeats: the enqueueing replica is alive anyway
    store = Store.over(redis, 600)
    await store.queue.enqueue(M, req("a1", "a", owner="r1"), 10)
    assert await redis.zscore(K.replicas, "r1") == 1000.0
    g = await dispatch(store)
    assert g is not None and g.request_id == "a1"
    assert float((await redis.hgetall(K.request("a1")))["dispatched_at"]) == 1000.0


async def test_dispatch_pushes_grant_to_owning_replica(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1", "r2")
    await store.queue.enqueue(M, req("x", "a", owner="r2"), 10)
    g = await dispatch(store)
    assert g is not None and g.owner == "r2"
    assert await store.replicas.next_order(M, "r2", 0.1) == ("x", "b1", 0, 0)  # 0 prompt tokens
    assert await store.replicas.next_order(M, "r1", 0.05) is None


async def test_settle_releases_once_and_charges(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.queue.enqueue(M, req("a0", "a", prompt=10), 10)
    await store.queue.enqueue(M, req("a1", "a", prompt=10), 10)
    g = await dispatch(store)
    assert g is not None
    assert await redis.zscore(K.active("default"), "a") == 10.0
    assert await store.queue.settle(M, g, 40.0)
    assert not await store.queue.settle(M, g, 40.0)  # idempotent
    assert await redis.zscore(K.active("default"), "a") == 50.0
    assert await store.reads.user_inflight(M) == {}
    assert await redis.get(K.backend_inflight("b1")) is None
    assert await redis.zcard(K.backend_sent("b1")) == 0
    assert not await redis.exists(K.running("r1"))


async def test_settle_charges_idle_user_saved_score(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.queue.enqueue(M, req("a0", "a", prompt=10), 10)
    g = await dispatch(store)
    assert g is not None
    await store.queue.settle(M, g, 7.0)
    assert float(await redis.hget(K.saved("default"), "a")) == 17.0  # type: ignore[arg-type]


async def test_cancel_removes_queued_only(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.queue.enqueue(M, req("a0", "a"), 10)
    await store.queue.enqueue(M, req("a1", "a"), 10)
    assert await store.queue.cancel(M, "a1", "a", "default")
    assert not await store.queue.cancel(M, "a1", "a", "default")
    g = await dispatch(store)
    assert g is not None and g.request_id == "a0"
    assert not await store.queue.cancel(M, "a0", "a", "default")  # already dispatched
    assert await redis.zcard(K.active("default")) == 0
    assert await store.reads.depths(M) == {"interactive": 0, "default": 0, "batch": 0}


async def test_snapshot_keeps_newest_and_forgets_seen_dispatches(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await redis.zadd(K.backend_sent("b1"), {"old": 990.0, "after_scrape": 1000.5})
    await redis.set(K.backend_inflight("b1"), 10)
    snap = BackendSnapshot(waiting=2, running=5, kv_usage=0.5, tpot_s=0.02, taken_at_s=1000.0)
    assert (await store.fleet.store_snapshot(M, "b1", snap))[:3] == (True, False, 0)
    assert await redis.zrange(K.backend_sent("b1"), 0, -1) == ["after_scrape"]
    # 10 in flight, the backend showed 7, one went out after the scrape: 2 still on the way
    assert await redis.hget(K.backend_snapshot("b1"), "unseen") == "2"
    older = BackendSnapshot(9, 9, 0.9, None, 999.0)
    assert (await store.fleet.store_snapshot(M, "b1", older))[:3] == (False, False, 0)
    states = await store.fleet.backend_states(M, ["b1", "b2"])
    assert states["b1"].snapshot == snap and states["b1"].sent_since_snapshot == 1
    assert states["b2"].snapshot is None


async def test_unseen_requests_count_against_the_gate(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    for i in range(6):
        await store.queue.enqueue(M, req(f"a{i}", "a"), 10)
    sent, _ = await store.queue.dispatch(M, "b1", {"default": 2}, "r1", 999.0, 10.0,
                                         max_grants=9)
    assert len(sent) == 2
    # two sent, no first token, the backend shows none yet
    await store.fleet.store_snapshot(M, "b1", BackendSnapshot(0, 0, 0.0, None, 1000.0))
    assert await redis.hget(K.backend_snapshot("b1"), "unseen") == "2"
    grants, _ = await store.queue.dispatch(M, "b1", {"default": 3}, "r1", 1000.0, 10.0,
                                           max_grants=9)
    assert len(grants) == 1, grants  # 3 - 2 unseen


async def test_unseen_counts_only_requests_without_a_first_token(
        redis: aioredis.Redis) -> None:
    """In front of a backend that answers faster than it is scraped, the requests vLLM
    finished while the gateway still relays them are in flight but in no /metrics count:
    the snapshot reads them as "unseen". They streamed their first tokens, so none can
    wait at vLLM: they must not hold the gate (they held it shut, and requests queued in
    the gateway while vLLM's queue was empty)."""
    store = Store.over(redis, 600)
    await alive(store, "r1")
    for i in range(8):
        await store.queue.enqueue(M, req(f"a{i}", "a"), 10)
    sent, _ = await store.queue.dispatch(M, "b1", {"default": 3}, "r1", 999.0, 10.0,
                                         max_grants=9)
    assert len(sent) == 3
    for grant in sent[:2]:  # answered: first tokens relayed, the settles still to come
        await store.queue.mark_started(M, grant, 999.5)
    await store.fleet.store_snapshot(M, "b1", BackendSnapshot(0, 0, 0.0, None, 1000.0))
    unseen = await redis.hget(K.backend_snapshot("b1"), "unseen")
    assert unseen == "3", f"3 in flight, none in /metrics: unseen {unseen}"
    # only the one without a first token may still wait: 3 - 1
    grants, _ = await store.queue.dispatch(M, "b1", {"default": 3}, "r1", 1000.0, 10.0,
                                           max_grants=9)
    assert len(grants) == 2, f"granted {[g.request_id for g in grants]}, want 2"
    states = await store.fleet.backend_states(M, ["b1"])
    assert (states["b1"].unseen, states["b1"].sent_since_snapshot) == (1, 2), states
    # its first token comes: a place frees, and the start decides again at once
    then = dispatch_args(M, "b1", {"default": 3}, "r1", 1000.5, 10.0, max_grants=9)
    done = await store.queue.mark_started(M, sent[2], 1000.2, then)
    assert done is not None and [g.request_id for g in done.grants] == ["a5"], done


async def test_reap_releases_what_a_dead_replica_held(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1", "r2")
    await store.queue.enqueue(M, req("x", "a", owner="r2"), 10)
    await store.queue.enqueue(M, req("y", "a", owner="r1"), 10)
    assert (await dispatch(store)) is not None  # x → grant waits in r2's list
    assert (await dispatch(store)) is not None  # y → r1 (alive)
    assert await store.reads.user_inflight(M) == {"a": 2}
    assert await redis.smembers(K.running("r2")) == {"x"}
    assert await store.queue.reap(M, 1001.0, 10.0) == 0  # r2 not yet silent for 10 s
    await store.replicas.heartbeat([M], "r1", 1020.0)
    assert await store.queue.reap(M, 1020.0, 10.0) == 1
    assert await store.reads.user_inflight(M) == {"a": 1}  # y, held by live r1, stays
    assert not await redis.exists(K.running("r2"), K.grants("r2"), K.request("x"))
    assert await redis.zscore(K.replicas, "r2") is None
    assert await redis.get(K.backend_inflight("b1")) == "1"


async def test_a_replica_leaving_its_grants_unread_is_dead(redis: aioredis.Redis) -> None:
    # killed a moment after its last heartbeat: the grants pushed to it go unread
    store = Store.over(redis, 600)
    await alive(store, "r1", "r2")
    await store.queue.enqueue(M, req("x1", "a", owner="r2"), 10)
    await store.queue.enqueue(M, req("x2", "a", owner="r2"), 10)
    await store.queue.enqueue(M, req("y", "b", owner="r1"), 10)
    assert (g := await dispatch(store)) is not None and g.request_id == "x1"
    await store.replicas.heartbeat([M], "r2", 1001.0)  # still beating...
    await store.replicas.heartbeat([M], "r1", 1003.0)
    # ...but x1's grant has waited 3 s (> 2 s): x2 is dropped, not granted to r2
    grants, _ = await store.queue.dispatch(M, "b1", ALL_OPEN, "r1", 1003.0, 10.0, max_grants=5)
    assert [g.request_id for g in grants] == ["y"]
    assert await store.queue.reap(M, 1003.0, 10.0) == 1  # x1's slot is released at once
    assert await store.reads.user_inflight(M) == {"b": 1}
    assert await redis.zscore(K.replicas, "r2") is None


async def test_dispatched_reads_a_grant_back_for_orphan_release(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.queue.enqueue(M, req("x", "a"), 10)
    assert await store.replicas.dispatched(M, "x") is None  # queued, not dispatched
    g = await dispatch(store)
    back = await store.replicas.dispatched(M, "x")
    assert back is not None and (back.user, back.klass, back.backend, back.rank) == (
        g.user, g.klass, g.backend, g.rank) if g else False
    assert await store.queue.settle(M, back, 0.0)
    assert await store.replicas.dispatched(M, "x") is None


async def test_dispatch_returns_several_grants_up_to_the_gate(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    for i in range(3):
        await store.queue.enqueue(M, req(f"a{i}", "a"), 10)
        await store.queue.enqueue(M, req(f"b{i}", "b"), 10)
    grants, left = await store.queue.dispatch(M, "b1", {"default": 4}, "r1", 1000.0, 10.0,
                                        max_grants=10)
    assert [g.request_id for g in grants] == ["a0", "b0", "a1", "b1"]  # stops at the limit
    assert left == 2
    assert await store.queue.dispatch(M, "b1", {"default": 4}, "r1", 1000.0, 10.0,
                                max_grants=10) == ([], 2)
    await store.queue.mark_started(M, grants[0])  # running now: one gate slot frees
    again, left = await store.queue.dispatch(M, "b1", {"default": 4}, "r1", 1000.0, 10.0,
                                       max_grants=10)
    assert [g.request_id for g in again] == ["a2"] and left == 1


async def test_a_settle_before_any_start_frees_an_unseen_slot(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    for i in range(3):
        await store.queue.enqueue(M, req(f"a{i}", "a"), 10)
    g0 = await dispatch(store)
    g1 = await dispatch(store)
    assert g0 is not None and g1 is not None
    # a snapshot that sees neither: both are on their way
    await store.fleet.store_snapshot(M, "b1", BackendSnapshot(0, 0, 0.0, None, 1001.0))
    assert await redis.hget(K.backend_snapshot("b1"), "unseen") == "2"
    # g0 starts: it counts on as unseen until the next snapshot (a start seen after the
    # scrape may be one the scrape showed running: tests/test_pacing.py, late starts)
    await store.queue.mark_started(M, g0)
    assert await redis.hget(K.backend_snapshot("b1"), "unseen") == "2"
    # g1 ends without a first token: it is no longer on its way, nor in vLLM's queue
    await store.queue.settle(M, g1, 0.0)
    assert await redis.hget(K.backend_snapshot("b1"), "unseen") == "1"
    await store.queue.mark_started(M, g0)  # marked once only
    await store.queue.settle(M, g0, 0.0)  # it started: its settle takes no unseen
    assert await redis.hget(K.backend_snapshot("b1"), "unseen") == "1"
    await store.fleet.store_snapshot(M, "b1", BackendSnapshot(0, 0, 0.0, None, 1002.0))
    await store.queue.enqueue(M, req("b0", "b"), 10)
    await store.queue.enqueue(M, req("b1", "b"), 10)
    await redis.hset(K.backend_snapshot("b1"), "unseen", 1)
    g2 = await dispatch(store)  # dispatched after the snapshot: in sent, not unseen
    assert g2 is not None
    await store.queue.mark_started(M, g2)
    await store.queue.settle(M, g2, 0.0)
    assert await redis.hget(K.backend_snapshot("b1"), "unseen") == "1"  # untouched


async def test_a_drained_backend_gets_nothing_and_every_replica_learns_it(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.queue.enqueue(M, req("a0", "a"), 10)
    await store.fleet.set_drained(M, "b1", True)
    assert await dispatch(store) is None  # limits were open: the script refuses anyway
    snap = BackendSnapshot(0, 0, 0.0, None, 1000.0)
    assert (await store.fleet.store_snapshot(M, "b1", snap))[:3] == (True, True, 0)
    await store.fleet.set_drained(M, "b1", False)
    g = await dispatch(store)
    assert g is not None and g.request_id == "a0"


async def test_a_replica_late_to_its_grants_but_listening_is_alive(redis: aioredis.Redis) -> None:
    # overloaded, not dead: its listener still turns (late), its grants wait >2 s in line
    store = Store.over(redis, 600)
    await alive(store, "r1", "r2")
    await store.queue.enqueue(M, req("x1", "a", owner="r2"), 10)
    await store.queue.enqueue(M, req("x2", "a", owner="r2"), 10)
    assert (g := await dispatch(store)) is not None and g.request_id == "x1"
    await store.replicas.heartbeat([M], "r2", 1002.5, {M: 1002.0})  # turned 1 s ago
    await store.replicas.heartbeat([M], "r1", 1003.0)
    grants, _ = await store.queue.dispatch(M, "b1", ALL_OPEN, "r1", 1003.0, 10.0, max_grants=5)
    assert [g.request_id for g in grants] == ["x2"]  # still served
    assert await store.queue.reap(M, 1003.0, 10.0) == 0
    assert await store.reads.user_inflight(M) == {"a": 2}
    # its listener stops turning (wedged) while the heartbeat goes on: dead
    await store.replicas.heartbeat([M], "r2", 1013.0, {M: 1002.0})
    assert await store.queue.reap(M, 1013.0, 10.0) == 2
    assert await redis.hget(K.listened, "r2") is None


async def test_a_users_requests_with_deadlines_go_earliest_deadline_first(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    deadlines = {"a0": None, "a1": 1010.0, "a2": None, "a3": 1005.0, "a4": 1020.0, "a5": 1010.0}
    for rid, deadline in deadlines.items():
        await store.queue.enqueue(M, dataclasses.replace(req(rid, "a"), deadline_at=deadline), 10)
    # deadlines first, earliest first (equal deadlines in arrival order), then the rest FIFO
    assert await redis.lrange(K.queue("default", "a"), 0, -1) == [
        "a3", "a1", "a5", "a4", "a0", "a2"]
    order = []
    for _ in deadlines:
        g = await dispatch(store)
        assert g is not None
        order.append(g.request_id)
    assert order == ["a3", "a1", "a5", "a4", "a0", "a2"]


async def test_a_redis_restarted_between_loading_and_running_a_script(
        redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py reloads a script the server lacks once; a server whose script cache empties
    again before the rerun (restarted in between: seen in the Redis-kill chaos test, where
    the NoScriptError escaped a running stream's first-token call and hung its client)
    gets one more load, then a StoreUnavailable, never a NoScriptError."""
    store = Store.over(redis, 600)
    load = redis.script_load
    flushes = {"left": 1}

    async def load_then_restart(script: str) -> str:
        sha = await load(script)
        if flushes["left"]:
            flushes["left"] -= 1
            await redis.script_flush()  # the server's cache is empty again
        return str(sha)

    monkeypatch.setattr(redis, "script_load", load_then_restart)
    await redis.script_flush()
    assert await store.queue.enqueue(M, req("a1", "a"), max_queued=2) == 1
    assert flushes["left"] == 0  # the first reload was lost, the second one ran it
    flushes["left"] = 99
    await redis.script_flush()
    with pytest.raises(StoreUnavailable, match="not loaded"):
        await store.queue.enqueue(M, req("a2", "a"), max_queued=2)


async def test_a_grant_entry_without_its_charge_reads_as_the_whole_estimate(
        redis: aioredis.Redis) -> None:
    """A grant an older replica pushed (no ``charged`` field) is still delivered: its
    dispatch charged the whole estimate."""
    store = Store.over(redis, 600)
    await redis.rpush(K.grants("r2"), "x\tb1\t3\t1000.0")
    assert await store.replicas.next_order(M, "r2", 0.1) == ("x", "b1", 3, None)
