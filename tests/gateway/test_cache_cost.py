"""Fairness charges what the GPU computed: with vLLM's ``--enable-prompt-tokens-details``
the cached part of a prompt (``usage.prompt_tokens_details.cached_tokens``) is not
charged, so a user whose prompts hit the prefix cache is not charged like one whose
prompts are all new; with locality the dispatch already charges what the backend's
prefix index predicts uncached, the settle corrects it to what the engine reports; the
usage export shows the cached tokens apart."""

from __future__ import annotations

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from gateway.http.server import GatewayServer
from gateway.proxy.completion_request import parse_body
from gateway.proxy.endpoints import COMPLETIONS
from gateway.storage.keys import ModelKeys
from policies.cost import estimate_prompt_tokens
from policies.fairness import Vtc
from policies.locality import prefix_chain
from policies.prefill import uncached_tokens
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, until
from tests.ops.conftest import ADMIN, admin_call

ROUNDS = 4
WORDS = 300


async def test_cached_prompt_tokens_are_not_charged_as_computed(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant", enable_prompt_tokens_details=True)
    gw = await gateway([backend], admin_keys=[ADMIN])
    clients = {user: openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=f"sk-{user}",
                                        max_retries=0) for user in ("alice", "bob")}
    try:
        for i in range(ROUNDS):  # alice sends one prompt again and again, bob new ones
            for user, prompt in (("alice", "shared " * WORDS),
                                 ("bob", f"new{i} " * WORDS)):
                answer = await clients[user].completions.create(
                    model=MODEL, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
                assert answer.usage is not None and answer.usage.prompt_tokens >= WORDS
    finally:
        for client in clients.values():
            await client.close()
    async with aiohttp.ClientSession() as http:
        _, usage = await admin_call(http, "GET", gw.url + "/admin/usage?group_by=user")
        rows = {r["user"]: r for r in usage["data"]}
        # alice's prompts are even longer than bob's (her word is more tokens)
        assert rows["alice"]["prompt_tokens"] >= rows["bob"]["prompt_tokens"], rows
        # alice's prompt hits the cache from her second request on (whole 16-token blocks)
        assert rows["alice"]["cached_prompt_tokens"] >= (ROUNDS - 1) * (WORDS - 16), rows
        assert rows["bob"]["cached_prompt_tokens"] == 0, rows
        _, state = await admin_call(http, "GET", gw.url + "/admin/state")
    shares = {s["user"]: s["share"] for s in state["models"][MODEL]["service_shares"]}
    # alice made the GPU compute about one prompt and bob four: her share is well below
    # his (charged by prompt tokens it would be above)
    assert shares["alice"] < 0.5 * shares["bob"], shares


async def user_score(redis: aioredis.Redis, klass: str, user: str) -> float:
    """A user's fairness counter (each user its own tenant): active, else saved."""
    k = ModelKeys(MODEL)
    score = await redis.zscore(k.users(klass, user), user)
    if score is None:
        score = float(await redis.hget(k.user_saved(klass, user), user) or 0.0)
    return float(score)


async def test_dispatch_charges_what_the_index_predicts_uncached_and_settle_what_vllm_reports(
        sim: SimFactory, gateway: GatewayFactory, redis: aioredis.Redis) -> None:
    """With locality, the backend's prefix index holds the prompt alice sent before: her
    stream's dispatch is charged only the estimated tokens past the blocks it holds, bob's
    new prompt its whole estimate; each settle then charges what the engine computed
    (its prompt less ``cached_tokens``, and the output), so every counter ends at the
    service of what the GPU computed."""
    backend = await sim(enable_prompt_tokens_details=True)  # streams take a while
    gw = await gateway([backend], routing="locality")
    policy = Vtc()
    prompts = {"alice": "shared " * WORDS, "bob": "other " * WORDS + "x"}
    clients = {user: openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=f"sk-{user}",
                                        max_retries=0) for user in prompts}
    try:
        await clients["alice"].completions.create(  # her prompt reaches backend and index
            model=MODEL, prompt=prompts["alice"], max_tokens=1)
        for user, prompt in prompts.items():
            typed = parse_body({"model": MODEL, "prompt": prompt}, COMPLETIONS).prompt
            estimate = estimate_prompt_tokens(typed)
            held = len(prefix_chain(typed)) if user == "alice" else 0
            predicted = uncached_tokens(estimate, held)
            await until(lambda: assert_idle(gw), "the previous request settled")
            before = await user_score(redis, "interactive", user)
            stream = await clients[user].completions.create(
                model=MODEL, prompt=prompt, max_tokens=200, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            usage = None
            dispatched = None
            async for chunk in stream:
                if dispatched is None:  # streaming: dispatched, not settled
                    dispatched = await user_score(redis, "interactive", user) - before
                usage = chunk.usage or usage
            assert dispatched == pytest.approx(policy.dispatch_cost(predicted, 1.0)), (
                user, dispatched, estimate, held, predicted)
            assert usage is not None and usage.prompt_tokens_details is not None, usage
            cached = usage.prompt_tokens_details.cached_tokens or 0
            if user == "alice":
                assert cached >= usage.prompt_tokens - 16, usage  # all but the last block
                assert predicted < estimate / 4, (predicted, estimate)
            else:
                assert cached == 0 and predicted == estimate, (usage, predicted, estimate)
            computed = policy.service(usage.prompt_tokens - cached, usage.completion_tokens,
                                      1.0)

            async def settled(user: str = user, before: float = before,
                              computed: float = computed) -> bool:
                return (await user_score(redis, "interactive", user) - before
                        == pytest.approx(computed))

            await until(settled, f"{user}'s settle charged the service of what was computed")
    finally:
        for client in clients.values():
            await client.close()


async def assert_idle(gw: GatewayServer) -> bool:
    return await gw.services.store.reads.user_inflight(MODEL) == {}
