"""Streams that once could not be continued, continued on real vLLM (CPU, the tiny
model) through the ``openai`` SDK: ``n`` > 1 (chat, ``temperature`` 1 with ``top_k`` 1,
so every choice is the greedy one and the text is fixed), a completions batch of two
prompts (``best_of`` 2, which vLLM 0.32 ignores), presence and frequency penalties on both
(carried across the seam as a ``logit_bias``, ``gateway/proxy/penalties.py``).

Two servers: the package's (``cpu0``) and the shared 4-slot one (``cpu1``). The streams
start on ``cpu1`` (``cpu0`` drained meanwhile) and, once every one of them has output and
can be continued, are moved (a drain with migrate) or ``cpu1`` is SIGKILLed (one kill for
every kind, after the move test, as this module is the 4-slot server's last user). Each
choice's text equals a reference run's straight from vLLM, its ``finish_reason`` too, one
``id``, the usage once (every choice's tokens, each prompt once).

The module's name sorts it after ``test_locality_vllm`` (the 4-slot server's other user)
and before ``test_lora_vllm``: the shared server is neither started again for it nor left
idle beside the LoRA module's, and its kill comes after its last other use.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from gateway.http.server import GatewayServer
from gateway.scheduling.admission import DRAIN
from tests.e2e_vllm.conftest import SharedServer, VllmServer
from tests.e2e_vllm.test_resumable_vllm import gateway, gateway_counter, settled

pytestmark = pytest.mark.vllm

TOKENS = 400  # per choice: long enough to be cut mid-answer on a quiet machine
PENALTIES = {"frequency_penalty": 0.4, "presence_penalty": 0.3}


def kinds(model: str) -> dict[str, dict[str, Any]]:
    """Each stream's SDK arguments (vLLM's own fields in ``extra_body``)."""
    return {
        "chat n=2": {"model": model, "n": 2, "temperature": 1.0, "max_tokens": TOKENS,
                     "messages": [{"role": "user", "content": "two of the same, please"}],
                     **PENALTIES, "extra_body": {"top_k": 1, "ignore_eos": True}},
        "completions batch": {"model": model, "prompt": ["the queue went on", "and on"],
                              "temperature": 0, "max_tokens": TOKENS, "best_of": 1,
                              **PENALTIES, "extra_body": {"ignore_eos": True}},
    }


@dataclass
class Answer:
    texts: dict[int, str] = field(default_factory=lambda: defaultdict(str))
    finish: dict[int, str] = field(default_factory=dict)
    ids: set[str] = field(default_factory=set)
    usage: tuple[int, int] | None = None
    first: asyncio.Event = field(default_factory=asyncio.Event)


async def read(client: openai.AsyncOpenAI, args: dict[str, Any]) -> Answer:
    chat = "messages" in args
    create = client.chat.completions.create if chat else client.completions.create
    stream: Any = await create(**args, stream=True, stream_options={"include_usage": True})
    out = Answer()
    async with asyncio.timeout(120):
        async for chunk in stream:
            out.ids.add(chunk.id)
            if chunk.usage is not None:
                out.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            for choice in chunk.choices:
                out.texts[choice.index] += (choice.delta.content if chat
                                            else choice.text) or ""
                if choice.finish_reason is not None:
                    assert choice.index not in out.finish, (choice.index, out.finish)
                    out.finish[choice.index] = choice.finish_reason
            out.first.set()
    return out


async def references(server: VllmServer) -> dict[str, Answer]:
    client = openai.AsyncOpenAI(base_url=server.api, api_key="none", max_retries=0)
    try:
        return {name: await read(client, args) for name, args in kinds(server.model).items()}
    finally:
        await client.close()


def check(got: dict[str, Answer], want: dict[str, Answer]) -> None:
    for name, ref in want.items():
        answer = got[name]
        assert len(ref.texts) >= 2 and set(ref.finish.values()) == {"length"}, (name, ref)
        assert dict(answer.texts) == dict(ref.texts), (
            name, {i: (len(answer.texts.get(i, "")), len(t)) for i, t in ref.texts.items()})
        assert answer.finish == ref.finish, (name, answer.finish)
        assert len(answer.ids) == 1, (name, answer.ids)
        assert answer.usage == ref.usage, (name, answer.usage, ref.usage)
        assert ref.usage is not None and ref.usage[1] == TOKENS * len(ref.texts), ref.usage


@pytest.fixture(scope="module")
def two_servers(request: pytest.FixtureRequest,
                four_slots: SharedServer) -> Iterator[list[VllmServer]]:
    four_slots.start()
    try:
        first: VllmServer = request.getfixturevalue("vllm_server")
        yield [first, four_slots.get()]
    finally:
        four_slots.release(request)


async def set_drained(gw: GatewayServer, name: str, on: bool) -> None:
    svc = gw.services
    await svc.store.fleet.set_drained(svc.pool.handles[name].config.model, name, on)
    svc.pool.set_drained(svc.pool.handles[name], on)


async def cut_on_cpu1(gw: GatewayServer, cut: Callable[[], Awaitable[None]]
                      ) -> dict[str, Answer]:
    """Every kind started on cpu1 (cpu0 drained), ``cut`` once each has output and is
    movable there (cpu0 open again); the answers as the client read them."""
    model = gw.services.pool.handles["cpu0"].config.model
    await set_drained(gw, "cpu0", True)
    clients = [openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=k, max_retries=0)
               for k in ("sk-alice", "sk-bob")]
    try:
        runs = {name: asyncio.ensure_future(read(clients[i], args))
                for i, (name, args) in enumerate(kinds(model).items())}
        async with asyncio.timeout(60):
            while True:
                there = gw.services.running.entries("cpu1")
                if len(there) == len(runs) and all(e.movable and e.generated >= 60
                                                   for e in there):
                    break
                assert not any(r.done() for r in runs.values()), "a stream ended uncut"
                await asyncio.sleep(0.001)
        await set_drained(gw, "cpu0", False)
        await cut()
        return {name: await run for name, run in runs.items()}
    finally:
        for c in clients:
            await c.close()


async def test_every_kind_moved_mid_stream_continues_exactly(
        two_servers: list[VllmServer], redis: aioredis.Redis, redis_url: str) -> None:
    want = await references(two_servers[0])
    async with gateway(redis_url, two_servers) as gw:
        async def move() -> None:
            await set_drained(gw, "cpu1", True)
            assert gw.services.running.move_backend("cpu1", DRAIN) == 2

        got = await cut_on_cpu1(gw, move)
        await settled(gw, two_servers[0].model)
        continued = await gateway_counter(gw, "fairgate_continuations_total",
                                          reason="drain", outcome="continued")
    check(got, want)
    assert continued == 2, continued


async def test_every_kind_survives_its_server_killed(
        two_servers: list[VllmServer], four_slots: SharedServer, redis: aioredis.Redis,
        redis_url: str) -> None:
    want = await references(two_servers[0])
    launched = four_slots.launched
    assert launched is not None
    async with gateway(redis_url, two_servers) as gw:
        async def kill() -> None:
            os.killpg(launched.proc.pid, signal.SIGKILL)

        got = await cut_on_cpu1(gw, kill)
        await asyncio.to_thread(launched.proc.wait, 30)
        await settled(gw, two_servers[0].model)
        continued = await gateway_counter(gw, "fairgate_continuations_total",
                                          reason="failover", outcome="continued")
    print(f"kinds on real vLLM: {continued:.0f} continued after the kill; "
          f"load {os.getloadavg()[0]:.2f}")
    check(got, want)
    assert continued == 2, continued
