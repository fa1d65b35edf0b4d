"""Sessions, the third fairness level, end to end through the ``openai`` SDK to the
simulator: one user's agent of many parallel calls in one session does not hold back the
same user's other session (with sessions off it does: the baseline), and another user's
share does not depend on how many sessions the first one opens. Observed in the order the
engine first scheduled the requests, as in test_scheduling.py."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from gateway.core.errors import BadRequest
from gateway.proxy.completion_request import CompletionRequest, parse_body, read_session
from gateway.proxy.endpoints import CHAT, RESPONSES, Endpoint
from tests.gateway.conftest import (
    MODEL,
    GatewayFactory,
    SimFactory,
    assert_error,
    call,
    until,
)
from tests.gateway.test_scheduling import started_order

AGENT_CALLS = 100  # the agent's parallel calls (max_tokens 20), one session
CHAT_TURNS = (2, 3)  # the other session's calls, one at a time (their max_tokens)


def sdk(url: str, key: str) -> openai.AsyncOpenAI:
    """A client for a flood of calls sent at once: building 100 requests took their one
    event loop over the SDK's default 5 s connect timeout on a loaded machine (CI)."""
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0,
                              timeout=120.0)


async def ask(client: openai.AsyncOpenAI, max_tokens: int, session: str | None) -> None:
    await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Fairgate-Session": session} if session else None)


async def agent_then_chat(sim: SimFactory, gateway: GatewayFactory,
                          sessions: bool) -> list[int]:
    """alice's agent floods AGENT_CALLS in session "agent"; once they are queued, her
    "chat" session sends CHAT_TURNS one at a time. The engine's start order."""
    backend = await sim(max_num_seqs=4)
    gw = await gateway([backend], sessions=sessions)
    client = sdk(gw.url, "sk-alice")
    store = gw.services.store
    try:
        agent = [asyncio.create_task(ask(client, 20, "agent")) for _ in range(AGENT_CALLS)]

        async def flood_queued() -> bool:
            return (await store.reads.depths(MODEL))["interactive"] >= AGENT_CALLS // 2

        await until(flood_queued, "the agent's calls queued")
        for turn in CHAT_TURNS:  # one at a time: each waits for the previous answer
            await ask(client, turn, "chat")
        await asyncio.gather(*agent)
    finally:
        await client.close()
    order = started_order([backend])
    assert len(order) == AGENT_CALLS + len(CHAT_TURNS), order
    return order


async def test_a_second_session_starts_before_the_agents_backlog_drains(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    order = await agent_then_chat(sim, gateway, sessions=True)
    last_turn = max(order.index(turn) for turn in CHAT_TURNS)
    # each turn waits about one agent call of alice's own turns plus the backend's
    # queue and batch; far ahead of the agent's backlog (100 calls)
    assert last_turn < AGENT_CALLS // 2, (
        f"the chat session's last turn started {last_turn}th; order {order}")


async def test_without_sessions_the_second_session_waits_behind_the_agent(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    order = await agent_then_chat(sim, gateway, sessions=False)
    first_turn = min(order.index(turn) for turn in CHAT_TURNS)
    assert first_turn > AGENT_CALLS // 2, (
        f"the chat session's first turn started {first_turn}th; order {order}")


async def test_another_users_share_does_not_depend_on_the_session_count(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """alice spreads 60 calls over 30 sessions, bob sends 60 in none: once both are
    queued, bob gets about half the starts (were alice's sessions users, 1/31)."""
    backend = await sim(max_num_seqs=4)
    gw = await gateway([backend], sessions=True)
    store = gw.services.store
    alice, bob = sdk(gw.url, "sk-alice"), sdk(gw.url, "sk-bob")
    try:
        calls = [asyncio.create_task(ask(alice, 20, f"s{i % 30}")) for i in range(60)]

        async def queued(n: int) -> bool:
            return (await store.reads.depths(MODEL))["interactive"] >= n

        await until(lambda: queued(40), "alice's calls queued")
        calls += [asyncio.create_task(ask(bob, 21, None)) for _ in range(60)]
        await until(lambda: queued(80), "bob's calls queued")
        ahead = sum(1 for r in backend.engine.records.values()
                    if r.first_scheduled_s is not None)
        await asyncio.gather(*calls)
    finally:
        await alice.close()
        await bob.close()
    order = started_order([backend])
    # after the requests already dispatched when bob's were all queued (one burst of
    # slack per snapshot), 40 starts: half bob's, within a few requests
    window = order[ahead + 7: ahead + 47]
    bobs = window.count(21)
    assert 14 <= bobs <= 26, f"bob started {bobs} of 40 ({window}); order {order}"


def typed(body: dict[str, Any], endpoint: Endpoint) -> CompletionRequest:
    """``body`` with a prompt for either endpoint, read as the edge reads it."""
    return parse_body({"model": "m", "messages": [{"role": "user"}], "input": "x", **body},
                      endpoint)


def test_the_session_key_comes_from_the_header_then_the_conversation() -> None:
    assert read_session("agent-7", typed({"conversation": "conv_1"}, RESPONSES)) == "agent-7"
    assert read_session(None, typed({"conversation": "conv_1"}, RESPONSES)) == "conv_1"
    assert read_session(None, typed({"conversation": {"id": "conv_2"}}, RESPONSES)) == "conv_2"
    assert read_session(None, typed({"conversation": "conv_1"}, CHAT)) == ""  # not chat's field
    assert read_session(None, typed({}, RESPONSES)) == ""
    for bad in ("", "a b", "x" * 129, "a:b", "é"):
        with pytest.raises(BadRequest):
            read_session(bad, typed({}, CHAT))
    with pytest.raises(BadRequest) as caught:
        read_session(None, typed({"conversation": 5}, RESPONSES))
    assert caught.value.param == "conversation", caught.value.param


async def test_a_bad_session_key_is_a_clear_400_only_with_sessions_on(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    backend = await sim(profile="instant")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}
    headers = {"X-Fairgate-Session": "not valid!"}
    on = await gateway([backend], sessions=True)
    status, answer, _ = await call(http, "POST", on.url + "/v1/chat/completions", json=body,
                                   headers=headers)
    assert status == 400, (status, answer)
    message = assert_error(answer, type_="invalid_request_error")
    assert "X-Fairgate-Session" in message, answer
    off = await gateway([backend])
    status, answer, _ = await call(http, "POST", off.url + "/v1/chat/completions", json=body,
                                   headers=headers)
    assert status == 200, (status, answer)
