"""Fairness conformance: every policy in ``policies/fairness.py`` passes this suite, run on
the real Redis scripts (the generic virtual-time engine) over many decisions.

A new policy is one class plus one name in ``POLICIES``; this suite then checks that
- two continuously backlogged users' weighted service stays within the policy's own
  stated bound (VTC, Sheng et al., OSDI 2024: 2·U, plus the output of the requests in
  flight, which is charged only when they settle), with different prompt sizes and weights;
- a user idle while another was served cannot bank credit: when it returns it gets its
  fair share from then on, not a burst that makes up for the time away;
- with tenants, the same at both levels (backlogged tenants in tenant-weighted service,
  whatever their numbers of users; the users of one tenant in user-weighted service; no
  credit banked by an idle tenant, nor by an idle user within its tenant), the scripts
  follow the plain-data model of policies/fairness.py, and locality bends both levels
  only within its slack.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.records import Grant, Locality, QueuedRequest
from gateway.storage.store import Store
from policies.fairness import (
    POLICIES,
    FairnessPolicy,
    RoundRobin,
    TwoLevel,
    Vtc,
    charged_prompt,
    level_bounds,
    policy_for,
    with_locality,
)
from policies.locality import within_slack
from policies.prefill import TOKENS_PER_BLOCK

M = "m"
K = ModelKeys(M)
OPEN = {"interactive": 10**9, "default": 10**9, "batch": 10**9}
OUTPUT = 100
IN_FLIGHT = 4


class Bench:
    """Dispatch and settle on a real Redis, as the gateway does, with fixed output."""

    def __init__(self, store: Store, policy: FairnessPolicy, prompts: dict[str, int],
                 weights: dict[str, float]) -> None:
        self.store, self.policy = store, policy
        self.prompts, self.weights = prompts, weights
        self.served = dict.fromkeys(prompts, 0.0)
        self.inflight: deque[Grant] = deque()
        self.ids = 0

    async def enqueue(self, user: str, count: int) -> None:
        for _ in range(count):
            self.ids += 1
            cost = self.policy.dispatch_cost(self.prompts[user], self.weights[user])
            await self.store.queue.enqueue(M, QueuedRequest(f"{user}-{self.ids}", user, "default",
                                                      "r1", cost, 1000.0), 10**6)

    async def step(self) -> Grant:
        (grant,), _ = await self.store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0)
        prompt, weight = self.prompts[grant.user], self.weights[grant.user]
        self.served[grant.user] += self.policy.service(prompt, OUTPUT, weight)
        self.inflight.append(grant)
        if len(self.inflight) >= IN_FLIGHT:
            await self.settle_one()
        return grant

    async def settle_one(self) -> None:
        old = self.inflight.popleft()
        prompt, weight = self.prompts[old.user], self.weights[old.user]
        await self.store.queue.settle(M, old, self.policy.settle_charge(prompt, prompt, OUTPUT,
                                                                  weight))

    def bound(self) -> float:
        users = list(self.prompts)
        largest = max(self.policy.service(self.prompts[u], OUTPUT, self.weights[u])
                      for u in users)
        unsettled = max(self.policy.service(self.prompts[u], OUTPUT, self.weights[u])
                        - self.policy.dispatch_cost(self.prompts[u], self.weights[u])
                        for u in users)
        return self.policy.bound(largest, IN_FLIGHT, unsettled)


async def bench(redis: aioredis.Redis, name: str, prompts: dict[str, int],
                weights: dict[str, float]) -> Bench:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    return Bench(store, policy_for(name), prompts, weights)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize(("prompts", "weights"), [
    ({"a": 100, "b": 100}, {"a": 1.0, "b": 1.0}),
    ({"a": 400, "b": 100}, {"a": 1.0, "b": 1.0}),
    ({"a": 100, "b": 300}, {"a": 2.0, "b": 1.0}),
])
async def test_backlogged_users_stay_within_the_policy_bound(
        redis: aioredis.Redis, name: str, prompts: dict[str, int],
        weights: dict[str, float]) -> None:
    b = await bench(redis, name, prompts, weights)
    for user in prompts:
        await b.enqueue(user, 200)
    worst = 0.0
    for _ in range(200):  # both stay backlogged throughout
        await b.step()
        worst = max(worst, abs(b.served["a"] - b.served["b"]))
    assert worst <= b.bound(), (b.served, worst, b.bound())


@pytest.mark.parametrize("name", POLICIES)
async def test_an_idle_user_cannot_bank_credit(redis: aioredis.Redis, name: str) -> None:
    b = await bench(redis, name, {"busy": 100, "idle": 100}, {"busy": 1.0, "idle": 1.0})
    await b.enqueue("busy", 400)
    for _ in range(150):  # "idle" sends nothing meanwhile
        await b.step()
    before = dict(b.served)
    await b.enqueue("idle", 200)
    for _ in range(100):
        await b.step()
    gained = {u: b.served[u] - before[u] for u in b.served}
    # from its return on, the returning user gets its fair half, not the 150 it "missed"
    assert abs(gained["idle"] - gained["busy"]) <= b.bound(), gained


async def test_vtc_equalises_tokens_where_round_robin_equalises_requests(
        redis: aioredis.Redis) -> None:
    prompts, weights = {"a": 400, "b": 100}, {"a": 1.0, "b": 1.0}
    tokens = Vtc()
    served: dict[str, dict[str, float]] = {}
    for name in ("vtc", "round_robin"):
        await redis.flushdb()
        b = await bench(redis, name, prompts, weights)
        for user in prompts:
            await b.enqueue(user, 100)
        counts = dict.fromkeys(prompts, 0.0)
        for _ in range(100):
            grant = await b.step()
            counts[grant.user] += tokens.service(prompts[grant.user], OUTPUT, 1.0)
        served[name] = counts
    token_bound = Vtc().bound(400 + 2 * OUTPUT, IN_FLIGHT, 2 * OUTPUT)
    assert abs(served["vtc"]["a"] - served["vtc"]["b"]) <= token_bound, served
    # round robin serves equal request counts, so the long-prompt user gets more tokens
    assert served["round_robin"]["a"] - served["round_robin"]["b"] > token_bound, served
    assert isinstance(policy_for("round_robin"), RoundRobin)


# --- hierarchical fair share: tenants, then users within a tenant -----------------------

class TenantBench:
    """Dispatch and settle on a real Redis with tenants: each user belongs to one tenant
    and is charged at its key weight, its tenant at the tenant's weight."""

    def __init__(self, store: Store, policy: FairnessPolicy,
                 users: dict[str, tuple[str, int, float]], tenants: dict[str, float]) -> None:
        self.store, self.policy = store, policy
        self.users, self.tenants = users, tenants  # user -> (tenant, prompt, weight)
        self.user_served = dict.fromkeys(users, 0.0)  # user-weighted service
        self.tenant_served = dict.fromkeys(tenants, 0.0)  # tenant-weighted service
        self.inflight: deque[Grant] = deque()
        self.ids = 0

    async def enqueue(self, user: str, count: int, chain: tuple[str, ...] = ()) -> None:
        tenant, prompt, weight = self.users[user]
        for _ in range(count):
            self.ids += 1
            await self.store.queue.enqueue(M, QueuedRequest(
                f"{user}-{self.ids}", user, "default", "r1",
                self.policy.dispatch_cost(prompt, weight), 1000.0,
                chain or (f"{user}-{self.ids}",), tenant,
                self.policy.dispatch_cost(prompt, self.tenants[tenant])), 10**6)

    async def step(self, locality: Locality | None = None) -> Grant:
        (grant,), _ = await self.store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0,
                                                 locality=locality)
        tenant, prompt, weight = self.users[grant.user]
        self.user_served[grant.user] += self.policy.service(prompt, OUTPUT, weight)
        self.tenant_served[tenant] += self.policy.service(prompt, OUTPUT,
                                                          self.tenants[tenant])
        self.inflight.append(grant)
        if len(self.inflight) >= IN_FLIGHT:
            await self.settle_one()
        return grant

    async def settle_one(self) -> None:
        old = self.inflight.popleft()
        tenant, prompt, weight = self.users[old.user]
        await self.store.queue.settle(
            M, old, self.policy.settle_charge(prompt, prompt, OUTPUT, weight),
            self.policy.settle_charge(prompt, prompt, OUTPUT, self.tenants[tenant]))

    def bounds(self, slack: float = 0.0) -> tuple[float, float]:
        def most(weight_of: Callable[[str], float], fn: Callable[[int, float], float]
                 ) -> float:
            return max(fn(self.users[u][1], weight_of(u)) for u in self.users)

        def tenant_weight(u: str) -> float:
            return self.tenants[self.users[u][0]]

        def user_weight(u: str) -> float:
            return self.users[u][2]

        def service(p: int, w: float) -> float:
            return self.policy.service(p, OUTPUT, w)

        def unsettled(p: int, w: float) -> float:
            return self.policy.service(p, OUTPUT, w) - self.policy.dispatch_cost(p, w)

        return level_bounds(self.policy, most(tenant_weight, service),
                            most(user_weight, service), IN_FLIGHT,
                            most(tenant_weight, unsettled), most(user_weight, unsettled),
                            slack)

    def tenant_gap(self) -> float:
        return max(self.tenant_served.values()) - min(self.tenant_served.values())

    def user_gap(self, tenant: str) -> float:
        mine = [s for u, s in self.user_served.items() if self.users[u][0] == tenant]
        return max(mine) - min(mine)


async def tenant_bench(redis: aioredis.Redis, name: str,
                       users: dict[str, tuple[str, int, float]],
                       tenants: dict[str, float]) -> TenantBench:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    return TenantBench(store, policy_for(name), users, tenants)


THREE_AND_ONE = {"a1": ("A", 100, 1.0), "a2": ("A", 300, 1.0), "a3": ("A", 100, 2.0),
                 "b1": ("B", 200, 1.0)}


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("tenants", [{"A": 1.0, "B": 1.0}, {"A": 1.0, "B": 2.0}])
async def test_backlogged_tenants_share_by_tenant_weight_whatever_their_users(
        redis: aioredis.Redis, name: str, tenants: dict[str, float]) -> None:
    """Tenant A has three backlogged users, B one: tenant-weighted service stays within
    the policy's bound at the tenant level (so B's user gets B's whole share: half, or two
    thirds at weight 2), and A's users share A's within the bound at the user level."""
    b = await tenant_bench(redis, name, THREE_AND_ONE, tenants)
    for user in THREE_AND_ONE:
        await b.enqueue(user, 400)
    tenant_bound, user_bound = b.bounds()
    worst_tenant = worst_user = 0.0
    for _ in range(400):  # everyone stays backlogged throughout
        await b.step()
        worst_tenant = max(worst_tenant, b.tenant_gap())
        worst_user = max(worst_user, b.user_gap("A"))
    assert worst_tenant <= tenant_bound, (b.tenant_served, worst_tenant, tenant_bound)
    assert worst_user <= user_bound, (b.user_served, worst_user, user_bound)


@pytest.mark.parametrize("name", POLICIES)
async def test_an_idle_tenant_cannot_bank_credit(redis: aioredis.Redis, name: str) -> None:
    users = {"a1": ("A", 100, 1.0), "a2": ("A", 100, 1.0), "b1": ("B", 100, 1.0)}
    b = await tenant_bench(redis, name, users, {"A": 1.0, "B": 1.0})
    await b.enqueue("a1", 300)
    await b.enqueue("a2", 300)
    for _ in range(150):  # B sends nothing meanwhile
        await b.step()
    before = dict(b.tenant_served)
    await b.enqueue("b1", 200)
    for _ in range(100):
        await b.step()
    gained = {t: b.tenant_served[t] - before[t] for t in before}
    assert abs(gained["A"] - gained["B"]) <= b.bounds()[0], gained


@pytest.mark.parametrize("name", POLICIES)
async def test_an_idle_user_cannot_bank_credit_in_its_tenant(
        redis: aioredis.Redis, name: str) -> None:
    """a2 is idle while a1 is served; then the whole tenant idles (the user level has no
    active user to lift a returning one to: the score its last user left at does)."""
    users = {"a1": ("A", 100, 1.0), "a2": ("A", 100, 1.0), "b1": ("B", 100, 1.0)}
    b = await tenant_bench(redis, name, users, {"A": 1.0, "B": 1.0})
    await b.enqueue("a1", 60)
    await b.enqueue("b1", 1000)
    for _ in range(220):  # a1's 60 are dispatched in the first 120 (A idles afterwards)
        await b.step()
    assert b.user_served["a1"] == 60 * b.policy.service(100, OUTPUT, 1.0)
    await b.enqueue("a2", 200)
    await b.enqueue("a1", 200)
    before = dict(b.user_served)
    for _ in range(200):
        await b.step()
    gained = {u: b.user_served[u] - before[u] for u in ("a1", "a2")}
    assert abs(gained["a1"] - gained["a2"]) <= b.bounds()[1], gained


async def test_the_scripts_follow_the_plain_model(redis: aioredis.Redis) -> None:
    """Random arrivals, dispatches and settles: the Redis scripts serve users in the order
    of policies/fairness.TwoLevel (settled at once, so scores are exact)."""
    rng = random.Random(7)
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    model = TwoLevel()
    members = {"a1": "A", "a2": "A", "a3": "A", "b1": "B", "c1": "C", "c2": "C"}
    weights = {"A": 1.0, "B": 2.0, "C": 0.5}
    ids = 0
    for _ in range(400):
        if rng.random() < 0.55:
            user = rng.choice(list(members))
            tenant, cost = members[user], float(rng.choice((1, 3, 10)))
            ids += 1
            model.enqueue(tenant, user, cost, cost / weights[tenant])
            await store.queue.enqueue(M, QueuedRequest(f"{user}-{ids}", user, "default", "r1",
                                                 cost, 1000.0, (), tenant,
                                                 cost / weights[tenant]), 10**6)
            continue
        expected = model.dispatch()
        grants, _ = await store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0)
        if expected is None:
            assert grants == []
            continue
        (grant,) = grants
        assert (members[grant.user], grant.user) == expected
        extra = float(rng.choice((0, 2, 5)))
        model.settle(expected[0], grant.user, extra, extra / weights[expected[0]])
        await store.queue.settle(M, grant, extra, extra / weights[expected[0]])


async def test_locality_bends_both_levels_within_the_slack(redis: aioredis.Redis) -> None:
    """With a slack, a cached request of a user within it of its tenant's least-served
    user, in a tenant within it of the least-served tenant, goes first; a tenant beyond
    the slack does not, whatever its users."""
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    await redis.zadd(K.backend_prefixes("b1"), {"hot": 1000.0})
    loc = Locality(slack=50.0, candidates=8, index_size=100, index_ttl_s=60.0)
    for rid, user, tenant, chain in (("a1-r", "a1", "A", ("x",)), ("a2-r", "a2", "A", ("hot",)),
                                     ("b1-r", "b1", "B", ("y",)), ("c1-r", "c1", "C", ("hot",))):
        await store.queue.enqueue(M, QueuedRequest(rid, user, "default", "r1", 10.0, 1000.0, chain,
                                             tenant), 10)
    await redis.zadd(K.active("default"), {"A": 130.0, "B": 100.0, "C": 151.0})
    await redis.zadd(K.users("default", "A"), {"a1": 0.0, "a2": 40.0})
    grants, _ = await store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0, locality=loc)
    assert [g.request_id for g in grants] == ["a2-r"]  # C is 51 above B: beyond the slack
    candidates = within_slack([(100.0, [(0.0, "b1")]), (130.0, [(0.0, "a1"), (40.0, "a2")]),
                               (151.0, [(0.0, "c1")])], 50.0, 8)
    assert candidates == ["b1", "a1", "a2"]


@pytest.mark.parametrize("name", POLICIES)
async def test_locality_keeps_both_levels_within_their_bounds_plus_the_slack(
        redis: aioredis.Redis, name: str) -> None:
    """Every prompt of "hot" (tenant A) is cached on the backend, nobody else's: locality
    serves it ahead, but the tenants' gap stays within the tenant-level bound plus the
    slack and the gap between A's users within the user-level bound plus the slack."""
    users = {"hot": ("A", 100, 1.0), "a2": ("A", 100, 1.0), "b1": ("B", 100, 1.0),
             "b2": ("B", 100, 1.0)}
    b = await tenant_bench(redis, name, users, {"A": 1.0, "B": 1.0})
    slack = 2 * b.policy.service(100, OUTPUT, 1.0)
    loc = Locality(slack=slack, candidates=8, index_size=1000, index_ttl_s=600.0)
    await redis.zadd(K.backend_prefixes("b1"), {"hot1": 1000.0})
    await b.enqueue("hot", 200, ("hot1",))
    for user in ("a2", "b1", "b2"):
        await b.enqueue(user, 200)
    tenant_bound, user_bound = b.bounds(slack)
    for _ in range(300):
        await b.step(loc)
        assert b.tenant_gap() <= tenant_bound, b.tenant_served
        assert b.user_gap("A") <= user_bound, b.user_served
        assert b.user_gap("B") <= user_bound, b.user_served
    # it did bend: in strict order hot and a2 would differ by one request at most
    assert b.user_served["hot"] - b.user_served["a2"] > b.policy.service(100, OUTPUT, 1.0)


async def test_a_queued_requests_place_is_read_in_its_tenant(redis: aioredis.Redis) -> None:
    """For wait estimates: a queued request's tenant comes from its hash, its score is its
    tenant's and its index is in its user's queue within that tenant."""
    store = Store.over(redis, 600)
    for rid in ("x1", "x2"):
        await store.queue.enqueue(M, QueuedRequest(rid, "alice", "default", "r1", 5.0, 1000.0, (),
                                             "research"), 10)
    await redis.zadd(K.active("default"), {"research": 42.0})
    assert await store.reads.queue_place(M, "default", "alice", "x2") == (42.0, 1)
    assert await store.reads.queue_place(M, "default", "alice", None, "research") == (42.0, 2)
    assert await store.reads.queue_place(M, "default", "bob", None) == (None, 0)


# --- sessions: the third level, within a user ------------------------------------------

class SessionBench(Bench):
    """:class:`Bench` with sessions on: each request in one of its user's sessions."""

    def __init__(self, store: Store, policy: FairnessPolicy, prompts: dict[str, int],
                 weights: dict[str, float]) -> None:
        super().__init__(store, policy, prompts, weights)
        self.session_served: dict[tuple[str, str], float] = {}
        self.sessions: dict[str, str] = {}  # request id -> its session

    async def enqueue_in(self, user: str, session: str, count: int) -> None:
        for _ in range(count):
            self.ids += 1
            cost = self.policy.dispatch_cost(self.prompts[user], self.weights[user])
            await self.store.queue.enqueue(M, QueuedRequest(
                f"{user}-{self.ids}", user, "default", "r1", cost, 1000.0,
                session=session), 10**6)
            self.sessions[f"{user}-{self.ids}"] = session

    async def step(self) -> Grant:
        (grant,), _ = await self.store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0,
                                                 sessions=True)
        prompt, weight = self.prompts[grant.user], self.weights[grant.user]
        service = self.policy.service(prompt, OUTPUT, weight)
        self.served[grant.user] += service
        who = (grant.user, self.sessions[grant.request_id])
        self.session_served[who] = self.session_served.get(who, 0.0) + service
        self.inflight.append(grant)
        if len(self.inflight) >= IN_FLIGHT:
            await self.settle_one()
        return grant


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("a_sessions", [1, 50])
async def test_a_users_share_is_the_same_whatever_its_sessions(
        redis: aioredis.Redis, name: str, a_sessions: int) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    b = SessionBench(store, policy_for(name), {"a": 100, "b": 300}, {"a": 1.0, "b": 1.0})
    for s in range(a_sessions):
        await b.enqueue_in("a", f"s{s}", 400 // a_sessions)
    await b.enqueue_in("b", "", 400)
    worst = 0.0
    for _ in range(200):  # both stay backlogged throughout
        await b.step()
        worst = max(worst, abs(b.served["a"] - b.served["b"]))
    assert worst <= b.bound(), (a_sessions, b.served, worst, b.bound())


@pytest.mark.parametrize("name", POLICIES)
async def test_backlogged_sessions_of_a_user_share_its_service(
        redis: aioredis.Redis, name: str) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    b = SessionBench(store, policy_for(name), {"a": 100, "b": 100}, {"a": 1.0, "b": 1.0})
    await b.enqueue_in("a", "agent", 300)  # an agent's parallel calls
    await b.enqueue_in("a", "chat", 100)
    await b.enqueue_in("b", "", 300)
    worst = 0.0
    for _ in range(150):  # a's two sessions and b stay backlogged throughout
        await b.step()
        worst = max(worst, abs(b.session_served.get(("a", "agent"), 0.0)
                               - b.session_served.get(("a", "chat"), 0.0)))
    assert worst <= b.bound(), (b.session_served, worst, b.bound())
    assert abs(b.served["a"] - b.served["b"]) <= b.bound(), b.served


# --- cache-aware cost: charged what the GPU computes ------------------------------------

BLOCKS = 10  # of a prompt's chain, each TOKENS_PER_BLOCK estimated tokens
PROMPT = BLOCKS * TOKENS_PER_BLOCK + 60
ENGINE_CACHED = (BLOCKS - 1) * TOKENS_PER_BLOCK  # the engine found one block less


class CacheBench:
    """Dispatch with locality and settle on a real Redis, as the gateway does: "hot"
    sends one prompt again and again (its chain in the backend's prefix index, its
    prefix in the engine's cache), "cold" new prompts of the same length. Dispatch
    charges what the index predicts uncached; the settle what the engine computed."""

    def __init__(self, store: Store, policy: FairnessPolicy) -> None:
        self.store, self.policy = store, policy
        self.computed = {"hot": 0.0, "cold": 0.0}  # service of what the engine computed
        self.inflight: deque[Grant] = deque()
        self.ids = 0
        self.charged: list[int] = []  # the prompt tokens each hot dispatch charged
        self.unsettled = 0.0  # the largest service a dispatch left to its settle

    def chain(self, user: str) -> tuple[str, ...]:
        return tuple(f"{user}-{self.ids if user == 'cold' else 0}-{i}" for i in range(BLOCKS))

    async def enqueue(self, user: str, count: int) -> None:
        for _ in range(count):
            self.ids += 1
            await self.store.queue.enqueue(M, QueuedRequest(
                f"{user}-{self.ids}", user, "default", "r1",
                self.policy.dispatch_cost(PROMPT, 1.0), 1000.0, self.chain(user),
                prompt_tokens=PROMPT, credit=self.policy.cached_credit(1.0)), 10**6)

    def engine_computed(self, user: str) -> int:
        return PROMPT - (ENGINE_CACHED if user == "hot" else 0)

    async def step(self, locality: Locality) -> Grant:
        (grant,), _ = await self.store.queue.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0,
                                                 locality=locality)
        computed = self.engine_computed(grant.user)
        service = self.policy.service(computed, OUTPUT, 1.0)
        self.computed[grant.user] += service
        charged = charged_prompt(PROMPT, grant.charged_prompt)
        if grant.user == "hot":
            self.charged.append(charged)
        self.unsettled = max(self.unsettled,
                             service - self.policy.dispatch_cost(charged, 1.0))
        self.inflight.append(grant)
        if len(self.inflight) >= IN_FLIGHT:
            await self.settle_one()
        return grant

    async def settle_one(self) -> None:
        old = self.inflight.popleft()
        charge = self.policy.settle_charge(self.engine_computed(old.user),
                                           charged_prompt(PROMPT, old.charged_prompt),
                                           OUTPUT, 1.0)
        await self.store.queue.settle(M, old, charge, charge)


async def cache_bench(redis: aioredis.Redis, name: str) -> CacheBench:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    b = CacheBench(store, policy_for(name))
    # the backend was sent hot's prompt before: its index holds the chain
    await redis.zadd(K.backend_prefixes("b1"), dict.fromkeys(b.chain("hot"), 1000.0))
    return b


@pytest.mark.parametrize("name", POLICIES)
async def test_a_user_with_cacheable_prompts_is_not_overcharged(
        redis: aioredis.Redis, name: str) -> None:
    """Its dispatch is charged the tokens the index predicts uncached, its settle what the
    engine reports: once all settled, each user's counter is the service of what the GPU
    computed for it, so under VTC the user whose prompts are cached gets more requests
    for the same service (charged by prompt tokens, both would get as many)."""
    b = await cache_bench(redis, name)
    loc = Locality(slack=0.0, candidates=8, index_size=1000, index_ttl_s=600.0)
    await b.enqueue("hot", 300)
    await b.enqueue("cold", 300)
    served = {"hot": 0, "cold": 0}
    for _ in range(200):
        served[(await b.step(loc)).user] += 1
    while b.inflight:
        await b.settle_one()
    # every hot dispatch charged the tokens past the blocks its index held
    assert set(b.charged) == {PROMPT - BLOCKS * TOKENS_PER_BLOCK}, sorted(set(b.charged))
    for user in ("hot", "cold"):  # both still queued: active, each its own tenant
        score = await redis.zscore(K.users("default", user), user)
        assert score == pytest.approx(b.computed[user]), (user, score, b.computed)
    assert abs(b.computed["hot"] - b.computed["cold"]) <= b.policy.bound(
        b.policy.service(PROMPT, OUTPUT, 1.0), IN_FLIGHT, b.unsettled), (b.computed, served)
    if name == "vtc":  # hot's requests cost about a third of cold's: it gets more of them
        assert served["hot"] > 2 * served["cold"], served
    else:
        assert abs(served["hot"] - served["cold"]) <= 1, served


@pytest.mark.parametrize("name", POLICIES)
async def test_the_bound_holds_with_locality_in_computed_service(
        redis: aioredis.Redis, name: str) -> None:
    """With a slack, a backend may serve the user whose prompt it has cached ahead of
    the least-served one: the gap in the service of what the GPU computed stays within
    the policy's bound (the largest request, and what dispatches leave to their settle
    in flight) plus the slack."""
    b = await cache_bench(redis, name)
    slack = 3 * b.policy.service(PROMPT, OUTPUT, 1.0)
    loc = Locality(slack=slack, candidates=8, index_size=1000, index_ttl_s=600.0)
    await b.enqueue("hot", 300)
    await b.enqueue("cold", 300)
    worst = 0.0
    for _ in range(200):  # both stay backlogged throughout
        await b.step(loc)
        worst = max(worst, abs(b.computed["hot"] - b.computed["cold"]))
    bound = with_locality(b.policy.bound(b.policy.service(PROMPT, OUTPUT, 1.0), IN_FLIGHT,
                                         b.unsettled), slack)
    assert worst <= bound, (b.computed, worst, bound)
