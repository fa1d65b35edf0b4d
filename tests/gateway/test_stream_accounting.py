"""A stream read to the end counts as served, whatever the client does after ``[DONE]``.

The openai SDK (and curl) close the connection as soon as they have read ``[DONE]``; the
gateway's handler may still be cleaning up then and is cancelled. Its status, its tokens
and its ``finished`` log must not depend on the client staying connected.
"""

from __future__ import annotations

import asyncio

import openai

from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory

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
