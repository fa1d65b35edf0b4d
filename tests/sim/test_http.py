"""The OpenAI HTTP surface, through the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest

from loadtest.sim.server import SimServer
from tests.sim.conftest import MODEL, ServerFactory


def client(server: SimServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


async def test_models_and_health(server: SimServer) -> None:
    async with client(server) as oai:
        models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with aiohttp.ClientSession() as http, http.get(server.url + "/health") as resp:
        assert resp.status == 200


async def test_chat_stream_with_usage(server: SimServer) -> None:
    async with client(server) as oai:
        stream = await oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 7
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.completion_tokens == 7
    assert usage.prompt_tokens == 4 + 3 + 3  # message overhead + ceil(11 / 4) + reply header


async def test_completion_stream_with_usage(server: SimServer) -> None:
    async with client(server) as oai:
        stream = await oai.completions.create(
            model=MODEL,
            prompt="x" * 40,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert len("".join(c.choices[0].text for c in chunks if c.choices).split()) == 5
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == 10
    assert chunks[-1].usage.total_tokens == 15


async def test_non_streaming_usage_and_determinism(server: SimServer) -> None:
    async with client(server) as oai:
        one = await oai.completions.create(model=MODEL, prompt="same prompt", max_tokens=1000)
        two = await oai.completions.create(model=MODEL, prompt="same prompt", max_tokens=1000)
        capped = await oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3
        )
    assert one.choices[0].text == two.choices[0].text
    assert one.usage is not None and 16 <= one.usage.completion_tokens <= 512
    assert one.choices[0].finish_reason == "stop"
    assert capped.usage is not None and capped.usage.completion_tokens == 3
    assert capped.choices[0].finish_reason == "length"


async def post(server: SimServer, path: str, body: Any, **headers: str) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as http,
        http.post(server.url + path, data=data, headers=headers) as resp,
    ):
        return resp.status, await resp.json()


def assert_error(status: int, body: Any, code: int, kind: str) -> None:
    assert status == code
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == kind
    assert body["error"]["code"] == code
    assert body["error"]["message"]


async def test_unknown_model_is_404(server: SimServer) -> None:
    status, body = await post(server, "/v1/completions", {"model": "nope", "prompt": "hi"})
    assert_error(status, body, 404, "NotFoundError")
    with pytest.raises(openai.NotFoundError):
        async with client(server) as oai:
            await oai.completions.create(model="nope", prompt="hi")


async def test_too_long_prompt_is_400(make_server: ServerFactory) -> None:
    server = await make_server(max_model_len=100)
    status, body = await post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * 800})
    assert_error(status, body, 400, "BadRequestError")
    assert "maximum context length is 100" in body["error"]["message"]
    assert body["error"]["param"] == "input_text"  # over 4 characters per token: untokenized
    # Exactly max_model_len tokens: no room left for output (vLLM: max_tokens clamps to 0).
    status, body = await post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * 399})
    assert_error(status, body, 400, "BadRequestError")
    assert body["error"]["message"].startswith("max_tokens must be at least 1, got 0.")
    status, body = await post(
        server, "/v1/completions", {"model": MODEL, "prompt": list(range(101))}
    )
    assert_error(status, body, 400, "BadRequestError")
    assert "contains 101 input tokens" in body["error"]["message"]
    assert body["error"]["param"] == "input_tokens"
    status, body = await post(
        server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 101}
    )
    assert_error(status, body, 400, "BadRequestError")
    assert body["error"]["param"] == "max_tokens"


async def test_prompt_plus_max_tokens_over_context_is_clamped(make_server: ServerFactory) -> None:
    """vLLM 0.32 clamps max_tokens to what the context leaves instead of answering 400."""
    server = await make_server(max_model_len=100)
    body = {"model": MODEL, "prompt": "x" * 160, "max_tokens": 100, "ignore_eos": True}
    status, answer = await post(server, "/v1/completions", body)
    assert status == 200
    assert answer["usage"] == {
        "prompt_tokens": 40, "total_tokens": 100, "completion_tokens": 60,
        "prompt_tokens_details": None, "completion_tokens_details": None,
    }  # fmt: skip
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_n_choices(server: SimServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3,
            "max_tokens": 4, "ignore_eos": True}  # fmt: skip
    status, answer = await post(server, "/v1/chat/completions", body)
    assert status == 200
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert answer["usage"]["completion_tokens"] == 12
    status, answer = await post(server, "/v1/chat/completions", {**body, "n": 0})
    assert_error(status, answer, 400, "BadRequestError")
    assert answer["error"]["message"] == "n must be at least 1, got 0."


async def test_bad_parameters_are_400(server: SimServer) -> None:
    base = {"model": MODEL, "prompt": "hi"}
    status, body = await post(server, "/v1/completions", {**base, "temperature": -1})
    assert_error(status, body, 400, "BadRequestError")
    assert body["error"]["param"] == "temperature"
    status, body = await post(server, "/v1/completions", {**base, "max_tokens": "many"})
    assert_error(status, body, 400, "Bad Request")
    assert body["error"]["param"] == "body.max_tokens"
    status, body = await post(
        server, "/v1/completions", {**base, "stream_options": {"include_usage": True}}
    )
    assert_error(status, body, 400, "BadRequestError")
    assert body["error"]["param"] == "stream_options"


async def test_invalid_json_is_400(server: SimServer) -> None:
    status, body = await post(server, "/v1/completions", b"{not json")
    assert_error(status, body, 400, "Bad Request")
    assert body["error"]["param"] == "body.1"


async def test_reject_priority_emulates_old_server(make_server: ServerFactory) -> None:
    server = await make_server(reject_priority=True)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    status, _ = await post(server, "/v1/completions", {**body, "priority": 0})
    assert status == 200
    status, answer = await post(server, "/v1/completions", {**body, "priority": 3})
    assert_error(status, answer, 400, "BadRequestError")
    status, answer = await post(server, "/v1/completions", body, **{"X-Vllm-Priority": "1"})
    assert_error(status, answer, 400, "BadRequestError")


async def test_priority_header_overrides_body(server: SimServer) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "priority": 4}
    status, answer = await post(server, "/v1/completions", body, **{"X-Vllm-Priority": "-2"})
    assert status == 200
    assert server.engine.records[answer["id"]].priority == -2
    status, answer = await post(server, "/v1/completions", body)
    assert server.engine.records[answer["id"]].priority == 4


async def test_debug_endpoints(server: SimServer) -> None:
    await post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/debug/requests") as resp:
            records = await resp.json()
        async with http.get(server.url + "/debug/state") as resp:
            state = await resp.json()
    assert len(records) == 1 and records[0]["output_tokens"] == 3
    assert {"request_id", "priority", "prompt_tokens", "max_tokens", "arrival_s",
            "first_scheduled_s", "first_token_s", "finished_s", "num_preemptions",
            "aborted"} <= set(records[0])  # fmt: skip
    assert state == {
        "num_waiting": 0, "num_running": 0, "kv_usage": 0.0,
        "prefix_cache_queries": 1, "prefix_cache_hits": 0, "scrapes": 0,
        "lora_loads": 0, "lora_unloads": 0,
    }  # fmt: skip
