"""Budgets and rate limits reserve what a request can really cost (issue 29, items 2 and
4): the effective output bound (the smallest field the endpoint honours, and the backend
gets that one), the model's context when none is set, ``n``/``best_of``, token-id prompts
by their length, a token per UTF-8 byte of text; batch lines that can never be served
are refused at upload; and prompts of many tokens per character (emoji, CJK, token ids)
cannot pass for short ones in length-aware pools.

Token counts are the simulator's: what its tokenizer counted and its engine generated.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from gateway.http.server import GatewayServer
from tests.gateway.conftest import (
    CHAT,
    HI,
    MODEL,
    GatewayFactory,
    SimFactory,
    assert_error,
    call,
)

BUDGET = 5_000
CONTEXT = 8_192
BUDGET_KEYS = [{"key": "sk-day", "user": "dora", "limits": {"daily_tokens": BUDGET}}]
TPM = 1_000_000
TPM_KEYS = [{"key": "sk-tpm", "user": "tina", "limits": {"tpm": TPM}}]


async def spent_today(http: aiohttp.ClientSession, gw: GatewayServer) -> int:
    status, usage, _ = await call(http, "GET", gw.url + "/v1/fairgate/usage", key="sk-day")
    assert status == 200, usage
    return int(usage["limits"][0]["daily_tokens_used"])


# the probe's requests (issue 29, item 2), sent at once: on the old code all were
# admitted and ran over a 5,000-token day (12,048, 14,424 and 24,020 tokens spent)
@pytest.mark.parametrize(("path", "body", "attempts"), [
    (CHAT, {"messages": HI, "max_tokens": 1, "max_completion_tokens": 2000}, 6),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600, "n": 8, "temperature": 1.0}, 3),
    ("/v1/completions", {"prompt": [[7] * 6000], "max_tokens": 1}, 4),
    (CHAT, {"messages": HI}, 3),  # no output bound: up to the context
], ids=["max_completion_tokens", "n", "token-id prompt", "no max_tokens"])
async def test_a_daily_budget_is_never_overspent(
        path: str, body: dict[str, Any], attempts: int, sim: SimFactory,
        gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    backend = await sim(profile="instant", max_model_len=CONTEXT)
    gw = await gateway([backend], api_keys=BUDGET_KEYS)
    answers = await asyncio.gather(*(
        call(http, "POST", gw.url + path, key="sk-day",
             json={"model": MODEL, "ignore_eos": True, **body}) for _ in range(attempts)))
    assert {status for status, _, _ in answers} <= {200, 429}, answers
    answered = [answer["usage"] for status, answer, _ in answers if status == 200]
    for status, answer, _ in answers:
        if status == 429:
            assert_error(answer, type_="insufficient_quota", code="insufficient_quota")
    spent = await spent_today(http, gw)
    generated = [u.get("completion_tokens", u.get("output_tokens")) for u in answered]
    assert spent <= BUDGET, (f"{len(answered)} of {attempts} admitted spent {spent} tokens "
                             f"of a {BUDGET}-token day (generated {generated})")
    # settled at what the backend reported, not at the reservation
    reported = sum(u["total_tokens"] for u in answered)
    assert spent == reported, f"charged {spent}, the backend reported {reported}"
    if "max_completion_tokens" in body:  # the backend got the smaller bound
        assert set(generated) == {1}, f"generated {generated} for max_tokens 1"


@pytest.mark.parametrize(("path", "body", "at_least"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100, "n": 8}, 800),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 50, "n": 2, "best_of": 6}, 300),
    ("/v1/completions", {"prompt": [list(range(3000))], "max_tokens": 1}, 3000),
    ("/v1/completions", {"prompt": "\x01" * 3000, "max_tokens": 1}, 3000),  # a byte a token
    ("/v1/completions", {"prompt": "hi"}, CONTEXT),  # no bound: the model's context
    ("/v1/completions", {"prompt": "hi", "max_completion_tokens": 5}, CONTEXT),  # not its
    ("/v1/responses", {"input": "hi", "max_output_tokens": 700}, 700),
], ids=["n", "best_of", "token-id prompt", "dense ascii", "no max_tokens",
        "completions ignore max_completion_tokens", "max_output_tokens"])
async def test_the_reservation_bounds_what_the_request_can_cost(
        path: str, body: dict[str, Any], at_least: int, sim: SimFactory,
        gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    """The reservation shows in the tpm bucket: ``x-ratelimit-remaining-tokens`` right
    after the charge at admission."""
    backend = await sim(profile="instant", max_model_len=CONTEXT)
    gw = await gateway([backend], api_keys=TPM_KEYS)
    status, answer, headers = await call(http, "POST", gw.url + path, key="sk-tpm",
                                         json={"model": MODEL, **body})
    assert status == 200, answer
    reserved = TPM - int(headers["x-ratelimit-remaining-tokens"])
    assert reserved >= at_least, f"{path} {sorted(body)}: reserved {reserved} < {at_least}"
    real = answer["usage"]["total_tokens"]
    assert reserved >= real, f"{path} {sorted(body)}: reserved {reserved} < real {real}"


async def test_a_batch_line_beyond_the_models_context_is_refused_at_upload(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession,
        tmp_path: Any) -> None:
    backend = await sim(profile="instant", max_model_len=4096)
    gw = await gateway([backend], data_dir=tmp_path)
    handle = gw.services.pool.handles["b0"]
    assert handle.card.read and gw.services.pool.max_model_len(MODEL) == 4096
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": CHAT,
              "body": {"model": MODEL, "messages": HI, "max_tokens": tokens}}
             for i, tokens in enumerate((4, 5000, 4))]
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", "\n".join(json.dumps(x) for x in lines).encode(),
                   filename="in.jsonl")
    status, answer, _ = await call(http, "POST", gw.url + "/v1/files", data=form)
    message = assert_error(answer, type_="invalid_request_error", param="file")
    assert status == 400, answer
    assert "line 2:" in message and "context length (4096 tokens)" in message, message
    assert "line 1:" not in message and "line 3:" not in message, message
    status, listed, _ = await call(http, "GET", gw.url + "/v1/files")
    assert status == 200 and listed["data"] == [], listed  # the file was not kept


@pytest.mark.parametrize("prompt", ["😀" * 9000, "漢" * 12000, [[7] * 9000]],
                         ids=["emoji", "cjk", "token ids"])
async def test_many_tokens_per_character_do_not_pass_for_short(
        prompt: Any, sim: SimFactory, gateway: GatewayFactory,
        http: aiohttp.ClientSession) -> None:
    """A short pool (prompts up to 8,192) and a long one: each prompt, more than 8,192
    tokens as the simulator tokenizes it, must run on the long pool."""
    short = await sim(profile="instant", max_model_len=32768)
    long_ = await sim(profile="instant", max_model_len=32768)
    gw = await gateway([short, long_], backend_options={
        "b0": {"max_prompt_tokens": 8192}, "b1": {"min_prompt_tokens": 8193}})
    status, answer, _ = await call(http, "POST", gw.url + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert status == 200, answer
    real = answer["usage"]["prompt_tokens"]
    assert real > 8192, f"the prompt is {real} tokens: not a long one"
    served = {"short": len(short.engine.records), "long": len(long_.engine.records)}
    assert served == {"short": 0, "long": 1}, f"a prompt of {real} tokens ran on {served}"
