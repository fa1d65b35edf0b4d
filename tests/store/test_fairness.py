"""Fairness of the dispatch script over many decisions, on a real Redis.

VTC bound (Sheng et al., OSDI 2024): for two continuously backlogged users the difference
of their weighted service stays within 2·U, U = the largest cost of one request
(w_in·prompt + w_out·output). With K requests in flight whose output is charged only at
completion, we allow K more output charges: bound = 2·U + K·w_out·output.
"""

from __future__ import annotations

from collections import deque

import redis.asyncio as aioredis

from gateway.store import Grant, QueuedRequest, Store
from policies.fairness import ScoreRule, round_robin, vtc

M = "m"
OPEN = {"interactive": 10**9, "default": 10**9, "batch": 10**9}
OUTPUT = 100
IN_FLIGHT = 4


async def serve_backlog(store: Store, rule: ScoreRule, prompts: dict[str, int],
                        weights: dict[str, float], per_user: int) -> dict[str, float]:
    """Dispatch/settle until one user's backlog empties; returns each user's served cost."""
    await store.heartbeat([M], "r1", 1000.0)
    for user, prompt in prompts.items():
        for i in range(per_user):
            await store.enqueue(M, QueuedRequest(f"{user}{i}", user, "default", "r1",
                                                 weights[user], prompt, 1000.0), per_user)
    served = dict.fromkeys(prompts, 0.0)
    done = dict.fromkeys(prompts, 0)
    inflight: deque[Grant] = deque()
    while all(n < per_user for n in done.values()):
        (grant,), _ = await store.dispatch(M, "b1", OPEN, "r1", 1000.0, 10.0)
        inflight.append(grant)
        done[grant.user] += 1
        served[grant.user] += (prompts[grant.user] + 2 * OUTPUT) / weights[grant.user]
        if len(inflight) >= IN_FLIGHT:
            old = inflight.popleft()
            charge = rule.completion_charge(prompts[old.user], prompts[old.user], OUTPUT,
                                            weights[old.user])
            await store.settle(M, old, charge)
    return served


async def test_vtc_equalises_token_cost_with_4x_prompts(redis: aioredis.Redis) -> None:
    prompts = {"long": 400, "short": 100}
    served = await serve_backlog(Store(redis, vtc(), 600), vtc(), prompts,
                                 {"long": 1.0, "short": 1.0}, per_user=60)
    bound = 2 * (400 + 2 * OUTPUT) + IN_FLIGHT * 2 * OUTPUT
    assert abs(served["long"] - served["short"]) <= bound, served


async def test_round_robin_equalises_requests_not_tokens(redis: aioredis.Redis) -> None:
    prompts = {"long": 400, "short": 100}
    served = await serve_backlog(Store(redis, round_robin(), 600), round_robin(), prompts,
                                 {"long": 1.0, "short": 1.0}, per_user=60)
    bound = 2 * (400 + 2 * OUTPUT) + IN_FLIGHT * 2 * OUTPUT
    # RR serves equal request counts, so the long-prompt user gets ~2× the tokens
    assert served["long"] - served["short"] > bound, served


async def test_vtc_weights_scale_service(redis: aioredis.Redis) -> None:
    prompts = {"heavy": 100, "light": 100}
    weights = {"heavy": 2.0, "light": 1.0}
    served = await serve_backlog(Store(redis, vtc(), 600), vtc(), prompts, weights,
                                 per_user=60)
    # served[] is already divided by weight: weighted service is equal, raw is 2:1
    assert abs(served["heavy"] - served["light"]) <= 2 * 300 + IN_FLIGHT * 2 * OUTPUT, served
