"""Fairness conformance: every policy in ``policies/fairness.py`` passes this suite, run on
the real Redis scripts (the generic virtual-time engine) over many decisions.

A new policy is one class plus one name in ``POLICIES``; this suite then checks that
- two continuously backlogged users' weighted service stays within the policy's own
  stated bound (VTC, Sheng et al., OSDI 2024: 2·U, plus the output of the requests in
  flight, which is charged only when they settle), with different prompt sizes and weights;
- a user idle while another was served cannot bank credit: when it returns it gets its
  fair share from then on, not a burst that makes up for the time away.
"""

from __future__ import annotations

from collections import deque

import pytest
import redis.asyncio as aioredis

from gateway.store import Grant, QueuedRequest, Store
from policies.fairness import POLICIES, FairnessPolicy, RoundRobin, Vtc, policy_for

M = "m"
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
            await self.store.enqueue(M, QueuedRequest(f"{user}-{self.ids}", user, "default",
                                                      "r1", cost, 1000.0), 10**6)

    async def step(self) -> Grant:
        (grant,), _ = await self.store.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0)
        prompt, weight = self.prompts[grant.user], self.weights[grant.user]
        self.served[grant.user] += self.policy.service(prompt, OUTPUT, weight)
        self.inflight.append(grant)
        if len(self.inflight) >= IN_FLIGHT:
            await self.settle_one()
        return grant

    async def settle_one(self) -> None:
        old = self.inflight.popleft()
        prompt, weight = self.prompts[old.user], self.weights[old.user]
        await self.store.settle(M, old, self.policy.settle_charge(prompt, prompt, OUTPUT,
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
    store = Store(redis, 600)
    await store.heartbeat([M], "r1", 1000.0)
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
