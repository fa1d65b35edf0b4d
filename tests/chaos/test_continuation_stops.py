"""A stream with ``stop`` strings whose backend process is SIGKILLed mid-answer: the
answer continues on the other simulator, and the client, through the ``openai`` SDK,
gets exactly the uninterrupted answer's text (the text held back at the kill included),
``finish_reason`` "stop", one id and the usage once."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.chaos.test_continuation import Rig, kill, rig, running_on  # noqa: F401
from tests.conftest import OpenAIClients
from tests.gateway.conftest import MODEL

MAX_TOKENS = 60
STOP_AT = 17  # the answer's word (0-based) a stop string begins with: the filler words
# cycle every 18, so it occurs there first, well after the kill


def body(chat: bool, stop: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "ignore_eos": True}
    if stop is not None:
        out["stop"] = stop
    if chat:
        out["messages"] = [{"role": "user", "content": "question 7: where does it stop?"}]
    else:
        out["prompt"] = "prompt 7: a story that stops"
    return out


async def whole(url: str, chat: bool, stop: list[str] | None) -> dict[str, Any]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with aiohttp.ClientSession() as http, http.post(
            url + path, json=body(chat, stop)) as resp:
        data = await resp.json()
    return dict(data["choices"][0])


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_a_stop_string_stream_survives_its_backend_being_killed(
        rig: Rig, chat: bool, openai_clients: OpenAIClients) -> None:  # noqa: F811
    plain = await whole(rig.urls[1], chat, None)
    words = (plain["message"]["content"] if chat else plain["text"]).split(" ")[1:]
    stop = [" " + " ".join(words[STOP_AT:STOP_AT + 2]), "zzzz"]  # "zzzz": text held back
    want = await whole(rig.urls[1], chat, stop)
    want_text = want["message"]["content"] if chat else want["text"]
    assert want["finish_reason"] == "stop" and want["stop_reason"] == stop[0], want
    oai = openai_clients(rig.gw.url, "sk-alice")
    args = body(chat, stop)
    args["extra_body"] = {"ignore_eos": args.pop("ignore_eos")}
    create = oai.chat.completions.create if chat else oai.completions.create
    stream: Any = await create(**args, stream=True, stream_options={"include_usage": True})
    got, ids, usage, finish, killed = "", set(), None, None, None
    async for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece = (choice.delta.content if chat else choice.text) or ""
            got += piece
            if choice.finish_reason is not None:
                finish = (choice.finish_reason, getattr(choice, "stop_reason", None))
            if killed is None and piece:
                killed = await running_on(rig)
                await kill(rig, killed)
    assert killed is not None
    assert got == want_text, (killed, got, want_text)
    assert finish == ("stop", stop[0]), finish
    assert len(ids) == 1, ids
    assert usage is not None and usage.completion_tokens == STOP_AT + 2, usage
    metrics = rig.gw.services.metrics
    assert metrics.moves.continuations.labels("failover", "continued")._value.get() == 1
