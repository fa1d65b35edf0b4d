"""The simulator's rerank and score endpoints (vLLM 0.32's ``pooling/scoring`` formats)."""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import pytest

from loadtest.sim import tokenizer
from loadtest.sim.scoring import PAIR_SPECIAL_TOKENS
from loadtest.sim.server import SimServer
from tests.sim.conftest import MODEL, ServerFactory

QUERY = "what is fair queueing"
DOCS = ["fair queueing shares a link: what is fair is equal", "bananas are yellow",
        "queueing theory"]


async def post(server: SimServer, path: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(server.url + path,
                                                          json=body) as resp:
        assert resp.content_type == "application/json", resp.content_type
        return resp.status, json.loads(await resp.read())


def pair_tokens(query: str, document: str) -> int:
    return len(tokenizer.encode(query)) + len(tokenizer.encode(document)) + PAIR_SPECIAL_TOKENS


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
async def test_rerank_answers_vllms_rerank_response(server: SimServer, path: str) -> None:
    status, got = await post(server, path, {"model": MODEL, "query": QUERY,
                                            "documents": DOCS})
    assert status == 200, got
    assert set(got) == {"id", "model", "usage", "results"}, got
    assert re.fullmatch(r"score-[0-9a-f]{16}", got["id"]), got["id"]
    assert got["model"] == MODEL
    tokens = sum(pair_tokens(QUERY, d) for d in DOCS)  # the query is read once per document
    assert got["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}, got["usage"]
    results = got["results"]
    assert [set(r) for r in results] == [{"index", "document", "relevance_score"}] * 3
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True), scores  # best first
    assert all(0.0 <= s < 1.0 for s in scores), scores
    assert results[0]["index"] == 0, results  # the document repeating the query ranks first
    for r in results:
        assert r["document"] == {"text": DOCS[r["index"]], "multi_modal": None}, r


async def test_rerank_top_n_and_determinism(make_server: ServerFactory) -> None:
    server = await make_server()
    body = {"model": MODEL, "query": QUERY, "documents": DOCS}
    _, everything = await post(server, "/v1/rerank", body)
    status, top = await post(server, "/v1/rerank", {**body, "top_n": 2})
    assert status == 200 and top["results"] == everything["results"][:2], top
    assert top["usage"] == everything["usage"]  # every document was scored
    _, single = await post(server, "/v1/rerank", {**body, "documents": DOCS[1]})
    assert [r["index"] for r in single["results"]] == [0], single
    assert single["results"][0]["relevance_score"] == next(
        r["relevance_score"] for r in everything["results"] if r["index"] == 1)
    other = await make_server(seed=1)
    _, seeded = await post(other, "/v1/rerank", body)
    assert seeded["results"] != everything["results"]  # the server's seed is in the noise


async def test_rerank_pairs_are_prefill_only_engine_requests(server: SimServer) -> None:
    status, got = await post(server, "/rerank", {"model": MODEL, "query": QUERY,
                                                 "documents": DOCS[:2]})
    assert status == 200, got
    records = list(server.engine.records.values())
    assert len(records) == 2, records
    assert sorted(r.prompt_tokens for r in records) == sorted(
        pair_tokens(QUERY, d) for d in DOCS[:2])
    assert all(r.output_tokens == 1 for r in records), records  # the pooled output


@pytest.mark.parametrize(("sides", "pairs"), [
    (("text_1", "text_2"), [(QUERY, d) for d in DOCS]),
    (("queries", "documents"), [(QUERY, d) for d in DOCS]),
    (("queries", "items"), [(QUERY, d) for d in DOCS]),
    (("data_1", "data_2"), [(QUERY, d) for d in DOCS]),
])
async def test_score_one_to_many(server: SimServer, sides: tuple[str, str],
                                 pairs: list[tuple[str, str]]) -> None:
    first, second = sides
    status, got = await post(server, "/score", {"model": MODEL, first: QUERY,
                                                second: DOCS})
    assert status == 200, got
    assert set(got) == {"id", "object", "created", "model", "data", "usage"}, got
    assert got["object"] == "list" and got["model"] == MODEL
    assert re.fullmatch(r"score-[0-9a-f]{16}", got["id"]), got["id"]
    assert [(d["index"], d["object"]) for d in got["data"]] == [
        (0, "score"), (1, "score"), (2, "score")], got["data"]
    tokens = sum(pair_tokens(q, d) for q, d in pairs)
    assert got["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens,
                            "completion_tokens": 0, "prompt_tokens_details": None,
                            "completion_tokens_details": None}, got["usage"]


async def test_score_many_to_many_pairs_by_position(server: SimServer) -> None:
    queries = ["bananas", "queueing"]
    status, got = await post(server, "/v1/score", {"model": MODEL, "text_1": queries,
                                                   "text_2": DOCS[1:]})
    assert status == 200, got
    scores = [d["score"] for d in got["data"]]
    assert scores[0] > 0.9 and scores[1] > 0.9, scores  # each query with its own document
    assert got["usage"]["prompt_tokens"] == sum(
        pair_tokens(q, d) for q, d in zip(queries, DOCS[1:], strict=True))
    _, rerank = await post(server, "/rerank", {"model": MODEL, "query": "bananas",
                                               "documents": [DOCS[1]]})
    assert rerank["results"][0]["relevance_score"] == scores[0]  # one scorer for both


@pytest.mark.parametrize(("path", "body", "status", "param", "message"), [
    ("/v1/rerank", {"model": MODEL, "documents": DOCS}, 400, "body.query", "Field required"),
    ("/v1/rerank", {"model": MODEL, "query": QUERY}, 400, "body.documents", "Field required"),
    ("/v1/rerank", {"model": MODEL, "query": 5, "documents": DOCS}, 400, "body.query",
     "valid string"),
    ("/v1/rerank", {"model": MODEL, "query": QUERY, "documents": [1]}, 400, "body.documents",
     "valid string"),
    ("/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": -1}, 400,
     "body.top_n", "greater than or equal to 0"),
    ("/v1/rerank", {"model": MODEL, "query": QUERY, "documents": []}, 400, None,
     "At least one text_pair element must be given"),
    ("/v1/rerank", {"model": MODEL, "query": {"content": []}, "documents": DOCS}, 400, None,
     "MultiModalParam is not supported"),
    ("/v1/rerank", {"model": "other", "query": QUERY, "documents": DOCS}, 404, "model",
     "does not exist"),
    ("/v1/score", {"model": MODEL, "text_1": ["a", "b"], "text_2": DOCS}, 400, None,
     "Input lengths must be either 1:1, 1:N or N:N"),
    ("/v1/score", {"model": MODEL, "text_1": [], "text_2": DOCS}, 400, None,
     "At least one text element must be given"),
    ("/v1/score", {"model": MODEL, "text_1": QUERY}, 400, "body.text_2", "Field required"),
    ("/score", {"model": MODEL, "text_1": QUERY, "text_2": "x" * 600_000}, 400,
     "input_text", "maximum context length"),
])
async def test_scoring_errors(server: SimServer, path: str, body: dict[str, Any], status: int,
                              param: str | None, message: str) -> None:
    got_status, got = await post(server, path, body)
    assert got_status == status, got
    assert set(got["error"]) == {"message", "type", "param", "code"}, got
    assert got["error"]["param"] == param, got
    assert message in got["error"]["message"], got
    assert server.engine.records == {}, server.engine.records  # nothing reached the engine
