"""The simulator's embeddings, Responses API and tokenizer endpoints (vLLM 0.32's formats)."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import aiohttp
import openai
import pytest

from loadtest.sim import tokenizer
from loadtest.sim.server import SimServer
from tests.sim.conftest import MODEL, ServerFactory


def client(server: SimServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


async def post(server: SimServer, path: str, body: Any,
               headers: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
    async with aiohttp.ClientSession() as http, http.post(
            server.url + path, json=body, headers=headers) as resp:
        raw = await resp.read()
        data = json.loads(raw) if resp.content_type == "application/json" else None
        return resp.status, data, raw


# --------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ["", "a", "abcd", "abcde", "héllo wörld ✓ 🙂", "\x00\xff"])
def test_tokenizer_round_trip_and_counts(text: str) -> None:
    ids = tokenizer.encode(text)
    assert len(ids) == -(-len(text.encode()) // 4)  # protocol's prompt count
    assert tokenizer.decode(ids) == text
    assert all(i >= len(tokenizer.SPECIAL) for i in ids)  # never a special token


def test_tokenizer_rejects_ids_outside_its_vocabulary() -> None:
    for bad in (-1, 8, 1 << 32 | 256, 5 << 32, tokenizer.MAX_ID + 1):
        with pytest.raises(ValueError, match="out of vocabulary"):
            tokenizer.decode([bad])


async def test_tokenize_counts_match_usage(server: SimServer) -> None:
    text = "the fair queue, tokenized ✓"
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": text}]}]
    async with client(server) as oai:
        comp = await oai.completions.create(model=MODEL, prompt=text, max_tokens=1)
        chat = await oai.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                 max_tokens=1)
    status, tok, _ = await post(server, "/tokenize", {"model": MODEL, "prompt": text,
                                                       "return_token_strs": True})
    assert status == 200 and comp.usage is not None
    assert tok["count"] == len(tok["tokens"]) == comp.usage.prompt_tokens
    assert tok["max_model_len"] == server.config.model_len
    assert "".join(tok["token_strs"]).replace("\ufffd", "") == text.replace("✓", "")
    status, chat_tok, _ = await post(server, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and chat.usage is not None
    assert chat_tok["count"] == chat.usage.prompt_tokens and chat_tok["token_strs"] is None
    status, detok, _ = await post(server, "/detokenize", {"model": MODEL,
                                                           "tokens": tok["tokens"]})
    assert status == 200 and detok == {"prompt": text}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"model": MODEL}, 400, "body.prompt"),
    ("/tokenize", {"model": MODEL, "prompt": 5}, 400, "body.prompt"),
    ("/tokenize", {"model": MODEL, "messages": "hi"}, 400, "body.messages"),
    ("/detokenize", {"model": MODEL, "tokens": "1 2"}, 400, "body.tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [7, 99]}, 400, "tokens"),
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
])
async def test_tokenizer_errors(server: SimServer, path: str, body: dict[str, Any],
                                status: int, param: str) -> None:
    got_status, got, _ = await post(server, path, body)
    assert got_status == status, got
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["param"] == param


# --------------------------------------------------------------------------- embeddings


async def test_embeddings_formats_and_determinism(make_server: ServerFactory) -> None:
    server = await make_server()
    async with client(server) as oai:
        b64 = await oai.embeddings.create(model=MODEL, input="same text")  # SDK: base64
        floats = await oai.embeddings.create(model=MODEL, input=["same text", "other"],
                                             encoding_format="float")
        ids = await oai.embeddings.create(model=MODEL, input=tokenizer.encode("same text"),
                                          encoding_format="float")
        short = await oai.embeddings.create(model=MODEL, input="same text", dimensions=8,
                                            encoding_format="float")
    vec = floats.data[0].embedding
    assert len(vec) == 384 and abs(sum(v * v for v in vec) - 1.0) < 1e-9
    assert b64.data[0].embedding == pytest.approx(vec, abs=1e-6)
    assert ids.data[0].embedding == vec  # a text and its token ids embed alike
    assert floats.data[1].embedding != vec
    assert floats.usage.prompt_tokens == 3 + 2 and floats.usage.total_tokens == 5
    assert len(short.data[0].embedding) == 8
    assert floats.model == MODEL and floats.object == "list"

    raw_status, raw, _ = await post(server, "/v1/embeddings", {
        "model": MODEL, "input": "same text", "encoding_format": "base64", "normalize": False})
    assert raw_status == 200
    assert set(raw) == {"id", "object", "created", "model", "data", "usage"}
    assert raw["id"].startswith("embd-")
    assert raw["usage"] == {"prompt_tokens": 3, "total_tokens": 3, "completion_tokens": 0,
                            "prompt_tokens_details": None}
    unnormalized = struct.unpack("<384f", base64.b64decode(raw["data"][0]["embedding"]))
    assert abs(sum(v * v for v in unnormalized) - 1.0) > 1e-3

    other = await make_server(seed=1)
    async with client(other) as oai:
        seeded = await oai.embeddings.create(model=MODEL, input="same text",
                                             encoding_format="float")
    assert seeded.data[0].embedding != vec  # the server's seed is part of the hash


async def test_embeddings_are_prefill_only_engine_requests(server: SimServer) -> None:
    async with client(server) as oai:
        await oai.embeddings.create(model=MODEL, input=["x" * 40, "y" * 80])
    records = list(server.engine.records.values())
    assert sorted(r.prompt_tokens for r in records) == [10, 20]
    assert all(r.pooling and r.output_tokens == 1 and r.finish_reason == "stop"
               for r in records)
    metrics = server.metrics.render(server.engine).decode()
    assert 'vllm:generation_tokens_total{engine="0",model_name="sim-model"} 0.0' in metrics
    assert 'vllm:prompt_tokens_total{engine="0",model_name="sim-model"} 30.0' in metrics


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": MODEL}, 400, "body.input"),
    ({"model": MODEL, "input": 5}, 400, "body.input"),
    ({"model": MODEL, "input": []}, 400, "body.input"),
    ({"model": MODEL, "input": ["a", [1]]}, 400, "body.input"),
    ({"model": MODEL, "input": ""}, 400, "input"),
    ({"model": MODEL, "input": "x", "encoding_format": "bytes"}, 400, "body.encoding_format"),
    ({"model": MODEL, "input": "x", "dimensions": 385}, 400, "dimensions"),
    ({"model": MODEL, "input": "x" * 20_000}, 400, "input_text"),
    ({"model": "other", "input": "x"}, 404, "model"),
])
async def test_embeddings_errors(make_server: ServerFactory, body: dict[str, Any],
                                 status: int, param: str) -> None:
    server = await make_server(max_model_len=4096)
    got_status, got, _ = await post(server, "/v1/embeddings", body)
    assert got_status == status, got
    assert got["error"]["param"] == param


async def test_priority_on_the_new_routes(make_server: ServerFactory) -> None:
    strict = await make_server(reject_priority=True)
    for path, body in (("/v1/embeddings", {"model": MODEL, "input": "x", "priority": 3}),
                       ("/v1/responses", {"model": MODEL, "input": "x", "priority": 3})):
        status, got, _ = await post(strict, path, body)
        assert status == 400 and got["error"]["param"] == "priority", got
    server = await make_server()
    status, _, _ = await post(server, "/v1/embeddings", {"model": MODEL, "input": "x"},
                              headers={"X-Vllm-Priority": "7"})
    assert status == 200
    assert [r.priority for r in server.engine.records.values()] == [7]


# --------------------------------------------------------------------------- responses


async def test_responses_whole(server: SimServer) -> None:
    async with client(server) as oai:
        short = await oai.responses.create(model=MODEL, input="hi", max_output_tokens=4)
        full = await oai.responses.create(model=MODEL, input="hi", instructions="be brief")
    assert short.status == "incomplete"
    assert short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens"
    assert short.usage is not None and short.usage.output_tokens == 4
    assert short.usage.input_tokens == 3 + 4 + 1
    assert short.usage.total_tokens == 3 + 4 + 1 + 4
    assert len(short.output_text.split()) == 4 and short.output[0].type == "message"
    assert full.status == "completed" and full.usage is not None
    assert 16 <= full.usage.output_tokens <= 512  # the simulator's seeded draw
    assert full.usage.input_tokens == 3 + (4 + 2) + (4 + 1)
    assert full.instructions == "be brief" and full.id.startswith("resp_")


async def test_responses_stream_events(server: SimServer) -> None:
    async with client(server) as oai:
        stream = await oai.responses.create(model=MODEL, input="hi", max_output_tokens=3,
                                            stream=True)
        events = [e async for e in stream]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[7].text == text  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "incomplete" and final.output_text == text
    assert final.usage is not None and final.usage.output_tokens == 3
    assert events[0].response.usage is None  # type: ignore[union-attr]

    # the wire: event: + data: frames, no [DONE]
    status, _, raw = await post(server, "/v1/responses", {
        "model": MODEL, "input": "hi", "max_output_tokens": 1, "stream": True})
    frames = raw.decode().split("\n\n")
    assert status == 200 and frames[-1] == "" and "[DONE]" not in raw.decode()
    for frame in frames[:-1]:
        head, data = frame.split("\n")
        assert head.startswith("event: response.") and data.startswith("data: {")
        assert json.loads(data[6:])["type"] == head[7:]


async def test_responses_stream_opens_before_the_first_token(
        make_server: ServerFactory) -> None:
    # one sequence at a time and a long first request: the second waits in the engine
    server = await make_server(profile="h100-llama3.1-8b", max_num_seqs=1)
    async with aiohttp.ClientSession() as http:
        first = await http.post(server.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2000, "ignore_eos": True, "stream": True})
        second = await http.post(server.url + "/v1/responses", json={
            "model": MODEL, "input": "hi", "max_output_tokens": 2, "stream": True})
        assert server.engine.num_waiting == 1
        head = await second.content.readuntil(b"\n\n")
        head += await second.content.readuntil(b"\n\n")
        assert b"response.created" in head and b"response.in_progress" in head
        assert server.engine.num_waiting == 1  # sent while still queued
        first.close()
        rest = await second.read()
        assert b"response.completed" in rest
        second.close()


async def test_responses_errors(server: SimServer) -> None:
    for body, status, param in (
        ({"model": MODEL}, 400, "body.input"),
        ({"model": MODEL, "input": 5}, 400, "body.input"),
        ({"model": MODEL, "input": []}, 400, None),  # an empty conversation
        ({"model": "other", "input": "x"}, 404, "model"),
        ({"model": MODEL, "input": "x", "temperature": 3}, 400, "temperature"),
    ):
        got_status, got, _ = await post(server, "/v1/responses", body)
        assert got_status == status, (body, got)
        assert got["error"]["param"] == param


def test_embedding_dimensions_flag() -> None:
    from loadtest.cli import build_parser

    args = build_parser().parse_args(["sim", "--model", "m", "--embedding-dimensions", "16"])
    assert args.embedding_dimensions == 16
    assert build_parser().parse_args(["sim", "--model", "m"]).embedding_dimensions == 384
