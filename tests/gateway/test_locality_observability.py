"""What operators see of routing: locality: per backend, vLLM's own prefix cache hit rate
(from its counters) beside the rate the prefix index predicted at dispatch, and every
dispatch counted by its reason, in /metrics and in the read model (dashboard, admin API)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, assert_settled, until
from tests.gateway.test_locality import counter, system_prompt

SESSIONS = 4
TURNS = 3


async def chat_sessions(base_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="sk-app", max_retries=0)

    async def session(i: int) -> None:
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": system_prompt(i)}]
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Question {turn} of session {i}?"})
            answer = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, user=f"s{i}",
                extra_body={"ignore_eos": True})
            messages.append({"role": "assistant",
                             "content": answer.choices[0].message.content or ""})

    try:
        await asyncio.gather(*(session(i) for i in range(SESSIONS)))
    finally:
        await client.close()


async def gateway_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def by_label(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
             label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), value in samples.items():
        if n == name:
            key = dict(labels)[label]
            out[key] = out.get(key, 0.0) + value
    return out


async def test_locality_exports_vllm_and_predicted_hit_rates_and_decision_reasons(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    sims = [await sim(max_num_seqs=2) for _ in range(2)]
    # a window longer than the test: the recent hit rate is then the sims' lifetime one
    gw = await gateway(sims, routing="locality", tpot_window_s=3600.0)
    await chat_sessions(gw.url)
    await assert_settled(gw)

    samples = await gateway_samples(gw.url)
    reasons = by_label(samples, "fairgate_dispatch_decisions_total", "reason")
    # each session's first turn: nothing cached anywhere; its later turns: where it went
    assert reasons.get("fairness_order") == SESSIONS
    assert reasons.get("cache_hit", 0) + reasons.get("load", 0) == SESSIONS * (TURNS - 1)
    assert reasons.get("cache_hit", 0) >= SESSIONS
    predicted = by_label(samples, "fairgate_prefix_predicted_blocks_total", "kind")
    assert 0 < predicted["hit"] < predicted["query"]

    async with aiohttp.ClientSession() as http:
        truth = {f"b{i}": (await counter(http, s.url, "vllm:prefix_cache_hits_total"),
                           await counter(http, s.url, "vllm:prefix_cache_queries_total"))
                 for i, s in enumerate(sims)}
    pool = gw.services.pool

    def scraped_after_the_run() -> bool:
        return all(pool.handles[name].prefix_hit_ratio == (hits / queries if queries else None)
                   for name, (hits, queries) in truth.items())

    await until(scraped_after_the_run, "the backends' hit rates from their own counters")
    assert any(hits > 0 for hits, _ in truth.values())
    samples = await gateway_samples(gw.url)
    for name, (hits, queries) in truth.items():
        if queries:
            key = ("fairgate_backend_prefix_cache_hit_ratio", (("backend", name),))
            assert samples[key] == hits / queries

    view = await gw.services.inspector.backends(MODEL, time.time())
    assert sum(sum(b["dispatch_reasons"].values()) for b in view) == SESSIONS * TURNS
    assert {r for b in view for r in b["dispatch_reasons"]} <= {"cache_hit", "load",
                                                               "fairness_order"}
    for b in view:
        hits, queries = truth[b["name"]]
        assert b["prefix_cache"]["hit_ratio"] == (hits / queries if queries else None)
    assert any((b["prefix_cache"]["predicted_hit_ratio"] or 0) > 0 for b in view)


async def test_least_loaded_dispatches_by_load_and_predicts_nothing(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    gw = await gateway([await sim()], routing="least_loaded")
    await chat_sessions(gw.url)
    samples = await gateway_samples(gw.url)
    assert by_label(samples, "fairgate_dispatch_decisions_total", "reason") == {
        "load": SESSIONS * TURNS}
    assert by_label(samples, "fairgate_prefix_predicted_blocks_total", "kind") == {}
    view = await gw.services.inspector.backends(MODEL, time.time())
    assert view[0]["prefix_cache"]["predicted_hit_ratio"] is None
    assert view[0]["dispatch_reasons"] == {"load": SESSIONS * TURNS}


async def test_the_default_routes_two_backends_by_locality_and_one_by_load(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """No ``routing:`` line (``auto``): a model with two backends routes by locality (its
    sessions' later turns are dispatched as cache hits, the index predicts blocks), a
    model with one has nothing to choose and routes by load (no prompt is hashed)."""
    two = await gateway([await sim(), await sim()])
    assert two.services.settings.routing.mode == "auto"
    await chat_sessions(two.url)
    reasons = by_label(await gateway_samples(two.url), "fairgate_dispatch_decisions_total",
                       "reason")
    # every later turn finds its session's prefix where its earlier turns went
    assert reasons.get("cache_hit", 0) >= SESSIONS * (TURNS - 1), reasons
    assert "load" not in reasons or reasons["load"] < SESSIONS, reasons
    await assert_settled(two)
    await two.stop()  # the next gateway shares the Redis
    one = await gateway([await sim()])
    await chat_sessions(one.url)
    samples = await gateway_samples(one.url)
    assert by_label(samples, "fairgate_dispatch_decisions_total", "reason") == {
        "load": SESSIONS * TURNS}, samples
    assert by_label(samples, "fairgate_prefix_predicted_blocks_total", "kind") == {}
