"""The official openai SDK, sync and async, through the gateway to the simulator."""

from __future__ import annotations

import asyncio

import openai

from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory


async def test_async_chat_and_completions_stream_and_not(sim: SimFactory,
                                                         gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend])
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice")
    try:
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            extra_body={"ignore_eos": True})
        assert chat.usage is not None and chat.usage.completion_tokens == 5
        assert chat.choices[0].finish_reason == "length"

        comp = await client.completions.create(model=MODEL, prompt="hello", max_tokens=4,
                                               extra_body={"ignore_eos": True})
        assert comp.usage is not None and comp.usage.completion_tokens == 4

        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 6

        # without include_usage the client gets no usage frame (fairgate asked for one)
        plain = await client.completions.create(model=MODEL, prompt="x", max_tokens=3,
                                                stream=True, extra_body={"ignore_eos": True})
        parts = [c async for c in plain]
        assert all(c.usage is None for c in parts)
        assert sum(1 for c in parts if c.choices and c.choices[0].text) == 3

        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
    finally:
        await client.close()
    inflight = await gw.services.store.reads.user_inflight(MODEL)
    assert inflight == {}


async def test_sync_client_in_a_thread(sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend])

    def call() -> tuple[int, int]:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-bob")
        try:
            r = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                extra_body={"ignore_eos": True})
            s = client.completions.create(model=MODEL, prompt="p", max_tokens=2, stream=True,
                                          extra_body={"ignore_eos": True})
            streamed = sum(1 for c in s if c.choices and c.choices[0].text)
            assert r.usage is not None
            return r.usage.completion_tokens, streamed
        finally:
            client.close()

    assert await asyncio.to_thread(call) == (3, 2)
