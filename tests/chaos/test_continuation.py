"""A backend process SIGKILLed mid-answer: the answer continues on the other backend of
its model and the client, through the ``openai`` SDK, gets exactly the text an
uninterrupted run gives (temperature 0), one stream, usage counted once."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.core.settings import Backend
from gateway.http.server import GatewayServer
from gateway.storage.embedded_redis import free_port
from tests.chaos.test_backend_killed import start_sim
from tests.conftest import OpenAIClients
from tests.gateway.conftest import MODEL, assert_settled, gateway_settings

MAX_TOKENS = 300
CUT_AFTER = 20  # content chunks the client reads before the kill


@dataclass
class Rig:
    gw: GatewayServer
    sims: list[asyncio.subprocess.Process]
    urls: list[str]


@pytest.fixture
async def rig(redis: aioredis.Redis, redis_url: str) -> AsyncIterator[Rig]:
    ports = [free_port(), free_port()]
    sims = [await start_sim(p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    settings = gateway_settings(redis_url, [], scrape_interval_s=0.05)
    gw = GatewayServer(settings.model_copy(update={"backends": [
        Backend(name=f"b{i}", url=url, model=MODEL) for i, url in enumerate(urls)]}))
    try:
        await gw.start()
        for handle in gw.services.pool.handles.values():
            await asyncio.wait_for(handle.scraped.wait(), 30)
        yield Rig(gw, sims, urls)
        await assert_settled(gw)
    finally:
        await gw.stop()
        for proc in sims:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def request(chat: bool, i: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": f"question {i}: why continue?"}]
    else:
        body["prompt"] = f"prompt {i}: a story that goes on"
    return body


async def reference(url: str, chat: bool, i: int) -> str:
    """The uninterrupted answer, straight from a simulator."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with aiohttp.ClientSession() as http, http.post(url + path,
                                                          json=request(chat, i)) as resp:
        data = await resp.json()
    choice = data["choices"][0]
    return str(choice["message"]["content"] if chat else choice["text"])


async def running_on(rig: Rig) -> int:
    """The index of the simulator that runs the request (bounded wait)."""
    async with aiohttp.ClientSession() as http:
        for _ in range(2000):
            for i, url in enumerate(rig.urls):
                if rig.sims[i].returncode is not None:
                    continue
                async with http.get(url + "/debug/state") as resp:
                    if (await resp.json())["num_running"] > 0:
                        return i
            await asyncio.sleep(0.005)
    raise AssertionError("no simulator ran the request")


async def kill(rig: Rig, index: int) -> None:
    rig.sims[index].send_signal(signal.SIGKILL)
    await rig.sims[index].wait()


def sdk_args(chat: bool, i: int) -> dict[str, Any]:
    """The request as the SDK takes it (vLLM's own fields in ``extra_body``)."""
    body = request(chat, i)
    vllm = {"ignore_eos": body.pop("ignore_eos")}
    return {**body, "extra_body": vllm}


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_a_stream_survives_its_backend_being_killed(
        rig: Rig, chat: bool, openai_clients: OpenAIClients) -> None:
    want = await reference(rig.urls[1], chat, 1)
    oai = openai_clients(rig.gw.url, "sk-alice")
    args = sdk_args(chat, 1)
    got, ids, created, usage, finish = [], set(), set(), None, None
    if chat:
        stream: Any = await oai.chat.completions.create(
            **args, stream=True, stream_options={"include_usage": True})
    else:
        stream = await oai.completions.create(
            **args, stream=True, stream_options={"include_usage": True})
    killed = None
    async for chunk in stream:
        ids.add(chunk.id)
        created.add(chunk.created)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            got.append((choice.delta.content if chat else choice.text) or "")
            finish = choice.finish_reason or finish
            assert getattr(choice, "token_ids", None) is None, choice  # not asked for
        if killed is None and len(got) == CUT_AFTER:
            killed = await running_on(rig)
            await kill(rig, killed)
    assert killed is not None
    text = "".join(got)
    assert text == want, (killed, len(text), len(want), text[-80:], want[-80:])
    assert len(ids) == 1 and len(created) == 1, (ids, created)
    assert finish == "length", finish
    assert usage is not None and usage.completion_tokens == MAX_TOKENS, usage
    metrics = rig.gw.services.metrics
    assert metrics.moves.continuations.labels("failover", "continued")._value.get() == 1


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_a_whole_answer_survives_its_backend_being_killed(
        rig: Rig, chat: bool, openai_clients: OpenAIClients) -> None:
    want = await reference(rig.urls[1], chat, 2)
    oai = openai_clients(rig.gw.url, "sk-alice")
    args = sdk_args(chat, 2)
    if chat:
        call: Any = oai.chat.completions.create(**args)
    else:
        call = oai.completions.create(**args)
    task = asyncio.ensure_future(call)
    killed = await running_on(rig)
    await kill(rig, killed)
    answer = await asyncio.wait_for(task, 60)
    choice = answer.choices[0]
    text = choice.message.content if chat else choice.text
    assert text == want, (killed, text, want)
    assert answer.usage is not None and answer.usage.completion_tokens == MAX_TOKENS
