"""A stream read to the end counts as served, whatever the client does after ``[DONE]``.

The openai SDK (and curl) close the connection as soon as they have read ``[DONE]``; the
gateway's handler may still be cleaning up then and is cancelled. Its status, its tokens
and its ``finished`` log must not depend on the client staying connected.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import aiohttp
import openai
from aiohttp import web

from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, store_is_idle, until
from tests.gateway.test_hostile_upstream import OddStreams, Trickle

STREAMS = 10


async def test_streams_read_to_the_end_are_counted_served(sim: SimFactory,
                                                          gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend])
    registry = gw.services.metrics.registry
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0)
    received = 0
    try:
        for i in range(STREAMS):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}],
                max_tokens=5 + i, stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                received += sum(1 for c in chunk.choices if c.delta.content)
    finally:
        await client.close()

    def count(status: str) -> float:
        return registry.get_sample_value(
            "fairgate_requests_total",
            {"model": MODEL, "priority_class": "interactive", "status": status}) or 0.0

    for _ in range(500):  # each handler records its outcome as it unwinds
        if count("200") + count("client_closed") + count("error") >= STREAMS:
            break
        await asyncio.sleep(0.01)
    assert (count("200"), count("client_closed"), count("error")) == (STREAMS, 0, 0)
    assert received == sum(5 + i for i in range(STREAMS))
    tokens = registry.get_sample_value(
        "fairgate_user_tokens_total", {"model": MODEL, "user": "alice", "kind": "completion"})
    assert tokens == received


PROMPT_IDS = list(range(100, 140))  # 40 prompt tokens
TOKENS_PER_FRAME = 3  # vLLM puts several tokens in a frame when it runs ahead of the reader
FRAMES = 10


def chunk(fields: dict[str, Any], choice: dict[str, Any]) -> bytes:
    event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
             "model": MODEL, **fields, "choices": [{"index": 0, "logprobs": None,
                                                   "finish_reason": None, **choice}]}
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


class Held(Trickle):
    """A stream of ``opening`` that then sends nothing more until ``done``."""

    def __init__(self, opening: bytes) -> None:
        super().__init__(opening)
        self.done = asyncio.Event()

    async def answer(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(self.opening)
        await self.done.wait()
        return out


async def test_a_cut_stream_is_charged_the_tokens_received_not_the_frames(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """A client that hangs up mid-stream is charged the tokens the backend generated up to
    the cut, counted by their ids (3 a frame here), and the prompt by its ids, not the
    frames (10) and the prompt estimate."""
    opening = chunk({"prompt_token_ids": PROMPT_IDS},
                    {"delta": {"role": "assistant", "content": ""}, "token_ids": []})
    opening += b"".join(
        chunk({}, {"delta": {"content": "abc"},
                   "token_ids": list(range(i * 3, i * 3 + TOKENS_PER_FRAME))})
        for i in range(FRAMES))
    backend = OddStreams(await sim(profile="instant"))
    await backend.start()
    try:
        held = Held(opening)
        backend.first = [held]
        gw = await gateway([backend])
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 300}],
                "max_tokens": 500, "stream": True}
        async with aiohttp.ClientSession() as http, http.post(
                gw.url + "/v1/chat/completions", json=body,
                headers={"Authorization": "Bearer sk-alice"}) as resp:
            frames = [await resp.content.readuntil(b"\n\n") for _ in range(FRAMES + 1)]
            assert not any(b'"token_ids":[' in f for f in frames), frames  # not asked for
        # the client hung up

        async def rows() -> list[dict[str, Any]]:
            today = datetime.now(UTC).date()
            return [r for r in await gw.services.usage.rows(today, today) if r["requests"]]

        await until(rows, "the cut request's usage")
        [row] = await rows()
        charged = (row["prompt_tokens"], row["completion_tokens"])
        assert charged == (len(PROMPT_IDS), FRAMES * TOKENS_PER_FRAME), row
        await store_is_idle(gw)
    finally:
        held.done.set()
        await backend.stop()
