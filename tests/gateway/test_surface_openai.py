"""The rest of the OpenAI surface through the gateway to the simulator, with the official
``openai`` SDK: embeddings and the Responses API (scheduled and charged like completions
and chat), vLLM's ``/tokenize`` and ``/detokenize`` (authenticated, not queued)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

from gateway.http.server import GatewayServer
from loadtest.sim.tokenizer import encode
from tests.gateway.conftest import (
    HI,
    MODEL,
    BusyFactory,
    GatewayFactory,
    SimFactory,
    assert_error,
    call,
    store_is_idle,
    until,
)

RESPONSE_EVENTS = [  # vLLM's sequence for a plain text answer
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
    "response.completed",
]  # fmt: skip


def sdk(gw: GatewayServer, key: str | None = "sk-alice") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key or "", max_retries=0)


def charged(gw: GatewayServer, user: str, kind: str) -> float:
    value = gw.services.metrics.registry.get_sample_value(
        "fairgate_user_tokens_total", {"model": MODEL, "user": user, "kind": kind})
    return value or 0.0


def service(gw: GatewayServer, user: str) -> float:
    value = gw.services.metrics.registry.get_sample_value(
        "fairgate_user_service_total", {"model": MODEL, "user": user})
    return value or 0.0


def requests_ok(gw: GatewayServer, klass: str = "interactive") -> float:
    value = gw.services.metrics.registry.get_sample_value(
        "fairgate_requests_total", {"model": MODEL, "priority_class": klass, "status": "200"})
    return value or 0.0


# --------------------------------------------------------------------------- embeddings


async def test_embeddings_string_and_list_usage_charged(sim: SimFactory,
                                                        gateway: GatewayFactory) -> None:
    gw = await gateway([await sim(profile="instant")])
    async with sdk(gw) as client:
        one = await client.embeddings.create(model=MODEL, input="x" * 40)  # base64 (SDK)
        assert len(one.data) == 1 and len(one.data[0].embedding) == 384
        assert one.usage.prompt_tokens == 10 and one.usage.total_tokens == 10
        assert abs(sum(v * v for v in one.data[0].embedding) - 1.0) < 1e-4  # normalized

        many = await client.embeddings.create(model=MODEL, input=["x" * 40, "y" * 8, "z"],
                                              encoding_format="float")
        assert [d.index for d in many.data] == [0, 1, 2]
        assert many.usage.prompt_tokens == 10 + 2 + 1
        # deterministic: the same text, the same vector (float32 over base64)
        assert many.data[0].embedding == pytest.approx(one.data[0].embedding, abs=1e-6)
        assert many.data[0].embedding != many.data[1].embedding

        ids = await client.embeddings.create(model=MODEL, input=[encode("x" * 40), [1, 2]],
                                             encoding_format="float")
        assert ids.usage.prompt_tokens == 10 + 2
        assert ids.data[0].embedding == pytest.approx(many.data[0].embedding)
    assert charged(gw, "alice", "prompt") == 10 + 13 + 12  # vLLM's counts, not the estimate
    assert charged(gw, "alice", "completion") == 0
    assert service(gw, "alice") == 10 + 13 + 12  # VTC: prompt tokens x 1
    assert requests_ok(gw) == 3
    await store_is_idle(gw)


async def test_embeddings_wait_in_the_queue_and_cost_their_input(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession,
        busy: BusyFactory) -> None:
    backend = await sim(profile="h100-llama3.1-8b", max_num_seqs=1)
    gw = await gateway([backend], classes={"interactive": {"max_waiting": 1}})
    store = gw.services.store
    load = busy(gw, backend)
    await load.fill("sk-alice")  # one running, one waiting in vLLM: the gate is closed

    body = {"model": MODEL, "input": ["a" * 40, "b" * 80], "encoding_format": "float"}
    task = asyncio.create_task(call(http, "POST", gw.url + "/v1/embeddings", key="sk-bob",
                                    json=body))

    async def queued() -> bool:
        return (await store.reads.depths(MODEL))["interactive"] == 1
    await until(queued, "bob's embedding queued in Redis")
    heads = [q for q in await store.reads.queued_users(MODEL, 10) if q.user == "bob"]
    assert len(heads) == 1 and heads[0].klass == "interactive" and heads[0].queued == 1
    assert heads[0].oldest_request_id is not None
    fields = await store.reads.request_fields(MODEL, heads[0].oldest_request_id)
    assert fields["state"] == "queued"
    assert float(fields["cost"]) == 10 + 20  # dispatch cost: the estimated input tokens
    assert backend.engine.num_waiting == 1 and not task.done()

    # tokenize is not queued: it answers while the gate is closed
    status, got, _ = await call(http, "POST", gw.url + "/tokenize", key="sk-carol",
                                json={"model": MODEL, "prompt": "a" * 40})
    assert status == 200 and got["count"] == 10, got
    assert (await store.reads.depths(MODEL))["interactive"] == 1

    await load.close()  # alice's long requests go away: the gate opens for bob
    status, got, _ = await task
    assert status == 200, got
    assert got["usage"]["prompt_tokens"] == 30 and len(got["data"]) == 2
    assert charged(gw, "bob", "prompt") == 30
    await store_is_idle(gw)


# --------------------------------------------------------------------------- responses


async def test_responses_whole_and_streamed_usage_charged(sim: SimFactory,
                                                          gateway: GatewayFactory) -> None:
    gw = await gateway([await sim(profile="instant")])
    async with sdk(gw, "sk-bob") as client:
        whole = await client.responses.create(model=MODEL, input="hello there",
                                              instructions="be brief", max_output_tokens=5)
        assert whole.status == "incomplete"  # stopped by max_output_tokens
        assert whole.usage is not None and whole.usage.output_tokens == 5
        assert len(whole.output_text.split()) == 5
        prompt = whole.usage.input_tokens
        assert prompt == 3 + (4 + 2) + (4 + 3)  # reply header + system + user (sim counts)
    assert charged(gw, "bob", "prompt") == prompt
    assert charged(gw, "bob", "completion") == 5
    assert service(gw, "bob") == prompt + 2 * 5  # VTC: input x 1 + output x 2

    async with sdk(gw, "sk-carol") as client:
        stream = await client.responses.create(
            model=MODEL, input=[{"role": "user", "content": "hi"}], max_output_tokens=6,
            stream=True)
        events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds == RESPONSE_EVENTS[:4] + ["response.output_text.delta"] * 6 + RESPONSE_EVENTS[5:]
    assert [e.sequence_number for e in events] == list(range(len(events)))  # all relayed
    final = events[-1]
    assert final.type == "response.completed" and final.response.usage is not None
    usage = final.response.usage
    assert usage.output_tokens == 6 and usage.input_tokens == 3 + 4 + 1

    async def carol_settled() -> bool:  # settled as the handler unwinds
        return charged(gw, "carol", "completion") == 6 and requests_ok(gw) == 2
    await until(carol_settled, "carol's stream settled: charged, counted as a 200")
    assert charged(gw, "carol", "prompt") == usage.input_tokens
    assert service(gw, "carol") == usage.input_tokens + 2 * 6
    # the relay saw the deltas as output: the stream has a time to first token
    ttft = gw.services.metrics.registry.get_sample_value(
        "fairgate_time_to_first_token_seconds_count", {"priority_class": "interactive"})
    assert ttft == 1
    await store_is_idle(gw)


async def test_responses_validation(sim: SimFactory, gateway: GatewayFactory,
                                    http: aiohttp.ClientSession) -> None:
    gw = await gateway([await sim(profile="instant")], max_output_tokens=100)
    url = gw.url + "/v1/responses"
    for body, param in (({"model": MODEL}, "input"),
                        ({"model": MODEL, "input": 5}, "input"),
                        ({"input": "hi"}, "model"),
                        ({"model": MODEL, "input": "hi", "stream": "yes"}, "stream"),
                        ({"model": MODEL, "input": "hi", "max_output_tokens": 0},
                         "max_output_tokens"),
                        ({"model": MODEL, "input": "hi", "max_output_tokens": 101},
                         "max_output_tokens"),
                        ({"model": MODEL, "input": "hi", "max_output_tokens": True},
                         "max_output_tokens")):
        status, got, _ = await call(http, "POST", url, json=body)
        assert status == 400, (body, got)
        assert_error(got, type_="invalid_request_error", param=param)
    for body, param in (({"model": MODEL}, "input"),
                        ({"model": MODEL, "input": {"text": "x"}}, "input"),
                        ({"model": MODEL, "input": "x", "stream": True}, "stream")):
        status, got, _ = await call(http, "POST", gw.url + "/v1/embeddings", json=body)
        assert status == 400, (body, got)
        assert_error(got, type_="invalid_request_error", param=param)
    # just at the bound
    status, got, _ = await call(http, "POST", url, json={"model": MODEL, "input": "hi",
                                                         "max_output_tokens": 100})
    assert status == 200 and got["usage"]["output_tokens"] <= 100, got
    await store_is_idle(gw)


# --------------------------------------------------------------------------- tokenize


async def test_tokenize_detokenize_round_trip(sim: SimFactory, gateway: GatewayFactory,
                                              http: aiohttp.ClientSession) -> None:
    gw = await gateway([await sim(profile="instant")])
    text = "héllo wörld, fairly queued ✓"
    status, tok, _ = await call(http, "POST", gw.url + "/tokenize", key="sk-batch",
                                json={"model": MODEL, "prompt": text})
    assert status == 200, tok
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    status, detok, _ = await call(http, "POST", gw.url + "/detokenize", key="sk-dflt",
                                  json={"model": MODEL, "tokens": tok["tokens"]})
    assert status == 200 and detok == {"prompt": text}, detok

    # the count is what a completion of the same prompt is charged
    async with sdk(gw) as client:
        comp = await client.completions.create(model=MODEL, prompt=text, max_tokens=1)
        chat = await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    assert comp.usage is not None and comp.usage.prompt_tokens == tok["count"]
    status, chat_tok, _ = await call(http, "POST", gw.url + "/tokenize",
                                     json={"model": MODEL, "messages": HI})
    assert status == 200 and chat.usage is not None
    assert chat_tok["count"] == chat.usage.prompt_tokens

    # a backend's own error passes through in OpenAI's format
    status, got, _ = await call(http, "POST", gw.url + "/detokenize",
                                json={"model": MODEL, "tokens": [99]})
    assert status == 400, got
    assert "out of vocabulary" in got["error"]["message"]
    # not scheduled: nothing counted as a request, nothing queued or charged
    assert requests_ok(gw) == 2
    assert charged(gw, "bert", "prompt") == 0
    await store_is_idle(gw)


# --------------------------------------------------------------------------- errors


async def test_401_and_404_on_the_new_routes(sim: SimFactory, gateway: GatewayFactory,
                                             http: aiohttp.ClientSession) -> None:
    gw = await gateway([await sim(profile="instant")])
    bodies = {"/v1/embeddings": {"model": MODEL, "input": "x"},
              "/v1/responses": {"model": MODEL, "input": "x"},
              "/tokenize": {"model": MODEL, "prompt": "x"},
              "/detokenize": {"model": MODEL, "tokens": [1]},
              "/v1/rerank": {"model": MODEL, "query": "x", "documents": ["y"]},
              "/score": {"model": MODEL, "text_1": "x", "text_2": "y"}}
    for path, body in bodies.items():
        for key in (None, "sk-nobody"):
            status, got, _ = await call(http, "POST", gw.url + path, key=key, json=body)
            assert status == 401, (path, key, got)
            assert_error(got, type_="invalid_request_error", code="invalid_api_key")
        status, got, _ = await call(http, "POST", gw.url + path,
                                    json={**body, "model": "gpt-17"})
        assert status == 404, (path, got)
        assert "gpt-17" in assert_error(got, type_="invalid_request_error", param="model",
                                        code="model_not_found")
        status, got, _ = await call(http, "GET", gw.url + path)
        assert status == 405, (path, got)

    async with sdk(gw, "sk-wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.embeddings.create(model=MODEL, input="x")
        with pytest.raises(openai.AuthenticationError):
            await client.responses.create(model=MODEL, input="x")
    async with sdk(gw) as client:
        with pytest.raises(openai.NotFoundError) as exc:
            await client.embeddings.create(model="gpt-17", input="x")
        assert exc.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError) as exc:
            await client.responses.create(model="gpt-17", input="x", stream=True)
        assert exc.value.code == "model_not_found"

    # routes fairgate does not serve: a clear 404, not a missing model
    for method, path in (("POST", "/v1/audio/speech"), ("POST", "/v1/images/generations"),
                         ("GET", "/v1/responses/resp_1"), ("POST", "/v1/classify")):
        status, got, _ = await call(http, method, gw.url + path, json={})
        assert status == 404, (path, got)
        assert path in assert_error(got, type_="invalid_request_error", code=None)
    await store_is_idle(gw)


async def test_tokenize_goes_to_a_healthy_backend(sim: SimFactory, gateway: GatewayFactory,
                                                  http: aiohttp.ClientSession) -> None:
    first, second = await sim(profile="instant"), await sim(profile="instant")
    gw = await gateway([first, second])
    body = {"model": MODEL, "prompt": "abcdefgh"}
    await first.stop()  # refused connections: the other backend answers
    for _ in range(3):
        status, got, _ = await call(http, "POST", gw.url + "/tokenize", json=body)
        assert status == 200 and got["count"] == 2, got
    handles = gw.services.pool.handles
    await until(lambda: not handles["b0"].healthy, "b0 marked unhealthy")

    await second.stop()
    await until(lambda: not handles["b1"].healthy, "b1 marked unhealthy")
    status, got, headers = await call(http, "POST", gw.url + "/detokenize",
                                      json={"model": MODEL, "tokens": [1]})
    assert status == 503 and "Retry-After" in headers, got
    assert_error(got, type_="server_error", code="no_healthy_backend")


async def test_openapi_json_describes_the_surface(sim: SimFactory,
                                                  gateway: GatewayFactory) -> None:
    gw = await gateway([await sim(profile="instant")])
    async with aiohttp.ClientSession() as http, http.get(gw.url + "/openapi.json") as resp:
        assert resp.status == 200
        spec = await resp.json()
    assert spec["openapi"].startswith("3.")
    for path in ("/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/tokenize",
                 "/v1/batches", "/admin/state", "/openapi.json"):
        assert path in spec["paths"], path


async def test_models_retrieve_through_the_sdk(sim: SimFactory,
                                               gateway: GatewayFactory) -> None:
    before = int(time.time())
    gw = await gateway([await sim(profile="instant")])
    after = int(time.time())
    client = sdk(gw)
    try:
        model = await client.models.retrieve(MODEL)
        assert (model.id, model.object) == (MODEL, "model"), model
        assert before <= model.created <= after, (
            f"created {model.created}: not the gateway's start in [{before}, {after}]")
        listed = [(m.id, m.created) async for m in client.models.list()]
        assert listed == [(MODEL, model.created)], listed
        with pytest.raises(openai.NotFoundError) as caught:
            await client.models.retrieve("no-such/model")
        assert caught.value.code == "model_not_found", caught.value.body
        async with aiohttp.ClientSession() as http:
            status, body, _ = await call(http, "GET", gw.url + "/v1/models/no-such/model")
        assert status == 404, body
        assert_error(body, type_="invalid_request_error", param="model",
                     code="model_not_found")
        with pytest.raises(openai.AuthenticationError):
            await sdk(gw, "sk-wrong").models.retrieve(MODEL)
    finally:
        await client.close()
