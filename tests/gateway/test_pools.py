"""Length-aware pools and the prefill-token gate end to end: the official ``openai`` SDK
through one gateway to simulated vLLM backends on loopback, on a real Redis.

- A short-context backend and a ``long_context`` one of the same model: every prompt runs
  on the backend whose range holds it (the sims' own records say where each ran); a
  prompt none takes is a 400 ``context_length_exceeded`` naming the ranges, never queued;
  with the long pool down a long prompt gets a 503 at once while short ones are served.
- The prefill-token gate: a burst of long prompts is sent so that the backend never has
  more uncached prompt tokens waiting for prefill than the class's
  ``max_waiting_prefill_tokens``; the same burst with the gate off (0) piles up there.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from gateway.http.server import GatewayServer
from loadtest.sim.server import SimServer
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, store_is_idle, until

SHORT_MAX = 600


def prompt(i: int, tokens: int) -> str:
    # ≈ ``tokens`` simulator tokens (4 bytes each), distinct from the first block on so
    # the sims' prefix caches share nothing between requests
    head = f"req-{i:05d} "
    return head + "word" * max(0, tokens - len(head) // 4)


# b0 the short-context pool, b1 the long_context one
POOLS: dict[str, dict[str, Any]] = {
    "b0": {"max_prompt_tokens": SHORT_MAX},
    "b1": {"min_prompt_tokens": SHORT_MAX + 1, "pool": "long_context"}}


def client(gw: GatewayServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-app", max_retries=0)


async def chat(c: openai.AsyncOpenAI, i: int, tokens: int, max_tokens: int = 4) -> None:
    await c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt(i, tokens)}],
        max_tokens=max_tokens, user=f"u{i % 4}", extra_body={"ignore_eos": True})


def prompt_sizes(sim: SimServer) -> list[int]:
    return sorted(r.prompt_tokens for r in sim.engine.records.values())


async def test_every_prompt_runs_on_the_pool_its_length_fits(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    short, long = await sim(), await sim()
    gw = await gateway([short, long], backend_options=POOLS)
    c = client(gw)
    try:
        await asyncio.gather(*(chat(c, i, 100 if i % 3 else 2000) for i in range(18)))
    finally:
        await c.close()
    assert len(prompt_sizes(short)) == 12 and max(prompt_sizes(short)) <= SHORT_MAX
    assert len(prompt_sizes(long)) == 6 and min(prompt_sizes(long)) > SHORT_MAX


async def test_a_prompt_no_backend_takes_is_refused_before_queueing(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    a, b = await sim(), await sim()
    short_only = {"max_prompt_tokens": SHORT_MAX}
    gw = await gateway([a, b], backend_options={"b0": short_only, "b1": short_only})
    c = client(gw)
    try:
        with pytest.raises(openai.BadRequestError) as err:
            await chat(c, 1, 3000)
        await chat(c, 2, 100)  # a short one is served
    finally:
        await c.close()
    body = err.value.body
    assert isinstance(body, dict)
    assert err.value.code == "context_length_exceeded" and body["param"] == "messages"
    assert f"0–{SHORT_MAX}" in body["message"] and "about 30" in body["message"]
    assert len(a.engine.records) + len(b.engine.records) == 1  # the long one reached none
    await store_is_idle(gw)


async def test_with_the_long_pool_down_long_prompts_get_a_503_and_never_the_short_pool(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    short, long = await sim(), await sim()
    gw = await gateway([short, long], backend_options=POOLS)
    await long.stop()
    await until(lambda: not gw.services.pool.handles["b1"].healthy, "long pool unhealthy")
    c = client(gw)
    try:
        with pytest.raises(openai.InternalServerError) as err:
            await chat(c, 1, 2000)
        await chat(c, 2, 100)
    finally:
        await c.close()
    assert err.value.status_code == 503 and err.value.code == "no_healthy_backend"
    assert "(those that do: b1)" in err.value.message
    assert prompt_sizes(short) and max(prompt_sizes(short)) <= SHORT_MAX
    await store_is_idle(gw)


def peak_waiting_prefill(sim: SimServer) -> int:
    """The most prompt tokens the engine had waiting for their first schedule (queued
    at it, not yet prefilling) when a request arrived there."""
    records = list(sim.engine.records.values())
    peak = 0
    for r in records:
        waiting = sum(o.prompt_tokens - o.cached_tokens for o in records
                      if o is not r and o.arrival_s <= r.arrival_s
                      and (o.first_scheduled_s is None or o.first_scheduled_s > r.arrival_s))
        peak = max(peak, waiting)
    return peak


async def burst_peak(sim: SimFactory, gateway: GatewayFactory, limit: int) -> int:
    # a small per-step token budget: each 1,000-token prompt takes several steps to
    # prefill, so prompts sent together wait at the engine
    backend = await sim(max_num_batched_tokens=128)
    gw = await gateway([backend], pacing="fixed", classes={
        "interactive": {"max_waiting": 8, "max_waiting_prefill_tokens": limit}})
    c = client(gw)
    try:
        await asyncio.gather(*(chat(c, i, 1000) for i in range(8)))
        await store_is_idle(gw)
    finally:
        await c.close()
        await gw.stop()  # the next gateway shares the Redis
    assert len(backend.engine.records) == 8
    return peak_waiting_prefill(backend)


async def test_the_prefill_gate_bounds_the_backends_waiting_prompt_tokens(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    limit = 1500
    gated = await burst_peak(sim, gateway, limit)
    ungated = await burst_peak(sim, gateway, 0)
    assert gated <= limit, gated
    assert ungated > 3 * limit, ungated  # the same burst, counted in requests only


async def test_operators_see_the_pending_prefill_and_the_gate_it_fills(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    # one sequence at a time: a 2,000-token prompt waits at the engine behind a long answer
    backend = await sim(max_num_seqs=1)
    gw = await gateway([backend], admin_keys=["sk-admin"], backend_options={
        "b0": {"max_prompt_tokens": 50_000, "pool": "rag"}},
        classes={"interactive": {"max_waiting_prefill_tokens": 1000}})
    c = client(gw)
    admin = {"Authorization": "Bearer sk-admin"}

    async def b0() -> dict[str, Any]:
        async with aiohttp.ClientSession() as http:
            async with http.get(gw.url + "/admin/backends", headers=admin) as resp:
                data: dict[str, Any] = await resp.json()
        (entry,) = data["data"]
        return entry

    async def gauge() -> float:
        async with aiohttp.ClientSession() as http:
            async with http.get(gw.url + "/metrics") as resp:
                text = await resp.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('fairgate_backend_pending_prefill_tokens{backend="b0"}'))

    try:
        blocker = asyncio.create_task(chat(c, 0, 10, max_tokens=400))
        await until(lambda: len(backend.engine.records) == 1, "the blocker running")
        long = asyncio.create_task(chat(c, 1, 2000))
        await until(lambda: len(backend.engine.records) == 2, "the long prompt waiting")
        entry = await b0()
        assert 1900 <= entry["prefill"]["pending_tokens"] <= 2100
        assert entry["prefill"]["limits"]["interactive"] == 1000
        assert entry["gates"]["interactive"]["reason"] == "prefill_tokens"
        assert entry["pool"] == "rag" and entry["prompt_tokens"] == {"min": 0, "max": 50_000}
        await until(lambda: gauge_above(gauge, 1900), "the gauge shows it")
        await asyncio.gather(blocker, long)
        entry = await b0()
        assert entry["prefill"]["pending_tokens"] == 0
        assert entry["gates"]["interactive"]["reason"] != "prefill_tokens"
    finally:
        await c.close()


async def gauge_above(read: Any, floor: float) -> bool:
    return bool(await read() >= floor)
