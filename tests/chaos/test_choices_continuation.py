"""A stream of several choices (``n`` 3, seeded) and one with penalties, each cut
mid-answer by a SIGKILL or moved on purpose: every unfinished choice continues from its
own token ids on the other backend (``gateway/proxy/choices.py``, read as one stream by
``gateway/proxy/fan_in.py``) and the client, through the ``openai`` SDK, gets each
choice's text exactly as an uninterrupted run gives it, one stream, usage counted once.
On the simulator: the real-vLLM tier checks the same on vLLM
(``tests/e2e_vllm/test_resumable_vllm.py``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import aiohttp
import pytest

from gateway.scheduling.admission import DRAIN
from tests.chaos.test_continuation import MAX_TOKENS, Rig, kill, rig, running_on
from tests.chaos.test_moves import drained, moved
from tests.conftest import OpenAIClients
from tests.gateway.conftest import MODEL, until

__all__ = ["rig"]  # the fixture

N = 3
CUT_AFTER = 30  # content chunks (of all choices) the client reads before the cut


def request(chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.8,
                            "seed": 11, "n": N, "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "three answers, please"}]
    else:
        body["prompt"] = "three stories that go on"
    return body


async def reference(url: str, chat: bool) -> dict[int, str]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with aiohttp.ClientSession() as http, http.post(url + path,
                                                          json=request(chat)) as resp:
        data = await resp.json()
    return {c["index"]: c["message"]["content"] if chat else c["text"]
            for c in data["choices"]}


async def read(stream: Any, chat: bool, at_cut: Any) -> tuple[dict[int, str], Any, Any, Any]:
    """Each choice's text, finish reasons, ids and usage; ``at_cut`` runs once after
    ``CUT_AFTER`` chunks."""
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    ids, usage, seen = set(), None, 0
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += (choice.delta.content if chat else choice.text) or ""
            if choice.finish_reason is not None:
                assert choice.index not in finish, (choice.index, finish)  # once
                finish[choice.index] = choice.finish_reason
            seen += 1
            if seen == CUT_AFTER:
                await at_cut()
    return dict(texts), finish, ids, usage


async def open_stream(oai: Any, chat: bool) -> Any:
    body = request(chat)
    args = {k: body[k] for k in ("model", "max_tokens", "temperature", "seed", "n")}
    extra = {"extra_body": {"ignore_eos": True}, "stream": True,
             "stream_options": {"include_usage": True}}
    if chat:
        return await oai.chat.completions.create(messages=body["messages"], **args, **extra)
    return await oai.completions.create(prompt=body["prompt"], **args, **extra)


def check(texts: dict[int, str], want: dict[int, str], finish: Any, ids: Any,
          usage: Any) -> None:
    assert texts == want, {i: (len(texts.get(i, "")), len(want[i])) for i in want}
    assert finish == dict.fromkeys(range(N), "length"), finish
    assert len(ids) == 1, ids
    assert usage is not None and usage.completion_tokens == N * MAX_TOKENS, usage


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_every_choice_survives_its_backend_being_killed(
        rig: Rig, chat: bool, openai_clients: OpenAIClients) -> None:
    want = await reference(rig.urls[1], chat)
    assert len(set(want.values())) == N, want  # the choices differ: each is checked
    killed: list[int] = []

    async def cut() -> None:
        killed.append(await running_on(rig))
        await kill(rig, killed[0])

    stream = await open_stream(openai_clients(rig.gw.url, "sk-alice"), chat)
    texts, finish, ids, usage = await read(stream, chat, cut)
    assert killed, "never cut"
    check(texts, want, finish, ids, usage)
    metrics = rig.gw.services.metrics
    assert metrics.moves.continuations.labels("failover", "continued")._value.get() == 1


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_every_choice_of_a_moved_stream_continues(
        rig: Rig, chat: bool, openai_clients: OpenAIClients) -> None:
    want = await reference(rig.urls[0], chat)
    svc = rig.gw.services
    where: list[Any] = []

    async def cut() -> None:
        [entry] = svc.running.entries()
        assert entry.movable, entry
        await drained(rig, entry.backend)
        assert svc.running.move_backend(entry.backend, DRAIN) == 1
        where.append((entry.backend, await moved(svc.running, entry.backend)))

    stream = await open_stream(openai_clients(rig.gw.url, "sk-alice"), chat)
    texts, finish, ids, usage = await read(stream, chat, cut)
    [(left, after)] = where
    assert after is not None and after.backend != left and after.moves == 1, (left, after)
    check(texts, want, finish, ids, usage)
    assert svc.metrics.moves.continuations.labels("drain", "continued")._value.get() == 1
    await until(lambda: svc.running.entries() == [], "the moved answer unregistered")
