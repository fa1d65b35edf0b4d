"""Differential spec of fleet scope (``spread`` in ``gateway/storage/lua/_lib.lua``, run by
``dispatch_for`` and ``settle.lua``) against its plain-data twin, ``policies/fleet.py``
Fleet: hypothesis draws a workload of enqueues, dispatches and settles over two models;
a store built with both models as its fleet runs it on Redis through its real verbs
(enqueue, dispatch, settle), the twin in Python, and every decision and each model's final
scores, saved scores and queues must agree. A store without a fleet (model scope) leaves
each model's scores to its own service."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import redis.asyncio as aioredis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.storage.keys import ModelKeys
from gateway.storage.records import Grant, QueuedRequest
from gateway.storage.store import Store
from policies.fleet import Fleet
from tests.store.test_lua_fairness_spec import CLASS, MEMBERS, quarters, state, twin_state

OPEN = {"interactive": 10**9, "default": 10**9, "batch": 10**9}
names = itertools.count()

MODEL_IDS = st.sampled_from([0, 1])
ENQUEUE = st.tuples(st.just("enqueue"), MODEL_IDS, st.sampled_from(MEMBERS), quarters,
                    quarters)
OPS = st.one_of(ENQUEUE, st.tuples(st.just("dispatch"), MODEL_IDS),
                st.tuples(st.just("dispatch"), MODEL_IDS),
                st.tuples(st.just("settle"), st.integers(0, 50), quarters, quarters))
WORKLOADS = st.tuples(st.lists(ENQUEUE, min_size=2, max_size=12),
                      st.lists(OPS, max_size=30)).map(lambda w: w[0] + w[1])


async def run(redis_url: str, ops: list[tuple[Any, ...]]) -> None:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        await client.flushdb()
        n = next(names)
        models = [f"fleet{n}a", f"fleet{n}b"]
        store = Store.over(client, 600, fleet=models)
        await store.replicas.heartbeat(models, "r1", 1000.0)
        twin = Fleet()
        for m in models:
            twin.engine(m)
        whose: dict[str, tuple[str, str]] = {}
        dispatched: list[tuple[str, Grant]] = []
        for step, op in enumerate(ops):
            where = f"step {step} {op} of {ops}"
            if op[0] == "enqueue":
                _, i, (tenant, user), cost, tcost = op
                rid = f"r{step}"
                got = await store.queue.enqueue(models[i], QueuedRequest(
                    rid, user, CLASS, "r1", cost, 1000.0, (), tenant, tcost), 10**6)
                want = twin.enqueue(models[i], tenant, user, cost, tcost, rid)
                assert got == want, f"{where}: lua queue length {got}, policies {want}"
                whose[rid] = (tenant, user)
            elif op[0] == "dispatch":
                model = models[op[1]]
                grants, _ = await store.queue.dispatch(model, "b1", OPEN, "r1", 1000.0, 10.0)
                got_pick = whose[grants[0].request_id] if grants else None
                want_pick = twin.dispatch(model)
                assert got_pick == want_pick, (
                    f"{where}: lua served {got_pick}, policies {want_pick}")
                dispatched += [(model, g) for g in grants]
            elif op[0] == "settle" and dispatched:
                _, k, charge, tcharge = op
                model, grant = dispatched.pop(k % len(dispatched))
                await store.queue.settle(model, grant, charge, tcharge)
                twin.settle(model, *whose[grant.request_id], charge, tcharge)
        for m in models:
            got_state, want_state = await state(client, ModelKeys(m)), twin_state(
                twin.engines[m])
            assert got_state == want_state, (
                f"after {ops}, model {m}: lua left {got_state}, policies {want_state}")
    finally:
        await client.aclose()


@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(WORKLOADS)
@example(  # A on both models, B on the second: A's service on the first counts there
    ops=[("enqueue", 0, ("A", "a1"), 4.0, 4.0), ("enqueue", 1, ("A", "a1"), 1.0, 1.0),
         ("enqueue", 1, ("A", "a1"), 1.0, 1.0), ("enqueue", 1, ("B", "b1"), 1.0, 1.0),
         ("enqueue", 1, ("B", "b1"), 1.0, 1.0), ("dispatch", 0), ("dispatch", 1),
         ("dispatch", 1), ("settle", 0, 2.0, 2.0), ("dispatch", 1)])
def test_fleet_spread_lua_decides_as_policies_fleet(redis_url: str,
                                                    ops: list[tuple[Any, ...]]) -> None:
    asyncio.run(run(redis_url, ops))


async def test_a_charge_counts_on_every_model_only_in_fleet_scope(
        redis: aioredis.Redis) -> None:
    """A served 8 on model x; on model y, where A and B wait, A's score rose by those 8
    in fleet scope (B goes first), not per model (A goes first, by name)."""
    for fleet, first in ((("x", "y"), "b1"), ((), "a1")):
        await redis.flushdb()
        store = Store.over(redis, 600, fleet=fleet)
        await store.replicas.heartbeat(["x", "y"], "r1", 1000.0)
        for model, tenant, user, rid in (("y", "A", "a1", "y1"), ("y", "B", "b1", "y2"),
                                         ("x", "A", "a1", "x1")):
            await store.queue.enqueue(model, QueuedRequest(rid, user, CLASS, "r1", 1.0, 1000.0,
                                                     (), tenant, 1.0), 100)
        (grant,), _ = await store.queue.dispatch("x", "b1", OPEN, "r1", 1000.0, 10.0)
        await store.queue.settle("x", grant, 7.0, 7.0)
        y = ModelKeys("y")
        scores = dict(await redis.zrange(y.active(CLASS), 0, -1, withscores=True))
        (served,), _ = await store.queue.dispatch("y", "b1", OPEN, "r1", 1000.0, 10.0)
        assert served.user == first, (fleet, served.user, scores)
        assert scores == ({"A": 8.0, "B": 0.0} if fleet else {"A": 0.0, "B": 0.0}), (
            fleet, scores)
