"""The endpoint table (``gateway/proxy/endpoints.py``) and what derives from it: routes, body
validation, the output-token bound and prompt estimate, ``/openapi.json`` and the
simulator's routes — including a hypothetical new entry, which needs nothing else."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from gateway.core.errors import BadRequest
from gateway.http.openapi import build, document
from gateway.http.routes import add_endpoint_routes
from gateway.proxy.completion_request import Limits, parse_body
from gateway.proxy.endpoints import (
    BATCHABLE,
    BY_PATH,
    CHAT,
    COMPLETIONS,
    ENDPOINTS,
    PROMPT_READERS,
    RESPONSES,
    RESPONSES_USAGE,
    Endpoint,
    Frames,
    Kind,
    prompt_shape,
)
from gateway.scheduling.admission import estimate
from loadtest.sim.engine import EngineConfig
from loadtest.sim.server import SimServer
from policies.cost import estimate_prompt_tokens, max_cost_tokens, prompt_token_bound
from policies.locality import prompt_text
from policies.request import Prompt
from tests.gateway.conftest import MODEL

# a hypothetical new endpoint: queued, streamed as typed events, its own prompt and
# output fields, served by an existing simulator behaviour
NEW = Endpoint("/v1/new/things", "POST", "createThing", Kind.QUEUED, "A thing",
               "CreateResponseRequest", "Response", "input", ("max_output_tokens",),
               Frames.EVENTS, RESPONSES_USAGE, sim="responses")


def routes(app: web.Application) -> set[tuple[str, str]]:
    return {(r.method, r.resource.canonical) for r in app.router.routes()
            if r.resource is not None and r.method != "HEAD"}


def test_every_entry_is_declared_once() -> None:
    keys = [(e.method, e.path) for e in ENDPOINTS]
    assert len(keys) == len(set(keys)), keys
    ids = [e.operation_id for e in ENDPOINTS]
    assert len(ids) == len(set(ids)), ids
    assert BATCHABLE == (CHAT.path, COMPLETIONS.path, BY_PATH["/v1/embeddings"].path,
                         RESPONSES.path, "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score",
                         "/score")  # vLLM's batch runner takes any url ending in them
    batch = document()["components"]["schemas"]["CreateBatchRequest"]
    assert batch["properties"]["endpoint"]["enum"] == list(BATCHABLE), batch


@pytest.mark.parametrize(("endpoint", "body", "cost"), [
    (CHAT, {"max_tokens": 7, "max_completion_tokens": 9}, 7),  # the smallest
    (CHAT, {"max_tokens": 900, "max_completion_tokens": 1}, 1),
    (CHAT, {"max_completion_tokens": 9, "n": 3}, 27),
    (COMPLETIONS, {}, 1000),  # none set: the context
    (COMPLETIONS, {"max_tokens": 5, "n": 2, "best_of": 4}, 20),
    (COMPLETIONS, {"max_completion_tokens": 5}, 1000),  # vLLM reads only max_tokens here
    (RESPONSES, {"max_output_tokens": 11, "max_tokens": 3}, 11),  # max_tokens is not its
    (BY_PATH["/v1/embeddings"], {"max_tokens": 5}, 0),
])
def test_the_output_cost_reads_the_endpoints_fields(endpoint: Endpoint, body: dict[str, Any],
                                                    cost: int) -> None:
    prompt_field = endpoint.prompt_field or "prompt"
    empty = [{"role": "user"}] if prompt_field == "messages" else ""
    creq = parse_body({"model": MODEL, prompt_field: empty, **body}, endpoint)
    prompt = prompt_token_bound(creq.prompt)
    got = max_cost_tokens(creq.prompt, creq.output, 1000)
    assert got - prompt == cost, (endpoint.path, body, got, prompt)


def test_the_backend_gets_the_output_bound_that_was_reserved() -> None:
    body = {"model": MODEL, "messages": [{"role": "user"}], "max_tokens": 1,
            "max_completion_tokens": 2000}
    assert parse_body(body, CHAT).body == {**body, "max_completion_tokens": 1}
    assert body["max_completion_tokens"] == 2000  # the client's body is not changed
    same = {"model": MODEL, "prompt": "x", "max_tokens": 5}
    assert parse_body(same, COMPLETIONS).body is same
    other = {"model": MODEL, "input": "x", "max_output_tokens": 9, "max_tokens": 3}
    assert parse_body(other, RESPONSES).body is other  # not a Responses field


def test_the_estimate_reads_the_endpoints_prompt_field() -> None:
    # a completion whose body also carries an unrelated "input" is estimated from "prompt"
    body = {"model": MODEL, "prompt": "x" * 400, "input": "y"}
    assert estimate(parse_body(body, COMPLETIONS)) == 100
    assert estimate(parse_body({"model": MODEL, "input": "y" * 40}, RESPONSES)) == 10


@pytest.mark.parametrize("endpoint", [e for e in ENDPOINTS if e.kind is not Kind.LOCAL],
                         ids=lambda e: e.path)
def test_the_openapi_body_schema_matches_the_entry(endpoint: Endpoint) -> None:
    """The schema the YAML writes for a table entry's body declares the entry's prompt
    field (required: in every body, or in one of the body's alternatives), its
    output-token fields, and ``stream`` exactly when it streams."""
    spec = document()
    op = spec["paths"][endpoint.path][endpoint.method.lower()]
    assert op["operationId"] == endpoint.operation_id
    assert endpoint.request_schema is not None
    schema = spec["components"]["schemas"][endpoint.request_schema]
    assert "model" in schema["required"], schema
    if endpoint.prompt_field is not None:
        alternatives = [schema["required"]] + [a["required"] for a in schema.get("anyOf", [])]
        assert any(endpoint.prompt_field in a for a in alternatives), schema
        assert endpoint.prompt_field in schema["properties"], schema
    for name in endpoint.output_token_fields:
        assert name in schema["properties"], (name, schema)
    assert ("stream" in schema["properties"]) == endpoint.streams, schema
    assert ("text/event-stream" in op["responses"]["200"]["content"]) == endpoint.streams
    assert ("parameters" in op) == endpoint.queued, op


def test_openapi_refuses_a_yaml_that_disagrees_with_the_table() -> None:
    base = {"openapi": "3.1.0", "paths": {
        "/v1/models": {"get": {"operationId": "listModels"}},
        CHAT.path: {"post": {"operationId": "createChatCompletion"}}}}
    with pytest.raises(ValueError, match="generates"):
        build(base, (CHAT,))
    with pytest.raises(ValueError, match="retrieveModel"):
        build(base, (BY_PATH["/tokenize"], *(e for e in ENDPOINTS if e.path.startswith(
            "/v1/models"))))


def test_a_new_entry_needs_nothing_else() -> None:
    """One entry: it is routed, validated, bounded, estimated, described in OpenAPI and
    served by the simulator."""
    app = web.Application()
    add_endpoint_routes(app, {}, (NEW,))
    assert routes(app) == {("POST", NEW.path)}
    with pytest.raises(BadRequest) as bad:
        parse_body({"model": "m", "input": "x", "max_output_tokens": 0}, NEW, Limits())
    assert bad.value.param == "max_output_tokens", bad.value
    with pytest.raises(BadRequest) as bad:
        parse_body({"model": "m"}, NEW)
    assert bad.value.param == "input", bad.value
    body = {"model": "m", "input": "x" * 40, "max_output_tokens": 5, "stream": True}
    creq = parse_body(body, NEW)
    assert max_cost_tokens(creq.prompt, creq.output, 100) == 5 + (
        prompt_token_bound(creq.prompt))
    assert estimate(creq) == estimate_prompt_tokens(parse_body(body, RESPONSES).prompt)
    spec = build(document(), (NEW,))
    op = spec["paths"][NEW.path]["post"]
    assert op["operationId"] == "createThing" and "text/event-stream" in op["responses"][
        "200"]["content"], op


def test_the_simulator_routes_every_entry_with_a_behaviour() -> None:
    server = SimServer(EngineConfig(model=MODEL))
    served = routes(server.make_app())
    wanted = {(e.method, e.path) for e in ENDPOINTS if e.sim is not None}
    assert wanted <= served, wanted - served
    assert {e.sim for e in ENDPOINTS if e.sim} <= set(server.behaviours())
    assert ("GET", "/v1/files") not in served  # fairgate's own, not vLLM's


async def _empty(request: web.Request) -> web.StreamResponse:
    return web.json_response({})


def test_get_routes_answer_head_too() -> None:
    app = web.Application()
    add_endpoint_routes(app, {"listModels": _empty},
                        tuple(e for e in ENDPOINTS if e.operation_id == "listModels"))
    methods = {r.method for r in app.router.routes()}
    assert methods == {"GET", "HEAD"}, methods


def test_a_new_body_shape_is_one_prompt_reader() -> None:
    """A prompt of a shape of its own (here a query and documents, as a reranker's) is
    one reader registered under its entry's prompt field: checked, estimated, bounded and
    hashed for locality like any other."""
    @prompt_shape("things_query")
    def things_prompt(body: dict[str, Any]) -> Prompt:
        query, documents = body.get("things_query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(documents, list):
            raise BadRequest("'things_query' must be a string, 'documents' an array",
                             param="things_query")
        return Prompt("things_query", [query, *documents], rendered=(query, documents),
                      template_items=len(documents))

    try:
        entry = Endpoint("/v1/things/rank", "POST", "rankThings", Kind.QUEUED,
                         prompt_field="things_query")
        with pytest.raises(BadRequest) as bad:
            parse_body({"model": "m", "things_query": 5}, entry)
        assert bad.value.param == "things_query", bad.value
        creq = parse_body({"model": "m", "things_query": "x" * 40,
                           "documents": ["y" * 40, "z" * 8]}, entry)
        assert estimate(creq) == 10 + 10 + 2, estimate(creq)
        assert max_cost_tokens(creq.prompt, creq.output, 100) == prompt_token_bound(
            creq.prompt), "no output-token fields: it costs its prompt"
        assert prompt_text(creq.prompt) == "x" * 40 + "y" * 40 + "z" * 8
    finally:
        PROMPT_READERS.pop("things_query")
