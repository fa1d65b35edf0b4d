"""Budgets and rate limits reserve what a request can really cost (issue 29, items 2 and
4): every output-token field the endpoint honours, the model's context when none is set,
``n``/``best_of``, token-id prompts by their length; and prompts of many tokens per
character (emoji, CJK, token ids) cannot pass for short ones in length-aware pools.

The reservation shows in the tpm bucket: a key with a large tpm answers
``x-ratelimit-remaining-tokens`` right after its charge at admission.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.gateway.conftest import (
    CHAT,
    HI,
    MODEL,
    GatewayFactory,
    SimFactory,
    assert_error,
    call,
)

TPM = 1_000_000
KEYS = [{"key": "sk-tpm", "user": "tina", "limits": {"tpm": TPM}}]
CONTEXT = 4096


@pytest.mark.parametrize(("path", "body", "at_least"), [
    (CHAT, {"messages": HI, "max_tokens": 1, "max_completion_tokens": 2000}, 2000),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100, "n": 8}, 800),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 50, "n": 2, "best_of": 6}, 300),
    ("/v1/completions", {"prompt": [list(range(3000))], "max_tokens": 1}, 3000),
    ("/v1/completions", {"prompt": "hi"}, CONTEXT),  # no bound: the model's context
    ("/v1/responses", {"input": "hi", "max_output_tokens": 700}, 700),
], ids=["max_completion_tokens", "n", "best_of", "token-id prompt", "no max_tokens",
        "max_output_tokens"])
async def test_the_reservation_bounds_what_the_request_can_cost(
        path: str, body: dict[str, Any], at_least: int, sim: SimFactory,
        gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    backend = await sim(profile="instant", max_model_len=CONTEXT)
    gw = await gateway([backend], api_keys=KEYS)
    status, answer, headers = await call(http, "POST", gw.url + path, key="sk-tpm",
                                         json={"model": MODEL, **body})
    assert status == 200, answer
    reserved = TPM - int(headers["x-ratelimit-remaining-tokens"])
    assert reserved >= at_least, f"{path} {sorted(body)}: reserved {reserved} < {at_least}"


async def test_a_daily_budget_refuses_what_it_cannot_hold(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    backend = await sim(profile="instant", max_model_len=CONTEXT)
    gw = await gateway([backend], api_keys=[
        {"key": "sk-day", "user": "dora", "limits": {"daily_tokens": 3000}}])
    body = {"model": MODEL, "messages": HI, "max_tokens": 1, "max_completion_tokens": 3500}
    status, answer, _ = await call(http, "POST", gw.url + CHAT, key="sk-day", json=body)
    assert status == 429, f"admitted a 3,500-token request on a 3,000-token day: {answer}"
    assert_error(answer, type_="insufficient_quota", code="insufficient_quota")


@pytest.mark.parametrize(("prompt", "real"), [
    ("😀" * 9000, 9007), ("漢" * 12000, 9000), ([[7] * 9000], 9000)],
    ids=["emoji", "cjk", "token ids"])
async def test_many_tokens_per_character_do_not_pass_for_short(
        prompt: Any, real: int, sim: SimFactory, gateway: GatewayFactory,
        http: aiohttp.ClientSession) -> None:
    """A short pool (prompts up to 8,192) and a long one: each prompt, about ``real``
    tokens, must run on the long pool."""
    short, long_ = await sim(profile="instant"), await sim(profile="instant")
    gw = await gateway([short, long_], backend_options={
        "b0": {"max_prompt_tokens": 8192}, "b1": {"min_prompt_tokens": 8193}})
    status, answer, _ = await call(http, "POST", gw.url + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert status == 200, answer
    served = {"short": len(short.engine.records), "long": len(long_.engine.records)}
    assert served == {"short": 0, "long": 1}, f"a prompt of ~{real} tokens ran on {served}"
