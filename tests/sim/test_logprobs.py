"""The simulator's log probabilities, ``echo`` and the fields vLLM 0.32 refuses in a
stream, as vLLM answers them (``loadtest/sim/logprobs.py``; the shapes are in the
conformance recording)."""

from __future__ import annotations

from typing import Any

import aiohttp

from loadtest.sim.server import SimServer
from tests.sim.conftest import MODEL
from tests.sim.test_continuation import stream

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


async def test_completion_log_probabilities_follow_the_text(server: SimServer) -> None:
    events = await stream(server, CMPL, {"prompt": "abc", "max_tokens": 6,
                                         "logprobs": 2, "ignore_eos": True})
    text, offsets, tokens = "", [], []
    for event in events:
        for choice in event["choices"]:
            lp = choice["logprobs"]
            assert len(lp["top_logprobs"][0]) == 2, lp
            assert next(iter(lp["top_logprobs"][0])) == lp["tokens"][0], lp  # sampled first
            offsets += lp["text_offset"]
            tokens += lp["tokens"]
            text += choice["text"]
    assert "".join(tokens) == text and len(tokens) == 6, (tokens, text)
    assert offsets == [sum(map(len, tokens[:i])) for i in range(6)], offsets


async def test_chat_log_probabilities_list_the_top_entries(server: SimServer) -> None:
    for top in (0, 3):
        events = await stream(server, CHAT, {"messages": [{"role": "user", "content": "x"}],
                                             "max_tokens": 3, "logprobs": True,
                                             "top_logprobs": top})
        entries = [e for ev in events for c in ev["choices"] if c["logprobs"]
                   for e in c["logprobs"]["content"]]
        assert len(entries) == 3, entries
        for entry in entries:
            assert entry["bytes"] == list(entry["token"].encode()), entry
            assert len(entry["top_logprobs"]) == top, entry


async def test_echo_puts_the_prompt_first_unless_the_ids_are_asked(server: SimServer) -> None:
    body: dict[str, Any] = {"prompt": "story time", "max_tokens": 3, "echo": True}
    text = "".join(c["text"] for e in await stream(server, CMPL, body) for c in e["choices"])
    plain = "".join(c["text"] for e in await stream(server, CMPL, {**body, "echo": False})
                    for c in e["choices"])
    assert text == "story time" + plain, (text, plain)
    ids = "".join(c["text"] for e in await stream(server, CMPL, {
        **body, "return_token_ids": True}) for c in e["choices"])
    assert ids == plain, ids


async def test_a_stream_s_prompt_logprobs_and_a_suffix_are_refused(server: SimServer) -> None:
    async with aiohttp.ClientSession() as http:
        for extra, param in (({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
                             ({"suffix": "end"}, "suffix")):
            async with http.post(server.url + CMPL, json={
                    "model": MODEL, "prompt": "x", "max_tokens": 2, **extra}) as resp:
                data = await resp.json()
                assert resp.status == 400 and data["error"]["param"] == param, data
