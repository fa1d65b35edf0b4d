"""Fairness charges what the GPU computed: with vLLM's ``--enable-prompt-tokens-details``
the cached part of a prompt (``usage.prompt_tokens_details.cached_tokens``) is refunded at
settle, so a user whose prompts hit the prefix cache is not charged like one whose
prompts are all new; the usage export shows the cached tokens apart."""

from __future__ import annotations

import aiohttp
import openai

from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory
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
