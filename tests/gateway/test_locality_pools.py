"""routing: locality (the default with two backends) over length pools, end to end: the
official ``openai`` SDK through one gateway to a short-context and a ``long_context``
simulated backend on a real Redis. A request is never held for a backend of the other pool
because that one holds its prefix: a conversation grown past the short pool's range is
served by the long pool (the short one holds its earlier turns), and short requests
sharing a system prompt with a long one (on the long pool) are served by the short pool.
Each is awaited with a deadline far below the queue timeout; the sims' own records say
where each ran."""

from __future__ import annotations

import asyncio
import time

import openai
from openai.types.chat import ChatCompletionMessageParam

from gateway.http.server import GatewayServer
from loadtest.sim.server import SimServer
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory

SHORT_MAX = 600
POOLS = {"b0": {"max_prompt_tokens": SHORT_MAX},
         "b1": {"min_prompt_tokens": SHORT_MAX + 1, "pool": "long_context"}}
DEADLINE_S = 10.0  # the queue timeout is 300 s: a held request would wait all of it
SYSTEM = "You are the help desk of the house; answer in its style. " * 10  # ≈ 150 tokens


def client(gw: GatewayServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-app", max_retries=0)


async def ask(c: openai.AsyncOpenAI, messages: list[ChatCompletionMessageParam],
              user: str) -> float:
    """Seconds until the answer, failing past DEADLINE_S."""
    started = time.monotonic()
    try:
        await asyncio.wait_for(c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, user=user,
            extra_body={"ignore_eos": True}), DEADLINE_S)
    except TimeoutError:
        raise AssertionError(f"{user}'s request was not served within {DEADLINE_S} s") from None
    return time.monotonic() - started


def prompt_sizes(sim: SimServer) -> list[int]:
    return sorted(r.prompt_tokens for r in sim.engine.records.values())


async def test_a_conversation_grown_past_the_short_pool_is_served_by_the_long_one(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    short, long = await sim(), await sim()
    gw = await gateway([short, long], backend_options=POOLS)
    assert gw.settings.routing.mode == "auto"
    c = client(gw)
    try:
        # a conversation's first turns run on the short pool, whose index then holds them
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM}]
        for turn in range(2):
            messages.append({"role": "user", "content": f"Question {turn}: tell me more."})
            await ask(c, messages, "alice")
            messages.append({"role": "assistant", "content": "More of the same."})
        assert len(prompt_sizes(short)) == 2 and not prompt_sizes(long), \
            f"short {prompt_sizes(short)}, long {prompt_sizes(long)}"
        # grown past the short range (a pasted document): the long pool's
        messages.append({"role": "user", "content": "Summarise: " + "word " * 3000})
        grown = await ask(c, messages, "alice")
    finally:
        await c.close()
    assert len(prompt_sizes(long)) == 1 and prompt_sizes(long)[0] > SHORT_MAX, \
        f"long pool served {prompt_sizes(long)} (after {grown:.2f} s)"


async def test_short_requests_sharing_a_long_ones_system_prompt_are_served_by_the_short_pool(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    short, long = await sim(), await sim()
    gw = await gateway([short, long], backend_options=POOLS)
    c = client(gw)
    shared: ChatCompletionMessageParam = {"role": "system", "content": SYSTEM}
    try:
        # the long request lands on the long pool, whose index then holds the first block
        await ask(c, [shared, {"role": "user", "content": "Read this: " + "text " * 3000}],
                  "bob")
        times = await asyncio.gather(*(ask(c, [shared, {
            "role": "user", "content": f"A short question from {u}?"}], u)
            for u in ("carol", "dave", "erin")))
    finally:
        await c.close()
    assert len(prompt_sizes(long)) == 1 and prompt_sizes(long)[0] > SHORT_MAX, \
        f"long pool served {prompt_sizes(long)}"
    assert len(prompt_sizes(short)) == 3 and max(prompt_sizes(short)) <= SHORT_MAX, \
        f"short pool served {prompt_sizes(short)} (in {times} s)"
