"""Differential spec of ``gateway/storage/lua/lib/fairness.lua`` (pick and charge, with the
locality slack at both levels, prompt ranges, the dispatch cost of the prompt tokens the
backend's prefix index predicts uncached) and of enqueue.lua's order (EDF within a user's
queue, the per-user cap, each level joined at its minimum) against their plain-data twin,
``policies/fairness.py`` TwoLevel, with sessions (the third level) on or off, all of it
as the product runs it: hypothesis draws a backend and a workload of enqueues,
dispatches, settles and cancels; the store's verbs run it on Redis (``enqueue.lua``,
``dispatch.lua`` with the dispatch decision ``dispatch_for`` of ``lua/lib/dispatch.lua``,
``settle.lua``, ``cancel.lua``), the twin in Python (``policies/dispatch.py`` Dispatch, the
decision's composition, over TwoLevel), and every decision and the final scores and
queues must agree. Here the gates stay open and one request goes per dispatch;
``tests/store/test_lua_dispatch_spec.py`` draws the rest of the decision (gates, several
grants, the prefill gate and its backfill, dead replicas, time passing)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import redis.asyncio as aioredis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.storage.dispatch_call import dispatch_args
from gateway.storage.keys import ModelKeys
from gateway.storage.records import (
    GRANT_PICKUP_S,
    BackendFit,
    Dispatched,
    Grant,
    Locality,
    QueuedRequest,
)
from gateway.storage.store import Store
from policies.dispatch import Affinity, BackendState, ClassTurn, Dispatch, Granted
from policies.fairness import TwoLevel
from policies.gates import Gate
from policies.locality import PrefixIndex
from policies.prefill import PromptRange
from policies.replicas import ReplicaSeen, alive

CLASS = "default"
BACKEND = "b1"
START = 1000.0  # the clock at the first step (s)
REPLICA_TTL_S = 10.0
INDEX_SIZE, INDEX_TTL_S = 100, 600.0

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
    "max_imbalance": st.integers(0, 3),
    "max_queued": st.integers(2, 6), "sessions": st.booleans(),
})
ENQUEUE = st.tuples(st.just("enqueue"), st.sampled_from(MEMBERS), quarters, quarters,
                   st.one_of(st.none(), st.integers(1, 4).map(float)), st.integers(0, 900),
                   chains, st.sampled_from(SESSIONS), credits, credits)
# a dispatch, after this many seconds passed (None: none)
DISPATCH_OP = st.tuples(st.just("dispatch"), st.sampled_from([None, None, 0.5, 3.0]))
OPS = st.one_of(ENQUEUE, DISPATCH_OP, DISPATCH_OP,
                st.tuples(st.just("settle"), st.integers(0, 50), quarters, quarters),
                st.tuples(st.just("cancel"), st.integers(0, 50)))
# a backlog first, then anything: most dispatches choose among several users
WORKLOADS = st.tuples(st.lists(ENQUEUE, min_size=2, max_size=16),
                      st.lists(OPS, max_size=30)).map(lambda w: w[0] + w[1])
models = itertools.count()


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
            await client.zadd(k.backend_prefixes(name), dict.fromkeys(index, START))
    for other, (_, load) in zip(others, backend["others"], strict=True):
        await client.set(k.backend_inflight(other), load)
    return others


def granted(done: Dispatched) -> list[tuple[Any, ...]]:
    """The grants of a decision as the store read them back from dispatch.lua."""
    return [(g.request_id, g.klass, g.user, g.rank, g.owner, g.charged_prompt,
             g.matched_blocks, g.prompt_blocks, g.reason) for g in done.grants]


def twin_granted(grants: list[Granted]) -> list[tuple[Any, ...]]:
    return [(g.request_id, g.klass, g.user, g.rank, g.owner, g.charged, g.held_blocks,
             g.blocks, g.reason) for g in grants]


class Twin:
    """The plain-data side of a run: the decision's composition over the engine, the
    backend's state, and what the store holds of each replica."""

    def __init__(self, backend: dict[str, Any]) -> None:
        self.engine = TwoLevel(by_session=backend["sessions"])
        self.model = Dispatch(engines={CLASS: self.engine})
        self.backend = BackendState(index=PrefixIndex(
            INDEX_SIZE, INDEX_TTL_S, dict.fromkeys(backend["index"], START)))
        self.beats = {"r1": START, "r2": START}
        self.oldest_grant: dict[str, float] = {}  # replica -> its unread grant's push time

    def alive(self, now: float) -> Any:
        def check(replica: str) -> bool:
            seen = ReplicaSeen(self.beats.get(replica), self.oldest_grant.get(replica))
            return alive(seen, now, REPLICA_TTL_S, GRANT_PICKUP_S)
        return check

    def decide(self, b: dict[str, Any], gate: Gate, now: float) -> list[Granted]:
        self.beats["r1"] = max(self.beats["r1"], now)  # the dispatching replica lives
        affinity = Affinity(b["slack"], b["compared"], b["lookahead"],
                            [(frozenset(index), load) for index, load in b["others"]],
                            b["max_imbalance"])
        grants = self.model.decide(
            self.backend, [ClassTurn(CLASS, gate, b.get("prefill_limit", 0))],
            b.get("want", 1), now, self.alive(now), PromptRange(b["min"], b["max"] or None),
            affinity, b.get("backfill_s", 0.0))
        for g in grants:
            if g.owner != "r1":  # pushed to its replica's grant list, never read here
                self.oldest_grant.setdefault(g.owner, float(f"{now:.6f}"))
        return grants


async def dispatch(store: Store, name: str, b: dict[str, Any], gate: Gate, now: float,
                   others: list[str]) -> Dispatched:
    """One decision for the backend, as the dispatcher asks for it (dispatch.lua)."""
    loc = Locality(slack=b["slack"], candidates=b["compared"], index_size=INDEX_SIZE,
                   index_ttl_s=INDEX_TTL_S, max_imbalance=b["max_imbalance"],
                   others=tuple(others), lookahead=b["lookahead"])
    fit = BackendFit(PromptRange(b["min"], b["max"] or None),
                     {CLASS: b.get("prefill_limit", 0)}, b.get("backfill_s", 0.0))
    [done] = await store.queue.dispatch_with(name, [dispatch_args(
        name, BACKEND, {CLASS: gate}, "r1", now, REPLICA_TTL_S, order=(CLASS,),
        max_grants=b.get("want", 1), locality=loc, fit=fit, sessions=b["sessions"])])
    return done


async def run(redis_url: str, backend: dict[str, Any], ops: list[tuple[Any, ...]]) -> None:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        await client.flushdb()
        name = f"spec{next(models)}"
        k = ModelKeys(name)
        store = Store.over(client, 600)
        await store.replicas.heartbeat([name], "r1", START)
        await store.replicas.heartbeat([name], "r2", START)
        others = await place_indexes(client, k, backend)
        twin = Twin(backend)
        gate = Gate(backend.get("limit", 10**6), None, backend.get("free_slots", 0),
                    backend.get("max_inflight", 0))
        now = START
        whose: dict[str, tuple[str, str | None]] = {}  # request -> (tenant, session)
        enqueued: list[tuple[str, str, str, str | None]] = []
        dispatched: list[Grant] = []  # granted, not settled
        started: set[str] = set()
        for step, op in enumerate(ops):
            where = f"step {step} {op} of {ops} on {backend}"
            if op[0] == "enqueue":
                _, (tenant, user), cost, tcost, deadline, ptok, chain, drawn, *rest = op
                credit, tcredit, owner = (*rest, *(0.0, 0.0, "r1")[len(rest):])
                session = drawn if backend["sessions"] else None
                rid = f"r{step}"
                queued = QueuedRequest(rid, user, CLASS, owner, cost, START, tuple(chain),
                                       tenant, tcost, deadline, ptok, session=session,
                                       credit=credit, tenant_credit=tcredit)
                got = await store.queue.enqueue(name, queued, backend["max_queued"])
                # a request without a chain is never predicted cached: no credit kept
                want = twin.engine.enqueue(tenant, user, cost, tcost, rid, deadline,
                                           backend["max_queued"], session, ptok,
                                           credit if chain else 0.0, tcredit if chain else 0.0)
                assert got == want, f"{where}: lua queue length {got}, policies {want}"
                if want > 0:
                    twin.model.tokens[rid] = ptok
                    twin.model.owners[rid] = owner
                    if chain:
                        twin.model.chains[rid] = chain
                    whose[rid] = (tenant, session)
                    enqueued.append((tenant, user, rid, session))
            elif op[0] == "dispatch":
                now += op[1] or 0.0
                done = await dispatch(store, name, backend, gate, now, others)
                want_grants = twin.decide(backend, gate, now)
                assert granted(done) == twin_granted(want_grants), (
                    f"{where}: lua granted {granted(done)}, "
                    f"policies {twin_granted(want_grants)}")
                assert done.depth == twin.model.depth(), (
                    f"{where}: lua left {done.depth} queued, policies {twin.model.depth()}")
                dispatched += done.grants
            elif op[0] == "start" and dispatched:
                grant = dispatched[op[1] % len(dispatched)]
                await store.queue.mark_started(name, grant, now)  # started.lua
                if grant.request_id not in started:
                    started.add(grant.request_id)
                    twin.backend.start(grant.request_id)
            elif op[0] == "settle" and dispatched:
                _, n, charge, tcharge = op
                grant = dispatched.pop(n % len(dispatched))
                released = await store.queue.settle(name, grant, charge, tcharge)
                assert released, f"{where}: the settle of {grant} released nothing"
                tenant, session = whose[grant.request_id]
                twin.engine.settle(tenant, grant.user, charge, tcharge, session)
                twin.backend.release(grant.request_id, grant.user)
            elif op[0] == "cancel" and enqueued:
                tenant, user, rid, session = enqueued[op[1] % len(enqueued)]
                got_cancel = await store.queue.cancel(name, rid, user, CLASS, tenant, session)
                want_cancel = twin.engine.cancel(tenant, user, rid, session)
                assert got_cancel == want_cancel, (
                    f"{where}: lua cancelled {got_cancel}, policies {want_cancel}")
        got_state, want_state = await state(client, k), twin_state(twin.engine)
        assert got_state == want_state, (
            f"after {ops} on {backend}: lua left {got_state}, policies {want_state}")
    finally:
        await client.aclose()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(BACKENDS, WORKLOADS)
@example(  # A idles, then a user it never had joins at the floor its last user left
    backend={"min": 0, "max": 0, "slack": 0.0, "compared": 1, "lookahead": 1, "index": set(),
             "others": [], "max_imbalance": 0, "max_queued": 2, "sessions": False},
    ops=[("enqueue", ("A", "a1"), 2.0, 1.0, None, 0, [], ""),
         ("enqueue", ("B", "b1"), 1.0, 1.0, None, 0, [], ""), ("dispatch", None),
         ("dispatch", None), ("enqueue", ("A", "a2"), 1.0, 1.0, None, 0, [], ""),
         ("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], ""), ("dispatch", None),
         ("dispatch", None)])
@example(  # one user's busy session and its one-at-a-time one take turns
    backend={"min": 0, "max": 0, "slack": 0.0, "compared": 1, "lookahead": 1, "index": set(),
             "others": [], "max_imbalance": 0, "max_queued": 6, "sessions": True},
    ops=[("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "s1"),
         ("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "s1"),
         ("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "s1"),
         ("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "s2"), ("dispatch", None),
         ("dispatch", None), ("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "s2"),
         ("dispatch", None), ("settle", 0, 2.0, 2.0), ("cancel", 1), ("dispatch", None)])
@example(  # a cached prompt is charged its uncached tokens, at both levels
    backend={"min": 0, "max": 0, "slack": 0.0, "compared": 1, "lookahead": 1,
             "index": {"h1", "h2"}, "others": [], "max_imbalance": 0,
             "max_queued": 4, "sessions": False},
    ops=[("enqueue", ("A", "a1"), 9.0, 8.0, None, 300, ["h1", "h2", "h3"], "", 0.25, 1.0),
         ("enqueue", ("B", "b1"), 1.0, 1.0, None, 200, ["h3"], "", 1.0, 0.25),
         ("dispatch", None), ("dispatch", None)])
def test_fairness_lua_decides_as_policies_fairness(
        redis_url: str, backend: dict[str, Any], ops: list[tuple[Any, ...]]) -> None:
    asyncio.run(run(redis_url, backend, ops))
