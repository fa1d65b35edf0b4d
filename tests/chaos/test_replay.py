"""A stream with tools or structured output whose backend process is SIGKILLed
mid-answer is replayed on the other backend (``gateway/proxy/replay.py``): the client,
through the ``openai`` SDK, reads exactly the uninterrupted answer, one stream, usage
counted once. The simulator answers such requests with its deterministic text (it has no
tool parser or grammar: the real-vLLM tier checks those), which is what the replay's seam
needs: the request sent again reproduces the tokens the client has, and only the rest
goes out. Sampled (no ``temperature``): with the client's ``seed`` the answer is exactly
the reference's; without one fairgate seeds it at its first dispatch (the simulator draws
by the body's seed as vLLM does), so the replay draws the same answer again, or it would
diverge at the seam and the stream would fail."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chaos.test_continuation import CUT_AFTER, Rig, kill, rig, running_on
from tests.conftest import OpenAIClients
from tests.gateway.conftest import MODEL

__all__ = ["rig"]  # the fixture, shared with test_continuation

MAX_TOKENS = 300
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
KINDS: dict[str, dict[str, Any]] = {
    "tools": {"tools": TOOLS},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}}}},
}


def args(kind: str, seed: int | None) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": f"{kind}: why replay?"}],
            "extra_body": {"ignore_eos": True}, **KINDS[kind],
            **({} if seed is None else {"seed": seed})}


@pytest.mark.parametrize("seed", [7, None], ids=["client-seed", "gateway-seed"])
@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_a_replayed_stream_survives_its_backend_being_killed(
        rig: Rig, kind: str, seed: int | None, openai_clients: OpenAIClients) -> None:
    oai = openai_clients(rig.gw.url, "sk-alice")
    want = None if seed is None else await oai.chat.completions.create(**args(kind, seed))
    got, ids, usage, finish, killed = [], set(), None, None, None
    stream: Any = await oai.chat.completions.create(
        **args(kind, seed), stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            got.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        if killed is None and len(got) == CUT_AFTER:
            killed = await running_on(rig)
            await kill(rig, killed)
    assert killed is not None
    text = "".join(got)
    if want is not None:
        assert text == want.choices[0].message.content, (killed, len(text), text[-80:])
    assert len(ids) == 1 and finish == "length", (ids, finish)
    assert usage is not None and usage.completion_tokens == MAX_TOKENS, usage
    moves = rig.gw.services.metrics.moves
    assert moves.continuations.labels("failover", "continued")._value.get() == 1
    assert moves.continuations.labels("failover", "failed")._value.get() == 0
    recomputed = moves.recomputed_tokens.labels("failover")._value.get()
    assert recomputed >= CUT_AFTER, recomputed  # the replay computed the seam again
