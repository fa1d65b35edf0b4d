"""routing: locality end to end: chat sessions with distinct long system prompts, through
one gateway to three simulated vLLM backends, hit each backend's prefix cache far more than
with least_loaded in the same test (vLLM's own counters, read from the sims' /metrics)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import redis.asyncio as aioredis
from openai.types.chat import ChatCompletionMessageParam

from gateway.storage.keys import ModelKeys
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, assert_settled, until

SESSIONS = 12
TURNS = 4
# Blind routing finds a session's prefix where an earlier turn left it by chance: with
# two backends its turns hit 0, 1/2, 3/4, 7/8 of the time, so its hits came within 1.2×
# of locality's on a loaded run (67,616 against 78,768). With three: 0, 1/3, 5/9, 19/27
# (locality: 0, 1, 1, 1): hit rates 0.37–0.39 against 0.74 on three loaded runs, but
# up to 0.55 on others (see the test).
BACKENDS = 3


def system_prompt(session: int) -> str:
    # ≈ 1,500 tokens, distinct from its first characters on
    return f"Session {session:03d}. You are assistant number {session} of the help desk. " \
        + " ".join(f"rule-{session}-{i}: answer in the house style." for i in range(220))


async def run_sessions(base_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="sk-app", max_retries=0)

    async def session(i: int) -> None:
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": system_prompt(i)}]
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Question {turn} of session {i}?"})
            answer = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=16, user=f"s{i}",
                extra_body={"ignore_eos": True})
            messages.append({"role": "assistant",
                             "content": answer.choices[0].message.content or ""})

    try:
        await asyncio.gather(*(session(i) for i in range(SESSIONS)))
    finally:
        await client.close()


async def counter(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def hits_and_queries(sims: list[Any]) -> tuple[float, float]:
    async with aiohttp.ClientSession() as http:
        hits = [await counter(http, s.url, "vllm:prefix_cache_hits_total") for s in sims]
        queries = [await counter(http, s.url, "vllm:prefix_cache_queries_total") for s in sims]
    return sum(hits), sum(queries)


async def measure(sim: SimFactory, gateway: GatewayFactory, routing: str) -> tuple[float, float]:
    # small backends, saturated by the sessions: requests queue in the gateway, and a
    # backend that frees a slot chooses among them
    sims = [await sim(max_num_seqs=2) for _ in range(BACKENDS)]
    gw = await gateway(sims, routing=routing, pacing="fixed",
                       classes={"interactive": {"max_waiting": 1}})
    try:
        await run_sessions(gw.url)
        await assert_settled(gw)
    finally:
        await gw.stop()  # the next gateway shares the Redis: this one must not dispatch
    return await hits_and_queries(sims)


async def test_locality_keeps_sessions_on_their_cached_prefix(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    blind_hits, blind_queries = await measure(sim, gateway, "least_loaded")
    local_hits, local_queries = await measure(sim, gateway, "locality")
    blind_rate, local_rate = blind_hits / blind_queries, local_hits / local_queries
    print(f"prefix hit rate: least_loaded {blind_rate:.2f}, locality {local_rate:.2f}")
    assert local_queries > 0 and blind_queries > 0
    # computed prompt tokens (queries − hits) clearly lower with locality
    seen = (f"hits/queries: least_loaded {blind_hits:.0f}/{blind_queries:.0f}, "
            f"locality {local_hits:.0f}/{local_queries:.0f}")
    # every turn after a session's first finds its prefix (at most (TURNS-1)/TURNS of the
    # tokens hit: 0.74 in every run). Blind routing's hits are luck, and more than the
    # chance above: a turn follows its previous one at once, into the slot that one just
    # freed, often on the same backend (0.35-0.55 over seven runs): compared to it, only
    # the computed tokens are asserted, with room for that luck
    assert local_rate >= 0.9 * (TURNS - 1) / TURNS, seen
    assert local_hits > blind_hits, seen
    assert local_queries - local_hits < 0.75 * (blind_queries - blind_hits), seen


async def test_a_backend_back_from_failed_scrapes_loses_its_prefix_index(
        sim: SimFactory, gateway: GatewayFactory, redis: aioredis.Redis) -> None:
    """A backend that went unhealthy may have restarted with an empty cache: its first
    good scrape drops its prefix index, for every replica."""
    gw = await gateway([await sim()], routing="locality")
    key = ModelKeys(MODEL).backend_prefixes("b0")
    await redis.zadd(key, {"h1": 1.0})
    pool = gw.services.pool
    handle = pool.handles["b0"]
    for _ in range(gw.services.settings.fleet.unhealthy_after_failures):
        pool.unreachable(handle, ConnectionError("gone"))  # as failed scrapes do
    assert not handle.healthy
    await until(lambda: handle.healthy, "the backend scraped healthy again")
    assert not await redis.exists(key)
