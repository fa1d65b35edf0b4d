"""The preemption scripts (lua/preempt_view.lua, lua/preempt.lua) against a real Redis."""

from __future__ import annotations

import dataclasses
from typing import Any

import redis.asyncio as aioredis

from gateway.storage.records import Grant, Preempt
from gateway.storage.store import Store
from gateway.storage.values import continuation_id
from tests.store.test_scripts import ALL_OPEN, K, M, alive, req


async def order_preemption(store: Store, *args: Any) -> bool:
    """``PreemptStore.order_preemption``."""
    return await store.preempts.order_preemption(*args)


async def running(store: Store, redis: aioredis.Redis, rid: str, user: str, klass: str,
                  owner: str = "r1", started: bool = True) -> Grant:
    await store.queue.enqueue(M, req(rid, user, klass, owner=owner), 10)
    grants, _ = await store.queue.dispatch(M, "b1", ALL_OPEN, "r1", 1000.0, 10.0)
    assert [g.request_id for g in grants] == [rid], grants
    if owner != "r1":  # its grant went to the owner's list
        assert await store.replicas.next_order(M, owner, 0.1) == (rid, "b1", grants[0].rank, 0)
    if started:
        await store.queue.mark_started(M, grants[0], 1000.5)
    return grants[0]


async def test_the_view_holds_the_next_queued_and_every_dispatched_request(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1", "r2")
    await running(store, redis, "b-1", "bert", "batch", owner="r2")
    await running(store, redis, "i-1", "ann", "interactive", started=False)
    await store.queue.enqueue(M, req("i-2", "bob", "interactive", at=999.0), 10)
    view = await store.preempts.preemption_view(M, ["interactive", "default", "batch"], 0.0)
    assert [(q["class"], q["user"], q["enqueued_at"]) for q in view.queued] == [
        ("interactive", "bob", 999.0)], view
    by_id = {r["id"]: r for r in view.inflight}
    assert set(by_id) == {"b-1", "i-1"}, view
    assert by_id["b-1"]["started"] and not by_id["i-1"]["started"], view
    assert by_id["b-1"]["backend"] == "b1" and by_id["b-1"]["class"] == "batch", view
    assert by_id["b-1"]["score"] > 0, view  # its user's fairness score, charged at dispatch
    # a dead replica's requests are left out (the heartbeat bound)
    assert (await store.preempts.preemption_view(M, ["batch"], 1000.5)).inflight == []


async def test_one_order_per_backend_until_a_later_snapshot_and_the_cap(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1", "r2")
    await running(store, redis, "b-1", "bert", "batch", owner="r2")
    await running(store, redis, "b-2", "bert", "batch", owner="r2")
    order = Preempt("b-1", "b-1", "b1")
    assert await order_preemption(store, M, order, 1001.0, 2, 0.1, 5.0)
    assert await store.replicas.next_order(M, "r2", 0.1) == order
    # the backend is held: no second order before a snapshot taken 0.1 s after it
    second = Preempt("b-2", "b-2", "b1")
    assert not await order_preemption(store, M, second, 1001.05, 2, 0.1, 5.0)
    await redis.hset(K.backend_snapshot("b1"), "taken_at", 1001.2)
    assert await order_preemption(store, M, second, 1001.3, 2, 0.1, 5.0)
    # the cap counts on the original's hash, whichever segment is ordered
    await redis.hset(K.backend_snapshot("b1"), "taken_at", 1002.0)
    await running(store, redis, continuation_id("b-1", 1), "bert", "batch", owner="r2")
    cont = Preempt(continuation_id("b-1", 1), "b-1", "b1")
    assert await order_preemption(store, M, cont, 1001.5, 2, 0.1, 5.0)
    await redis.hset(K.backend_snapshot("b1"), "taken_at", 1003.0)
    assert not await order_preemption(store, M, cont, 1003.5, 2, 0.1, 5.0), "past the cap"
    assert await redis.hget(K.request("b-1"), "preempted") == "2"


async def test_a_refusal_marks_the_segment_and_lifts_the_hold(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await running(store, redis, "b-1", "bert", "batch")
    await running(store, redis, "b-2", "bert", "batch")
    order = Preempt("b-1", "b-1", "b1")
    assert await order_preemption(store, M, order, 1001.0, 2, 0.1, 5.0)
    await store.preempts.preempt_refused(M, order)
    assert await redis.hget(K.request("b-1"), "unmovable") == "1"
    assert await redis.hget(K.request("b-1"), "preempted") == "0"
    assert not await order_preemption(store, M, order, 1001.1, 2, 0.1, 5.0)  # unmovable
    assert await order_preemption(store, M, Preempt("b-2", "b-2", "b1"), 1001.1, 2, 0.1, 5.0)
    view = await store.preempts.preemption_view(M, ["batch"], 0.0)
    assert {r["id"]: r["unmovable"] for r in view.inflight} == {"b-1": True, "b-2": False}


async def test_an_order_needs_a_streaming_request_on_that_backend(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await running(store, redis, "w-1", "bert", "batch", started=False)
    assert not await order_preemption(store, M, Preempt("w-1", "w-1", "b1"), 1001.0, 2, 0.1, 5.0)
    await running(store, redis, "b-1", "bert", "batch")
    assert not await order_preemption(store, M, Preempt("b-1", "b-1", "b2"), 1001.0, 2, 0.1, 5.0)
    assert not await order_preemption(store, M, Preempt("gone", "gone", "b1"), 1001.0, 2, 0.1,
                                            5.0)


async def test_a_whole_answer_runs_once_dispatched(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    line = dataclasses.replace(req("line-1", "bert", "batch"), whole=True)
    await store.queue.enqueue(M, line, 10)
    grants, _ = await store.queue.dispatch(M, "b1", ALL_OPEN, "r1", 1000.0, 10.0)
    assert [g.request_id for g in grants] == ["line-1"]
    view = await store.preempts.preemption_view(M, ["batch"], 0.0)
    assert [(r["id"], r["started"]) for r in view.inflight] == [("line-1", True)], view
    assert await order_preemption(store, M, Preempt("line-1", "line-1", "b1"), 1001.0, 2, 0.1,
                                        5.0)


async def test_a_refusal_for_the_grace_lifts_the_hold_but_keeps_it_movable(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await running(store, redis, "b-1", "bert", "batch")
    order = Preempt("b-1", "b-1", "b1")
    assert await order_preemption(store, M, order, 1001.0, 2, 0.1, 5.0)
    await store.preempts.preempt_refused(M, order, grace=True)
    assert await redis.hget(K.request("b-1"), "unmovable") is None
    assert await redis.hget(K.request("b-1"), "preempted") == "0"
    # the hold is lifted and the stream may be ordered again (once past its grace)
    assert await order_preemption(store, M, order, 1001.1, 2, 0.1, 5.0)


async def test_the_view_holds_each_tenants_next_request_with_tenant_and_prompt(
        redis: aioredis.Redis) -> None:
    """Of a backlogged class, the next request of each of its first tenants (each user its
    own tenant here), not only the one its next dispatch takes; the dispatched requests
    carry their tenant and estimated prompt tokens."""
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await running(store, redis, "i-0", "hank", "interactive")
    await redis.hset(K.request("i-0"), "ptok", 42)  # as an enqueue with an estimate sets it
    await store.queue.enqueue(M, req("i-1", "hank", "interactive", at=999.0), 10)
    await store.queue.enqueue(M, req("i-2", "nina", "interactive", at=999.5), 10)
    view = await store.preempts.preemption_view(M, ["interactive"], 0.0, tenants=16)
    assert sorted((q["user"], q["tenant"], q["enqueued_at"]) for q in view.queued) == [
        ("hank", "hank", 999.0), ("nina", "nina", 999.5)], view
    only = await store.preempts.preemption_view(M, ["interactive"], 0.0)
    assert len(only.queued) == 1, only  # one tenant asked: the dispatch's next
    [r] = view.inflight
    assert r["tenant"] == "hank" and r["ptok"] == 42, r
