"""Differential spec of ``gateway/storage/lua/lib/fairness.lua`` (pick and charge, with the
locality slack at both levels, prompt ranges and a backfill's room, the dispatch cost of
the prompt tokens the backend's prefix index predicts uncached) and of enqueue.lua's
order (EDF within a user's queue, the per-user cap, each level joined at its minimum)
against their plain-data twin, ``policies/fairness.py`` TwoLevel, with sessions (the
third level) on or off: hypothesis draws a backend and a workload of enqueues,
dispatches, settles and cancels; the real scripts run it on Redis (enqueue.lua and
cancel.lua through the store, each dispatch one EVAL of the library module, each settle
the charge every release applies), the twin in Python, and every decision and the final
scores and queues must agree."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import redis.asyncio as aioredis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.storage.keys import ModelKeys
from gateway.storage.records import QueuedRequest
from gateway.storage.scripts import load_library
from gateway.storage.store import Store
from policies.fairness import Pick, TwoLevel
from policies.locality import LocalityView, matched
from policies.prefill import TOKENS_PER_BLOCK, Pool, PromptRange, uncached_tokens

CLASS = "default"
BACKEND = "b1"
# one dispatch as dispatch.lua makes it, less gates and grant: pick, take, charge
DISPATCH = """
local a = cjson.decode(ARGV[1])
local prefix, class = a.prefix, a.class
local pools = pools_for(prefix, a.range, a.block_tokens)
local locality = locality_for(prefix, a.backend, a.locality, a.load, a.now)
local fairness = fairness_for(prefix, pools, locality, a.sessions)
local tenant, user, id, held = fairness.pick(a.active, class, a.room)
if not tenant then return {} end
local session = fairness.session(class, tenant, user)
local queue = queue_of(prefix, class, tenant, user, session)
id = id or redis.call('LINDEX', queue, 0)
redis.call('LREM', queue, 1, id)
local f = request_get(key_request(prefix, id), 'cost', 'tcost', 'ptok', 'prefix', 'hit',
  'thit')
local cost = tonumber(f.cost) or 0
local tcost = tonumber(f.tcost) or cost
-- the prompt tokens the index predicts uncached, charged at their cost (dispatch.lua)
local ptok = tonumber(f.ptok) or 0
local tokens = ptok
if tokens > 0 then
  tokens = math.max(0, tokens - (held or locality.held_blocks(f.prefix)) * a.block_tokens)
end
cost = predicted_cost(cost, tonumber(f.hit) or 0, ptok, tokens)
tcost = predicted_cost(tcost, tonumber(f.thit) or 0, ptok, tokens)
fairness.charge(class, tenant, user, session, queue, a.active, a.saved, cost, tcost)
return {tenant, user, id, held or -1, tokens, session or cjson.null}
"""
# a settle's charges (settle.lua; _lib.lua charge): to each level, active or saved
SETTLE = """
local a = cjson.decode(ARGV[1])
charge(key_users(a.prefix, a.class, a.tenant), key_user_saved(a.prefix, a.class, a.tenant),
  a.user, a.charge)
charge(a.active, a.saved, a.tenant, a.tcharge)
if a.session and redis.call('ZSCORE', key_users(a.prefix, a.class, a.tenant), a.user) then
  charge(key_sessions(a.prefix, a.class, a.tenant, a.user),
    key_session_saved(a.prefix, a.class, a.tenant, a.user), a.session, a.charge)
end
return 1
"""

MEMBERS = [("A", "a1"), ("A", "a2"), ("A", "a3"), ("B", "b1"), ("B", "b2"), ("C", "c1")]
SESSIONS = ["", "s1", "s2"]  # "": the user's default session
HASHES = ["h1", "h2", "h3", "h4"]
quarters = st.integers(0, 40).map(lambda n: n / 4)  # exact in Redis and Python alike
credits = st.sampled_from([0.0, 0.0, 0.25, 1.0])  # per prompt token predicted cached
chains = st.lists(st.sampled_from(HASHES), max_size=3, unique=True)

BACKENDS = st.fixed_dictionaries({
    "min": st.sampled_from([0, 0, 100, 300]), "max": st.sampled_from([0, 0, 400, 800]),
    "slack": st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.5, 5.0, 100.0]),
    "compared": st.integers(1, 6), "lookahead": st.integers(1, 4),
    "index": st.sets(st.sampled_from(HASHES)),
    "others": st.lists(st.tuples(st.sets(st.sampled_from(HASHES)), st.integers(0, 4)),
                       max_size=2),
    "load": st.integers(0, 4), "max_imbalance": st.integers(0, 3),
    "max_queued": st.integers(2, 6), "sessions": st.booleans(),
})
ENQUEUE = st.tuples(st.just("enqueue"), st.sampled_from(MEMBERS), quarters, quarters,
                   st.one_of(st.none(), st.integers(1, 4).map(float)), st.integers(0, 900),
                   chains, st.sampled_from(SESSIONS), credits, credits)
DISPATCH_OP = st.tuples(st.just("dispatch"),
                        st.one_of(st.none(), st.none(), st.integers(-50, 600)))
OPS = st.one_of(ENQUEUE, DISPATCH_OP, DISPATCH_OP,
                st.tuples(st.just("settle"), st.integers(0, 50), quarters, quarters),
                st.tuples(st.just("cancel"), st.integers(0, 50)))
# a backlog first, then anything: most dispatches choose among several users
WORKLOADS = st.tuples(st.lists(ENQUEUE, min_size=2, max_size=16),
                      st.lists(OPS, max_size=30)).map(lambda w: w[0] + w[1])
models = itertools.count()


def twin_backend(b: dict[str, Any], tokens: dict[str, int],
                 chain_of: dict[str, list[str]]) -> tuple[Pool, LocalityView]:
    pool = Pool(PromptRange(b["min"], b["max"] or None), tokens, TOKENS_PER_BLOCK)
    view = LocalityView(b["slack"], b["compared"], b["lookahead"], b["index"], chain_of,
                        [(index, load) for index, load in b["others"]], b["load"],
                        b["max_imbalance"])
    return pool, view


async def state(client: aioredis.Redis, k: ModelKeys) -> dict[str, Any]:
    """Scores, saved scores, floors and queues as the scripts left them."""
    tenants = {t for t, _ in MEMBERS}
    out: dict[str, Any] = {
        "tenants": dict(await client.zrange(k.active(CLASS), 0, -1, withscores=True)),
        "saved_tenants": {t: float(s) for t, s in (await client.hgetall(k.saved(CLASS))).items()},
        "floors": {t: float(s) for t, s in (await client.hgetall(k.user_floor(CLASS))).items()},
        "users": {}, "saved_users": {}, "queues": {}, "sessions": {}, "saved_sessions": {},
        "queued": {},
    }
    for t in sorted(tenants):
        users = dict(await client.zrange(k.users(CLASS, t), 0, -1, withscores=True))
        saved = {u: float(s) for u, s in (await client.hgetall(k.user_saved(CLASS, t))).items()}
        if users:
            out["users"][t] = users
        if saved:
            out["saved_users"][t] = saved
    for t, u in MEMBERS:
        queue = await client.lrange(k.queue(CLASS, u, t), 0, -1)
        if queue:
            out["queues"][f"{t}/{u}"] = queue
        for session in SESSIONS[1:]:
            queue = await client.lrange(k.queue(CLASS, u, t, session), 0, -1)
            if queue:
                out["queues"][f"{t}/{u}/{session}"] = queue
        active = dict(await client.zrange(k.sessions(CLASS, t, u), 0, -1, withscores=True))
        saved = {s: float(v)
                 for s, v in (await client.hgetall(k.session_saved(CLASS, t, u))).items()}
        queued = await client.get(k.user_queued(CLASS, t, u))
        if active:
            out["sessions"][f"{t}/{u}"] = active
        if saved:
            out["saved_sessions"][f"{t}/{u}"] = saved
        if queued is not None:
            out["queued"][f"{t}/{u}"] = int(queued)
    return out


def twin_state(model: TwoLevel) -> dict[str, Any]:
    return {
        "tenants": model.tenants, "saved_tenants": model.saved_tenants,
        "floors": model.floors,
        "users": {t: u for t, u in model.users.items() if u},
        "saved_users": {t: u for t, u in model.saved_users.items() if u},
        "queues": {**{f"{t}/{u}": [q.request_id for q in queue]
                      for (t, u), queue in model.queues.items() if queue},
                   **{f"{t}/{u}/{s}": [q.request_id for q in queue]
                      for (t, u, s), queue in model.session_queues.items() if queue}},
        "sessions": {f"{t}/{u}": v for (t, u), v in model.sessions.items() if v},
        "saved_sessions": {f"{t}/{u}": v for (t, u), v in model.saved_sessions.items() if v},
        "queued": {f"{t}/{u}": n for (t, u), n in model.queued.items()},
    }


async def place_indexes(client: aioredis.Redis, k: ModelKeys,
                        backend: dict[str, Any]) -> list[str]:
    """The backend's prefix index and the other backends' (with their loads) in Redis."""
    others = [f"o{i}" for i in range(len(backend["others"]))]
    for name, index in [(BACKEND, backend["index"]),
                        *((o, i) for o, (i, _) in zip(others, backend["others"], strict=True))]:
        if index:
            await client.zadd(k.backend_prefixes(name), dict.fromkeys(index, 1.0))
    for other, (_, load) in zip(others, backend["others"], strict=True):
        await client.set(k.backend_inflight(other), load)
    return others


async def run(redis_url: str, backend: dict[str, Any], ops: list[tuple[Any, ...]]) -> None:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        await client.flushdb()
        name = f"spec{next(models)}"
        k = ModelKeys(name)
        store = Store.over(client, 600)
        await store.replicas.heartbeat([name], "r1", 1000.0)
        others = await place_indexes(client, k, backend)
        dispatch = client.register_script(load_library() + DISPATCH)
        settle = client.register_script(load_library() + SETTLE)
        common = {"prefix": k.prefix, "class": CLASS, "active": k.active(CLASS),
                  "saved": k.saved(CLASS)}
        model = TwoLevel(by_session=backend["sessions"])
        tokens: dict[str, int] = {}
        chain_of: dict[str, list[str]] = {}
        enqueued: list[tuple[str, str, str, str | None]] = []
        dispatched: list[Pick] = []
        for step, op in enumerate(ops):
            where = f"step {step} {op} of {ops} on {backend}"
            if op[0] == "enqueue":
                _, (tenant, user), cost, tcost, deadline, ptok, chain, drawn, *credit = op
                credit, tcredit = credit or (0.0, 0.0)
                session = drawn if backend["sessions"] else None
                rid = f"r{step}"
                queued = QueuedRequest(rid, user, CLASS, "r1", cost, 1000.0, tuple(chain),
                                       tenant, tcost, deadline, ptok, session=session,
                                       credit=credit, tenant_credit=tcredit)
                got = await store.queue.enqueue(name, queued, backend["max_queued"])
                # a request without a chain is never predicted cached: no credit kept
                want = model.enqueue(tenant, user, cost, tcost, rid, deadline,
                                     backend["max_queued"], session, ptok,
                                     credit if chain else 0.0, tcredit if chain else 0.0)
                assert got == want, f"{where}: lua queue length {got}, policies {want}"
                if want > 0:
                    tokens[rid] = ptok
                    if chain:
                        chain_of[rid] = chain
                    enqueued.append((tenant, user, rid, session))
            elif op[0] == "dispatch":
                room = op[1]
                args = {**common, "backend": BACKEND, "load": backend["load"], "now": 1000.0,
                        "block_tokens": TOKENS_PER_BLOCK,
                        "range": {"min": backend["min"], "max": backend["max"]},
                        "locality": {"slack": backend["slack"], "candidates": backend["compared"],
                                     "lookahead": backend["lookahead"], "index_size": 100,
                                     "index_ttl_s": 600, "max_imbalance": backend["max_imbalance"],
                                     "others": others}}
                if backend["sessions"]:
                    args["sessions"] = True
                if room is not None:
                    args["room"] = room
                found = await dispatch(args=[json.dumps(args)])
                pick = model.pick(*twin_backend(backend, tokens, chain_of), room)
                want_pick = None if pick is None else [
                    pick.tenant, pick.user, pick.request_id,
                    -1 if pick.held_blocks is None else pick.held_blocks, pick.session]
                got_pick = [*found[:3], int(found[3]), found[5] if len(found) > 5 else None
                            ] if found else None
                assert got_pick == want_pick, (
                    f"{where}: lua picked {got_pick}, policies {want_pick}")
                if pick is not None:
                    held = matched(chain_of.get(pick.request_id, ()), backend["index"])
                    uncached = uncached_tokens(tokens[pick.request_id], held)
                    assert int(found[4]) == uncached, (
                        f"{where}: lua charged {found[4]} prompt tokens, policies {uncached}")
                    model.serve(pick, uncached)
                    dispatched.append(pick)
            elif op[0] == "settle" and dispatched:
                _, n, charge, tcharge = op
                done = dispatched[n % len(dispatched)]
                await settle(args=[json.dumps({**common, "tenant": done.tenant,
                                               "user": done.user, "charge": charge,
                                               "tcharge": tcharge,
                                               **({} if done.session is None
                                                  else {"session": done.session})})])
                model.settle(done.tenant, done.user, charge, tcharge, done.session)
            elif op[0] == "cancel" and enqueued:
                tenant, user, rid, session = enqueued[op[1] % len(enqueued)]
                got_cancel = await store.queue.cancel(name, rid, user, CLASS, tenant, session)
                want_cancel = model.cancel(tenant, user, rid, session)
                assert got_cancel == want_cancel, (
                    f"{where}: lua cancelled {got_cancel}, policies {want_cancel}")
        got_state, want_state = await state(client, k), twin_state(model)
        assert got_state == want_state, (
            f"after {ops} on {backend}: lua left {got_state}, policies {want_state}")
    finally:
        await client.aclose()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(BACKENDS, WORKLOADS)
@example(  # A idles, then a user it never had joins at the floor its last user left
    backend={"min": 0, "max": 0, "slack": 0.0, "compared": 1, "lookahead": 1, "index": set(),
             "others": [], "load": 0, "max_imbalance": 0, "max_queued": 2, "sessions": False},
    ops=[("enqueue", ("A", "a1"), 2.0, 1.0, None, 0, [], ""),
         ("enqueue", ("B", "b1"), 1.0, 1.0, None, 0, [], ""), ("dispatch", None),
         ("dispatch", None), ("enqueue", ("A", "a2"), 1.0, 1.0, None, 0, [], ""),
         ("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], ""), ("dispatch", None),
         ("dispatch", None)])
@example(  # one user's busy session and its one-at-a-time one take turns
    backend={"min": 0, "max": 0, "slack": 0.0, "compared": 1, "lookahead": 1, "index": set(),
             "others": [], "load": 0, "max_imbalance": 0, "max_queued": 6, "sessions": True},
    ops=[("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "s1"),
         ("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "s1"),
         ("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "s1"),
         ("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "s2"), ("dispatch", None),
         ("dispatch", None), ("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "s2"),
         ("dispatch", None), ("settle", 0, 2.0, 2.0), ("cancel", 1), ("dispatch", None)])
@example(  # a cached prompt is charged its uncached tokens, at both levels
    backend={"min": 0, "max": 0, "slack": 0.0, "compared": 1, "lookahead": 1,
             "index": {"h1", "h2"}, "others": [], "load": 0, "max_imbalance": 0,
             "max_queued": 4, "sessions": False},
    ops=[("enqueue", ("A", "a1"), 9.0, 8.0, None, 300, ["h1", "h2", "h3"], "", 0.25, 1.0),
         ("enqueue", ("B", "b1"), 1.0, 1.0, None, 200, ["h3"], "", 1.0, 0.25),
         ("dispatch", None), ("dispatch", None)])
def test_fairness_lua_decides_as_policies_fairness(
        redis_url: str, backend: dict[str, Any], ops: list[tuple[Any, ...]]) -> None:
    asyncio.run(run(redis_url, backend, ops))
