"""``gateway.proxy.fan_in``: several continuation streams read as one: each choice's
frames re-indexed, one usage frame and one ``[DONE]`` at the end; a part that fails, or
a move, fails the whole stream (the relay continues what is unfinished)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.proxy.fan_in import FanIn
from gateway.proxy.moving import Moved


class Content:
    def __init__(self, chunks: list[bytes], hang: bool = False) -> None:
        self.chunks, self.hang = chunks, hang

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            await asyncio.sleep(0)
            yield chunk
        if self.hang:
            await asyncio.Event().wait()


class Part:
    content_type = "text/event-stream"

    def __init__(self, chunks: list[bytes], hang: bool = False) -> None:
        self.content = Content(chunks, hang)
        self.closed = self.released = False

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        self.released = True


def frame(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def token(text: str, finish: str | None = None) -> bytes:
    return frame({"id": "cmpl-x", "choices": [{"index": 0, "text": text,
                                               "finish_reason": finish}]})


USAGE = frame({"id": "cmpl-x", "choices": [], "usage": {"prompt_tokens": 1}})
DONE = b"data: [DONE]\n\n"


async def drain(fan: FanIn) -> list[bytes]:
    out = []
    async for chunk in fan.content.iter_any():
        out.append(chunk)
    return out


def events(chunks: list[bytes]) -> list[Any]:
    frames = b"".join(chunks).split(b"\n\n")[:-1]
    return [f[6:].decode() if f == DONE.strip() else json.loads(f[6:]) for f in frames]


async def test_the_parts_come_re_indexed_with_one_usage_and_one_done() -> None:
    parts: Any = [(1, Part([token("a"), token("b", "length") + USAGE, DONE])),
                  (4, Part([token("c")[:9], token("c")[9:] + token("d", "length"),
                            USAGE + DONE]))]
    fan = FanIn(parts)
    got = events(await drain(fan))
    texts = {1: "", 4: ""}
    for event in got[:-2]:
        [choice] = event["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == {1: "ab", 4: "cd"}, got
    assert got[-2]["choices"] == [] and "usage" in got[-2], got
    assert got[-1] == "[DONE]" and fan.content.is_eof()


async def test_a_part_that_ends_without_its_done_fails_the_stream() -> None:
    fan = FanIn([(0, Part([token("a"), DONE])), (1, Part([token("b")]))])  # type: ignore[list-item]
    with pytest.raises(aiohttp.ClientPayloadError, match="choice 1"):
        await drain(fan)
    assert not fan.content.is_eof()


async def test_a_move_fails_the_stream_and_closes_every_part() -> None:
    parts: Any = [(0, Part([token("a")], hang=True)), (1, Part([token("b")], hang=True))]
    fan = FanIn(parts)
    seen = asyncio.Event()

    async def read() -> None:
        async for _ in fan.content.iter_any():
            seen.set()

    reader = asyncio.ensure_future(read())
    await seen.wait()
    fan.content.set_exception(Moved("the answer was moved"))
    fan.close()
    with pytest.raises(Moved):
        await reader
    assert all(p.closed for _, p in parts)
    assert all(t.done() for t in fan.content._tasks), fan.content._tasks
