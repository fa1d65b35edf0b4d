"""A healthy running answer moved on purpose (``RunningStreams.move_backend``, what a
drain with migrate does): it continues on the other backend with exactly the text of an
uninterrupted run (temperature 0), through the ``openai`` SDK, one stream, usage counted
once; the backend it left keeps its gates."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.scheduling.admission import DRAIN
from gateway.scheduling.running import RunningEntry, RunningStreams
from tests.chaos.test_continuation import (
    CUT_AFTER,
    MAX_TOKENS,
    Rig,
    reference,
    rig,
    running_on,
    sdk_args,
)
from tests.conftest import OpenAIClients
from tests.gateway.conftest import MODEL, until

__all__ = ["rig"]  # the fixture


async def drained(rig: Rig, name: str) -> None:
    """Drained without a migrate: no new dispatch there (what the admin call does)."""
    svc = rig.gw.services
    await svc.store.fleet.set_drained(MODEL, name, True)
    svc.pool.set_drained(svc.pool.handles[name], True)


async def moved(running: RunningStreams, left: str) -> RunningEntry | None:
    """The running request once it left ``left`` (bounded wait; ``None`` when it ended
    first). Looked at here, not at a later chunk the client reads: the client reads behind
    the gateway, which may have relayed the whole answer by then (seen on a loaded
    machine)."""
    for _ in range(2000):
        entries = running.entries()
        if not entries or entries[0].backend != left:
            return entries[0] if entries else None
        await asyncio.sleep(0.005)
    return running.entries()[0]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_a_moved_stream_continues_on_the_other_backend(
        rig: Rig, chat: bool, openai_clients: OpenAIClients) -> None:
    want = await reference(rig.urls[0], chat, 3)
    svc = rig.gw.services
    oai = openai_clients(rig.gw.url, "sk-alice")
    args = sdk_args(chat, 3)
    if chat:
        stream: Any = await oai.chat.completions.create(
            **args, stream=True, stream_options={"include_usage": True})
    else:
        stream = await oai.completions.create(
            **args, stream=True, stream_options={"include_usage": True})
    got: list[str] = []
    ids, usage, finish = set(), None, None
    left, after = None, None
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            got.append((choice.delta.content if chat else choice.text) or "")
            finish = choice.finish_reason or finish
        if left is None and len(got) == CUT_AFTER:
            [entry] = svc.running.entries()
            assert entry.movable and entry.generated >= CUT_AFTER - 1, entry
            left = entry.backend
            await drained(rig, left)
            assert svc.running.move_backend(left, DRAIN) == 1
            after = await moved(svc.running, left)
    assert left is not None and after is not None
    assert after.backend != left and after.moves == 1, (left, after)
    text = "".join(got)
    assert text == want, (left, len(text), len(want), text[-80:], want[-80:])
    assert len(ids) == 1, ids
    assert finish == "length", finish
    assert usage is not None and usage.completion_tokens == MAX_TOKENS, usage
    m = svc.metrics
    assert m.moves.continuations.labels("drain", "continued")._value.get() == 1
    assert m.moves.continuations.labels("failover", "continued")._value.get() == 0
    assert m.moves.recomputed_tokens.labels("drain")._value.get() >= (
        usage.prompt_tokens + CUT_AFTER - 1)
    assert svc.pool.handles[left].healthy and svc.pool.handles[left].failures == 0
    # the relay unregisters the answer once it has written its end: the client may read
    # [DONE] first
    await until(lambda: svc.running.entries() == [], "the moved answer unregistered")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_a_moved_whole_answer_is_sent_again_elsewhere(
        rig: Rig, chat: bool, openai_clients: OpenAIClients) -> None:
    want = await reference(rig.urls[0], chat, 4)
    svc = rig.gw.services
    oai = openai_clients(rig.gw.url, "sk-alice")
    args = sdk_args(chat, 4)
    call: Any = (oai.chat.completions.create(**args) if chat
                 else oai.completions.create(**args))
    task = asyncio.ensure_future(call)
    running = await running_on(rig)  # the backend generates it: no status line yet
    [entry] = svc.running.entries()
    assert entry.movable and entry.backend == f"b{running}", entry
    await drained(rig, entry.backend)
    assert svc.running.move_backend(entry.backend, DRAIN) == 1
    answer = await asyncio.wait_for(task, 60)
    choice = answer.choices[0]
    assert (choice.message.content if chat else choice.text) == want
    assert answer.usage is not None and answer.usage.completion_tokens == MAX_TOKENS
    m = svc.metrics
    assert m.moves.continuations.labels("drain", "continued")._value.get() == 1
    assert m.moves.continuations.labels("failover", "continued")._value.get() == 0
    assert svc.pool.handles[entry.backend].healthy
