"""The official openai SDK straight against a real vLLM (CPU) server."""

from __future__ import annotations

import openai
import pytest

from tests.e2e_vllm.conftest import VllmServer

pytestmark = pytest.mark.vllm
IGNORE_EOS = {"ignore_eos": True}


async def test_chat_and_completions_stream_and_not(vllm_server: VllmServer) -> None:
    client = openai.AsyncOpenAI(base_url=vllm_server.api, api_key="unused", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == [vllm_server.model]

        chat = await client.chat.completions.create(
            model=vllm_server.model,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=8,
            extra_body=IGNORE_EOS,
        )
        assert chat.usage is not None
        assert chat.usage.completion_tokens == 8
        assert chat.usage.prompt_tokens > 0
        assert chat.choices[0].finish_reason == "length"

        comp = await client.completions.create(
            model=vllm_server.model, prompt="the queue", max_tokens=5, extra_body=IGNORE_EOS
        )
        assert comp.usage is not None and comp.usage.completion_tokens == 5
        assert comp.choices[0].finish_reason == "length"

        stream = await client.chat.completions.create(
            model=vllm_server.model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
        assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)

        cstream = await client.completions.create(
            model=vllm_server.model,
            prompt="a fair",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
        parts = [c async for c in cstream]
        assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 4

        # without include_usage vLLM sends no usage frame
        plain = await client.completions.create(
            model=vllm_server.model, prompt="x", max_tokens=3, stream=True, extra_body=IGNORE_EOS
        )
        assert all(c.usage is None for c in [c async for c in plain])
    finally:
        await client.close()


async def test_priority_field_and_header_accepted(vllm_server: VllmServer) -> None:
    """With --scheduling-policy priority, vLLM takes a non-zero priority (body or header)."""
    client = openai.AsyncOpenAI(base_url=vllm_server.api, api_key="unused", max_retries=0)
    try:
        body = await client.completions.create(
            model=vllm_server.model,
            prompt="p",
            max_tokens=2,
            extra_body={**IGNORE_EOS, "priority": 1234},
        )
        assert body.usage is not None and body.usage.completion_tokens == 2
        header = await client.chat.completions.create(
            model=vllm_server.model,
            messages=[{"role": "user", "content": "p"}],
            max_tokens=2,
            extra_body=IGNORE_EOS,
            extra_headers={"X-Vllm-Priority": "-5"},
        )
        assert header.usage is not None and header.usage.completion_tokens == 2
    finally:
        await client.close()


async def test_openai_style_error(vllm_server: VllmServer) -> None:
    client = openai.AsyncOpenAI(base_url=vllm_server.api, api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError) as info:
            await client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        assert info.value.status_code == 404
    finally:
        await client.close()
