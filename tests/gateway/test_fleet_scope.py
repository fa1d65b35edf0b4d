"""Fair share across models end to end (``fairness_scope``): the ``openai`` SDK through one
gateway to two simulated vLLM backends of two models on loopback, on a real Redis
(``loadtest/bench/model_shares.py``, issue 27's fleet-scope phase).

Tenant a floods both models, tenant b one of them; the other model's tokens count half
(``cost_factors``). While all streams are backlogged, each tenant's weighted tokens (the
backends' own counts × the model's factor) must be half of both tenants' within 5 % in
fleet scope: a yields its turn on the shared model for what the other one gave it. Per
model (the default scope) a gets about two thirds: half of the shared model besides all
of the other."""

from __future__ import annotations

import redis.asyncio as aioredis

from loadtest.bench.model_shares import X, Y, run_phase


async def test_a_tenant_on_two_models_gets_one_share_across_both(
        redis: aioredis.Redis, redis_url: str) -> None:
    got = await run_phase(redis_url, "fleet", y_factor=0.5)
    assert abs(got.shares["a"] - 0.5) <= 0.025, got.report()
    # a yielded on x: about a quarter of x's requests (half per model)
    on_x = got.requests[f"a@{X}"] / (got.requests[f"a@{X}"] + got.requests[f"b@{X}"])
    assert on_x < 0.4, (on_x, got.report())
    assert got.requests[f"a@{Y}"] >= 40, got.report()  # a window long enough to judge


async def test_per_model_a_tenant_on_two_models_gets_two_shares(
        redis: aioredis.Redis, redis_url: str) -> None:
    got = await run_phase(redis_url, "model", y_factor=0.5)
    assert got.shares["a"] >= 0.6, got.report()
