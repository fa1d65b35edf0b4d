"""vLLM's pooling scorers through fairgate: ``/rerank`` (``/v1/rerank``, ``/v2/rerank``)
and ``/score`` (``/v1/score``), each an entry of the endpoint table with its prompt
reader. Served by the simulator on loopback over a real Redis: queued fairly, charged
what vLLM reports, refused OpenAI-style when the body is wrong, taken by the Batch API."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import openai
import pytest

from gateway.proxy.completion_request import parse_body
from gateway.proxy.endpoints import RERANKS, SCORES, Endpoint
from gateway.scheduling.admission import estimate
from gateway.storage.keys import ModelKeys
from loadtest.sim.scoring import parse_rerank, parse_score
from loadtest.sim.server import SimServer
from policies.cost import max_cost_tokens, prompt_token_bound
from tests.batch.test_batch_api import wait_status
from tests.gateway.conftest import (
    KEYS,
    MODEL,
    GatewayFactory,
    SimFactory,
    assert_error,
    call,
)

ADMIN = "sk-admin"
QUERY = "which queue is fair"
DOCS = ["a fair queue serves each user in turn", "bananas", "queues, fairly: which is fair"]
BODIES = {"rerank": {"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 2},
          "score": {"model": MODEL, "text_1": QUERY, "text_2": DOCS}}
BUDGETED = [*KEYS, {"key": "sk-tight", "user": "tia", "limits": {"daily_tokens": 60}},
            {"key": "sk-spend", "user": "sam", "limits": {"daily_tokens": 100_000}}]


def body_of(endpoint: Endpoint) -> dict[str, Any]:
    return BODIES["rerank" if endpoint in RERANKS else "score"]


def pair_records(backend: SimServer) -> list[Any]:
    return sorted(backend.engine.records.values(), key=lambda r: r.arrival_s)


@pytest.mark.parametrize("endpoint", [*RERANKS, *SCORES], ids=lambda e: e.path)
def test_the_estimate_and_the_bound_read_every_pair(endpoint: Endpoint) -> None:
    """The query is read once per document: the estimate counts it that often, and the
    reservation's bound is never below what the backend reports."""
    body = body_of(endpoint)
    creq = parse_body(body, endpoint)
    pairs = [(QUERY, d) for d in DOCS]
    chars = sum(len(q) + len(d) for q, d in pairs)
    assert estimate(creq) >= chars // 4, (estimate(creq), chars)
    sim = (parse_rerank if endpoint in RERANKS else parse_score)(
        body, headers_priority=None, model_len=100_000)
    assert prompt_token_bound(creq.prompt) >= sim.prompt_tokens, (
        prompt_token_bound(creq.prompt), sim.prompt_tokens)
    assert max_cost_tokens(creq.prompt, creq.output, 100_000) == prompt_token_bound(
        creq.prompt), "no output tokens: a scorer costs its prompt"
    assert not creq.output.produces and not creq.stream


async def test_every_path_is_served_queued_and_charged(sim: SimFactory, gateway: GatewayFactory,
                                                       http: aiohttp.ClientSession) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], api_keys=BUDGETED, admin_keys=[ADMIN])
    spent = 0
    for endpoint in (*RERANKS, *SCORES):
        status, got, headers = await call(http, "POST", gw.url + endpoint.path,
                                          key="sk-spend", json=body_of(endpoint))
        assert status == 200, (endpoint.path, got)
        assert "X-Fairgate-Queue-Wait-Ms" in headers, (endpoint.path, dict(headers))
        if endpoint in RERANKS:
            assert set(got) == {"id", "model", "usage", "results"}, got
            # best first: the document holding most of the query's words
            assert got["results"][0]["index"] == 2, got
            assert len(got["results"]) == 2, got  # top_n
        else:
            assert got["object"] == "list" and [d["index"] for d in got["data"]] == [0, 1, 2]
        assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] > 0, got
        spent += got["usage"]["prompt_tokens"]
    paths = len(RERANKS) + len(SCORES)
    assert len(backend.engine.records) == paths * len(DOCS)  # a pooled request per pair
    # the key's budget and the usage ledger hold exactly what vLLM reported
    status, usage, _ = await call(http, "GET", gw.url + "/v1/fairgate/usage", key="sk-spend")
    assert status == 200, usage
    assert usage["limits"][0]["daily_tokens_used"] == spent, (usage, spent)
    status, ledger, _ = await call(http, "GET", gw.url + "/admin/usage?group_by=user",
                                   key=ADMIN)
    assert status == 200, ledger
    (row,) = [r for r in ledger["data"] if r["user"] == "sam"]
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"],
            row["errors"]) == (paths, spent, 0, 0), (row, spent)


async def test_a_rerank_over_the_budget_is_refused_before_the_queue(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    """What it reserves is its pairs' bound: 3 documents of the query exceed 60 tokens."""
    backend = await sim(profile="instant")
    gw = await gateway([backend], api_keys=BUDGETED)
    status, got, _ = await call(http, "POST", gw.url + "/v1/rerank", key="sk-tight",
                                json=BODIES["rerank"])
    assert status == 429, got
    assert_error(got, type_="insufficient_quota", code="insufficient_quota")
    assert backend.engine.records == {}, backend.engine.records
    one = {"model": MODEL, "query": "fair", "documents": ["yes"]}
    status, got, _ = await call(http, "POST", gw.url + "/rerank", key="sk-tight", json=one)
    assert status == 200, got  # a small one fits
    status, usage, _ = await call(http, "GET", gw.url + "/v1/fairgate/usage", key="sk-tight")
    assert usage["limits"][0]["daily_tokens_used"] == got["usage"]["prompt_tokens"], usage


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/rerank", {"query": QUERY, "documents": DOCS}, "model"),
    ("/v1/rerank", {"model": MODEL, "documents": DOCS}, "query"),
    ("/v1/rerank", {"model": MODEL, "query": 5, "documents": DOCS}, "query"),
    ("/v1/rerank", {"model": MODEL, "query": ["a", "b"], "documents": DOCS}, "query"),
    ("/rerank", {"model": MODEL, "query": QUERY}, "documents"),
    ("/rerank", {"model": MODEL, "query": QUERY, "documents": []}, "documents"),
    ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": [1, 2]}, "documents"),
    ("/v2/rerank", {"model": MODEL, "query": QUERY, "documents": [{"text": "x"}]},
     "documents"),
    ("/v1/rerank", {**BODIES["rerank"], "stream": True}, "stream"),
    ("/v1/score", {"model": MODEL, "text_1": ["a", "b"], "text_2": DOCS}, "text_1"),
    ("/v1/score", {"model": MODEL}, "text_1"),
    ("/score", {"model": MODEL, "queries": QUERY, "items": 7}, "items"),
    ("/score", {"model": MODEL, "data_1": [], "data_2": DOCS}, "data_1"),
])
async def test_bad_bodies_answer_openai_400s(sim: SimFactory, gateway: GatewayFactory,
                                             http: aiohttp.ClientSession, path: str,
                                             body: dict[str, Any], param: str) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend])
    status, got, _ = await call(http, "POST", gw.url + path, json=body)
    assert status == 400, (path, body, got)
    assert_error(got, type_="invalid_request_error", param=param)
    assert backend.engine.records == {}, backend.engine.records  # never forwarded


async def test_a_flood_of_reranks_is_queued_fairly(sim: SimFactory, gateway: GatewayFactory,
                                                   redis: Any) -> None:
    """Alice floods reranks; Bob's one rerank, queued after all of hers, starts after
    only the few of hers the backend held (as the chat flood's newcomers do,
    tests/gateway/test_scheduling.py): reranks go through the fair queue, not around it."""
    flood, docs = 60, 2
    backend = await sim(max_num_seqs=2, max_num_batched_tokens=256)
    gw = await gateway([backend])
    alice = {"model": MODEL, "query": "q" * 400, "documents": ["a" * 1600] * docs}
    bob = {"model": MODEL, "query": "b" * 400, "documents": ["c" * 1200]}
    bob_pair = 100 + 300 + 3  # tokens of Bob's pair at the simulator: his records' mark
    async with aiohttp.ClientSession() as http:
        async def rerank(key: str, body: dict[str, Any]) -> float:
            status, got, _ = await call(http, "POST", gw.url + "/v1/rerank", key=key,
                                        json=body)
            assert status == 200, got
            return time.monotonic()

        floods = [asyncio.create_task(rerank("sk-alice", alice)) for _ in range(flood)]
        await backend.engine.wait_until(lambda: len(backend.engine.records) >= 2)
        keys = ModelKeys(MODEL)
        bobs = asyncio.create_task(rerank("sk-bob", bob))
        deadline = time.monotonic() + 60
        while not (await redis.llen(keys.queue("interactive", "bob")) > 0 or any(
                r.prompt_tokens == bob_pair for r in backend.engine.records.values())):
            assert time.monotonic() < deadline, "Bob's rerank never queued"
            await asyncio.sleep(0.005)  # Redis offers no event for a list's length
        ahead = sum(1 for r in backend.engine.records.values()
                    if r.first_scheduled_s is not None)
        await asyncio.gather(*floods, bobs)
    order = [r.prompt_tokens for r in sorted(
        backend.engine.records.values(), key=lambda r: r.first_scheduled_s or float("inf"))]
    assert len(order) == flood * docs + 1, len(order)  # each pair reached vLLM once
    before_bob = order.index(bob_pair)
    # Alice's pairs started by then, and those of her reranks the backend held (2 running,
    # 3 waiting) or in flight to it (a burst of 3), 2 pairs each
    bound = ahead + docs * (2 + 3 + 3)
    assert before_bob <= bound, (before_bob, bound, ahead)
    assert bound < flood * docs // 2, ("the flood must be long enough to tell", bound)


async def test_the_batch_api_takes_rerank_and_score_lines(sim: SimFactory,
                                                          gateway: GatewayFactory,
                                                          tmp_path: Any) -> None:
    """vLLM's batch runner takes any url ending in /rerank or /score: so does fairgate's."""
    backend = await sim(profile="instant")
    gw = await gateway([backend], data_dir=tmp_path, batch_poll_s=0.05)
    c = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-batch", max_retries=0)
    try:
        for endpoint in (RERANKS[0], SCORES[0]):
            lines = [json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                 "url": endpoint.path, "body": body_of(endpoint)})
                     for i in range(3)]
            f = await c.files.create(file=("in.jsonl", "\n".join(lines).encode()),
                                     purpose="batch")
            batch = await c.batches.create(input_file_id=f.id,
                                           endpoint=endpoint.path,  # type: ignore[arg-type]
                                           completion_window="24h")
            done = await wait_status(c, batch.id, {"completed", "failed", "expired"})
            assert done.status == "completed", done
            assert done.request_counts is not None and done.request_counts.completed == 3
            out = [json.loads(x) for x in
                   (await c.files.content(done.output_file_id or "")).text.splitlines()]
            bodies = [x["response"]["body"] for x in out]
            key = "results" if endpoint in RERANKS else "data"
            assert all(len(b[key]) == (2 if key == "results" else 3) for b in bodies), bodies
            assert all(b["usage"]["prompt_tokens"] > 0 for b in bodies), bodies
    finally:
        await c.close()
