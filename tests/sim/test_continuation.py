"""``return_token_ids`` and token-id prompts: a continuation of an answer, sent as the
prompt's ids plus the ids generated so far, yields exactly the rest of the answer."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from loadtest.sim.server import SimServer
from tests.sim.conftest import MODEL


async def post(server: SimServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.post(
            server.url + path, json={"model": MODEL, **body}) as resp:
        data: dict[str, Any] = await resp.json()
        assert resp.status == 200, data
        return data


async def stream(server: SimServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    async with aiohttp.ClientSession() as http, http.post(
            server.url + path, json={"model": MODEL, "stream": True, **body}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
    return events


async def test_whole_answers_carry_the_prompt_and_generated_ids(server: SimServer) -> None:
    chat = await post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 7,
        "return_token_ids": True})
    tokenized = await post(server, "/tokenize", {
        "messages": [{"role": "user", "content": "hello"}]})
    assert chat["prompt_token_ids"] == tokenized["tokens"], chat["prompt_token_ids"]
    ids = chat["choices"][0]["token_ids"]
    assert len(ids) == chat["usage"]["completion_tokens"], ids
    detok = await post(server, "/detokenize", {"tokens": ids})
    assert detok["prompt"] == chat["choices"][0]["message"]["content"], detok
    plain = await post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert plain["choices"][0]["token_ids"] is None and plain["choices"][0][
        "prompt_token_ids"] is None, plain["choices"][0]


async def test_streams_carry_ids_in_vllm_fields(server: SimServer) -> None:
    chat = await stream(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "return_token_ids": True})
    assert chat[0]["prompt_token_ids"] and chat[0]["choices"][0]["delta"]["role"], chat[0]
    assert [len(e["choices"][0]["token_ids"]) for e in chat[1:]] == [1] * 4, chat
    text = await stream(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3,
                                                    "return_token_ids": True})
    assert text[0]["choices"][0]["prompt_token_ids"] == [(2 << 32) | int.from_bytes(
        b"hi", "big")], text[0]
    assert [e["choices"][0]["prompt_token_ids"] for e in text[1:]] == [None, None], text


@pytest.mark.parametrize("split", [0, 1, 5, 11])
@pytest.mark.parametrize("ignore_eos", [True, False])
async def test_a_continuation_yields_the_rest_of_the_answer(
        server: SimServer, split: int, ignore_eos: bool) -> None:
    messages = [{"role": "user", "content": "tell me about fair queues"}]
    limit = 40 if ignore_eos else 600  # without ignore_eos the answer stops by itself
    ref = await post(server, "/v1/chat/completions", {
        "messages": messages, "max_tokens": limit, "ignore_eos": ignore_eos,
        "temperature": 0, "return_token_ids": True})
    ids = ref["choices"][0]["token_ids"]
    head = ids[:split]
    rest = await post(server, "/v1/completions", {
        "prompt": ref["prompt_token_ids"] + head, "max_tokens": limit - split,
        "ignore_eos": ignore_eos, "temperature": 0, "return_token_ids": True})
    choice = rest["choices"][0]
    assert head + choice["token_ids"] == ids, (split, len(ids), len(choice["token_ids"]))
    detok = await post(server, "/detokenize", {"tokens": head})
    assert detok["prompt"] + choice["text"] == ref["choices"][0]["message"]["content"]
    assert choice["finish_reason"] == ref["choices"][0]["finish_reason"], choice


async def test_the_same_prompt_as_text_or_ids_gets_the_same_answer(server: SimServer) -> None:
    text = await post(server, "/v1/completions", {"prompt": "same answer", "max_tokens": 600})
    ids = (await post(server, "/tokenize", {"prompt": "same answer"}))["tokens"]
    by_ids = await post(server, "/v1/completions", {"prompt": ids, "max_tokens": 600})
    assert text["choices"][0]["text"] == by_ids["choices"][0]["text"], by_ids
