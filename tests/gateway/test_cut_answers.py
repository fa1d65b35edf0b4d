"""A whole (non-streamed) answer cut before it came — its client hung up, or
``upstream_timeout_s`` fired — is charged its bound (prompt bound + output bound), the
most its backend can have generated before it aborted it: hanging up never evades a
budget, the tpm bucket or the fairness counter. End to end: the openai SDK, a real Redis,
the simulator's own count of the tokens it generated."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from gateway.http.server import GatewayServer
from gateway.proxy.completion_request import parse_body
from gateway.proxy.endpoints import COMPLETIONS
from loadtest.sim.server import SimServer
from policies.cost import prompt_token_bound
from policies.fairness import Vtc
from tests.gateway.conftest import (
    KEYS,
    MODEL,
    GatewayFactory,
    SimFactory,
    call,
    store_is_idle,
    until,
)
from tests.gateway.test_cache_cost import user_score

PROMPT = "tell me a long story"
OUTPUT = 1500
BOUND = prompt_token_bound(parse_body({"model": MODEL, "prompt": PROMPT}, COMPLETIONS).prompt
                           ) + OUTPUT  # what each one reserves
CUTTER = {"key": "sk-cut", "user": "cutter", "limits": {"daily_tokens": 5000}}
TPM = {"key": "sk-tpm", "user": "tpm", "limits": {"tpm": 2000}}


def sdk(gw: GatewayServer, key: str, timeout_s: float | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0,
                              timeout=timeout_s)


async def generated(backend: SimServer) -> int:
    """The tokens the simulated backend generated, from its own /metrics."""
    async with aiohttp.ClientSession() as http, http.get(backend.url + "/metrics") as resp:
        text = await resp.text()
    return int(sum(s.value for family in text_string_to_metric_families(text)
                   for s in family.samples if s.name == "vllm:generation_tokens_total"))


async def limits_of(gw: GatewayServer, key: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        status, usage, _ = await call(http, "GET", gw.url + "/v1/fairgate/usage", key=key)
    assert status == 200, usage
    (scope,) = usage["limits"]
    return dict(scope)


async def settled(gw: GatewayServer, backend: SimServer) -> None:
    """Every cut request aborted in the engine and settled in the gateway."""
    await until(lambda: backend.engine.num_running == 0 and backend.engine.num_waiting == 0,
                "the backend aborted the cut requests")
    await store_is_idle(gw)


async def test_hanging_up_on_whole_answers_never_evades_the_budget(
        sim: SimFactory, gateway: GatewayFactory, redis: Any) -> None:
    """The probe: non-streamed 1,500-token completions, each abandoned by the SDK's timeout
    while the backend generates. Each is charged its bound, so the 5,000-token day holds
    three; the fourth is refused ``insufficient_quota``, and the day's usage (and the
    fairness counter) covers every token the backend generated. Before: each was charged
    its prompt estimate (usage 16 for thousands of tokens generated)."""
    backend = await sim()  # H100 pace: 1,500 tokens take about 7 s
    gw = await gateway([backend], api_keys=[*KEYS, CUTTER])
    client = sdk(gw, "sk-cut", timeout_s=1.0)
    cut, refused = 0, None
    try:
        for _ in range(8):
            try:
                await client.completions.create(model=MODEL, prompt=PROMPT,
                                                max_tokens=OUTPUT,
                                                extra_body={"ignore_eos": True})
                raise AssertionError("a 1,500-token answer came within the 1 s timeout")
            except openai.APITimeoutError:
                cut += 1
                await settled(gw, backend)
            except openai.RateLimitError as exc:
                refused = exc
                break
    finally:
        await client.close()
    made = await generated(backend)
    scope = await limits_of(gw, "sk-cut")
    used = scope["daily_tokens_used"]
    assert refused is not None and refused.code == "insufficient_quota", (
        f"never refused after {cut} cut answers: {used} of 5000 used, {made} generated")
    assert cut == 5000 // BOUND, f"{cut} cut answers admitted, each reserving {BOUND}"
    assert made > 0 and used >= made, f"usage {used} below the {made} tokens generated"
    assert used == cut * BOUND, f"charged {used}, not {cut} x the bound {BOUND}"
    # the fairness counter too: at least the service of every token generated
    score = await user_score(redis, "default", "cutter")
    assert score >= Vtc().service(0, made, 1.0), f"fairness counter {score}, {made} made"


async def test_a_whole_answer_cut_by_upstream_timeout_is_charged_its_bound(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """``upstream_timeout_s`` cuts a non-streamed answer (vLLM sends nothing until it is
    done): its client gets a 502 and its key is charged the bound, not 0; it is not sent
    again elsewhere (it would be cut the same, generating as much again). The tpm bucket
    holds the charge: the next such request waits for it to refill."""
    backend = await sim()
    gw = await gateway([backend], api_keys=[*KEYS, TPM], upstream_timeout_s=1.0)
    client = sdk(gw, "sk-tpm")
    try:
        try:
            answer = await client.completions.create(model=MODEL, prompt=PROMPT,
                                                     max_tokens=OUTPUT,
                                                     extra_body={"ignore_eos": True})
            raise AssertionError(f"answered despite the 1 s upstream timeout: {answer.usage}")
        except openai.APIStatusError as exc:
            assert exc.status_code == 502, exc
        await settled(gw, backend)
        made = await generated(backend)
        charged = 2000 - (await limits_of(gw, "sk-tpm"))["tokens_remaining"]
        # less what the bucket refilled since (33 tokens a second; 6 s allowed)
        assert made > 0 and charged >= max(made, BOUND - 200), (
            f"tpm charged {charged} for a cut answer that generated {made}")
        # one attempt only: the answer was not sent again after the timeout
        assert made <= OUTPUT, f"{made} tokens generated: sent again after the timeout"
        try:
            answer = await client.completions.create(model=MODEL, prompt=PROMPT,
                                                     max_tokens=OUTPUT)
            raise AssertionError(f"a second request fit the charged bucket: {answer.usage}")
        except openai.RateLimitError as exc:
            assert exc.code == "rate_limit_exceeded", exc
    finally:
        await client.close()


async def test_an_unbounded_request_overdraws_tpm_by_itself_alone(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """A request without ``max_tokens`` reserves the model's context (here 400 tokens; vLLM
    generates at most that) plus its prompt's bound, which exceeds the 300-token tpm
    bucket: it is admitted only with a full bucket, and while it runs the bucket is
    below zero, so no other request of the key joins it. It may overdraw the minute by
    what it alone generates; that debt stays in the bucket (the next request waits for
    it): tokens spent never exceed tpm per minute plus one request."""
    backend = await sim(max_model_len=400)  # H100 pace: about 2 s for the whole context
    gw = await gateway([backend], api_keys=[*KEYS, {"key": "sk-tpm", "user": "tpm",
                                                    "limits": {"tpm": 300}}])
    client = sdk(gw, "sk-tpm")
    try:
        await until(lambda: gw.services.pool.max_model_len(MODEL) == 400,
                    "the backend's context length read")
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go on"}], stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = stream.__aiter__()
        await chunks.__anext__()  # running
        try:
            other = await client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            raise AssertionError(f"admitted beside the unbounded request: {other.usage}")
        except openai.RateLimitError as exc:
            assert exc.code == "rate_limit_exceeded", exc
        total = 0
        async for chunk in chunks:
            if chunk.usage is not None:
                total = chunk.usage.total_tokens
        assert total > 300, f"the unbounded request used {total}, not more than the tpm"
        await store_is_idle(gw)  # settled: its reservation corrected to what it used
        scope = await limits_of(gw, "sk-tpm")
        # the debt is kept: the bucket is empty and refills past a minute from now
        assert scope["tokens_remaining"] == 0 and scope["tokens_reset_s"] > 60, scope
        # and it is one request's: the level is what refilled since, less its overdraw
        owed = (scope["tokens_reset_s"] - 60) * 300 / 60
        assert owed <= total - 300 + 1, f"owes {owed} after one request of {total}"
    finally:
        await client.close()
