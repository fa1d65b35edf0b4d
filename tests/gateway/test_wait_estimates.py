"""Wait estimates and deadlines end to end: the openai SDK over real HTTP, the simulator
behind the gateway, a real Redis. A ``max_num_seqs=1`` backend held full by two long
requests (``BusyBackend``) keeps further requests queued in Redis."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import openai
import pytest

from gateway.storage.keys import ModelKeys
from tests.gateway.conftest import (
    CHAT,
    HI,
    MODEL,
    BusyFactory,
    GatewayFactory,
    SimFactory,
    assert_error,
    call,
    until,
)

ADMIN = "sk-admin-1"
K = ModelKeys(MODEL)
HELD = {"interactive": {"max_waiting": 1}}


def chat_body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": HI, "max_tokens": max_tokens, "ignore_eos": True}


async def queue_len(gw: Any, user: str, klass: str = "interactive") -> int:
    return int(await gw.services.store.client.llen(K.queue(klass, user)))


async def queued_ids(gw: Any, user: str, n: int, klass: str = "interactive") -> list[str]:
    """Wait until ``user`` has ``n`` requests queued in Redis; their ids, oldest first."""
    client = gw.services.store.client

    async def ready() -> bool:
        return await queue_len(gw, user, klass) == n

    await until(ready, f"{n} requests of {user} queued")
    return [str(x) for x in await client.lrange(K.queue(klass, user), 0, -1)]


async def test_request_id_and_queue_wait_on_streamed_and_whole_answers(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend])
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice")
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=HI, max_tokens=3, extra_body={"ignore_eos": True})
        assert re.fullmatch(r"[0-9a-f]{32}", raw.headers["x-request-id"])
        assert int(raw.headers["x-fairgate-queue-wait-ms"]) >= 0
        assert raw.parse().usage is not None

        async with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=HI, max_tokens=4, stream=True,
                extra_body={"ignore_eos": True}) as streamed:
            stream_id = streamed.headers["x-request-id"]
            assert re.fullmatch(r"[0-9a-f]{32}", stream_id)
            assert int(streamed.headers["x-fairgate-queue-wait-ms"]) >= 0
            chunks = [c async for c in await streamed.parse()]
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 4
        assert stream_id != raw.headers["x-request-id"]

        comp = await client.completions.with_raw_response.create(
            model=MODEL, prompt="x", max_tokens=2, stream=True,
            extra_body={"ignore_eos": True})
        assert "x-request-id" in comp.headers and "x-fairgate-queue-wait-ms" in comp.headers
        [_ async for _ in comp.parse()]
    finally:
        await client.close()


async def test_status_shows_position_and_estimate_while_queued_to_its_owner_only(
        sim: SimFactory, gateway: GatewayFactory, busy: BusyFactory) -> None:
    backend = await sim(max_num_seqs=1)
    gw = await gateway([backend], classes=HELD, admin_keys=[ADMIN])
    held = busy(gw, backend)
    await held.fill()  # two dispatches measured: the estimate has a rate
    url = gw.url + "/v1/fairgate/requests/"
    async with aiohttp.ClientSession() as http:
        first, second = (asyncio.create_task(call(http, "POST", gw.url + CHAT, key="sk-bob",
                                                  json=chat_body(5))) for _ in range(2))
        ids = await queued_ids(gw, "bob", 2)
        seen = []
        for request_id in ids:
            status, body, _ = await call(http, "GET", url + request_id, key="sk-bob")
            assert status == 200, body
            assert body["id"] == request_id and body["status"] == "queued"
            assert body["model"] == MODEL and body["priority_class"] == "interactive"
            assert body["queued_ms"] >= 0
            seen.append((body["position"], body["estimated_wait_ms"]))
        assert [p for p, _ in seen] == [0, 1]
        assert seen[0][1] == 0 and seen[1][1] is not None and seen[1][1] > 0

        status, body, _ = await call(http, "GET", url + ids[1], key=ADMIN)
        assert status == 200 and body["position"] == 1
        # another user's key learns nothing, not even that it exists
        status, body, _ = await call(http, "GET", url + ids[1], key="sk-carol")
        assert status == 404
        assert_error(body, type_="invalid_request_error")
        status, body, _ = await call(http, "GET", url + "f" * 32, key="sk-bob")
        assert status == 404
        status, body, _ = await call(http, "GET", url + ids[1], key=None)
        assert status == 401

        await held.close()  # the backend frees up: bob's requests are dispatched
        results = await asyncio.gather(first, second)
        assert [r[0] for r in results] == [200, 200]
        assert {r[2]["X-Request-Id"] for r in results} == set(ids)
        status, body, _ = await call(http, "GET", url + ids[0], key="sk-bob")
        assert status == 404
        assert "no queued request" in assert_error(body, type_="invalid_request_error")


async def test_a_lower_class_request_counts_the_higher_backlog_ahead(
        sim: SimFactory, gateway: GatewayFactory, busy: BusyFactory) -> None:
    backend = await sim(max_num_seqs=1)
    gw = await gateway([backend], classes={"interactive": {"max_waiting": 1},
                                           "default": {"max_waiting": 1}})
    held = busy(gw, backend)
    await held.fill()
    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(call(http, "POST", gw.url + CHAT, key=key,
                                          json=chat_body(3)))
                 for key in ("sk-carol", "sk-carol", "sk-bob")]
        await queued_ids(gw, "carol", 2)
        await queued_ids(gw, "bob", 1)
        tasks.append(asyncio.create_task(call(http, "POST", gw.url + CHAT, key="sk-dflt",
                                              json=chat_body(3))))
        [dave_id] = await queued_ids(gw, "dave", 1, "default")
        status, body, _ = await call(http, "GET", gw.url + "/v1/fairgate/requests/" + dave_id,
                                     key="sk-dflt")
        assert status == 200, body
        assert body["priority_class"] == "default"
        # three interactive requests go first (no floor owed yet), nobody in its class
        assert (body["position"], body["ahead_in_class"]) == (3, 0)
        assert body["estimated_wait_ms"] > 0
        await held.close()
        results = await asyncio.gather(*tasks)
    assert [r[0] for r in results] == [200] * 4


async def test_an_unmeetable_deadline_is_refused_at_once_through_the_sdk(
        sim: SimFactory, gateway: GatewayFactory, busy: BusyFactory) -> None:
    backend = await sim(max_num_seqs=1)
    gw = await gateway([backend], classes=HELD)
    held = busy(gw, backend)
    await held.fill()
    for _ in range(3):
        held.send("sk-bob", chat_body(5))
    await queued_ids(gw, "bob", 3)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-bob", max_retries=0,
                                timeout=30)
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=9, extra_body={"ignore_eos": True},
                extra_headers={"X-Fairgate-Deadline-Ms": "1000"})
    finally:
        await client.close()
    assert refused.value.code == "deadline_unmeetable"
    headers = refused.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"])
    # three ahead at a rate of at most 2/s (two dispatches, measured over at least 1 s)
    assert "3 requests ahead" in refused.value.message
    # refused before queueing: bob's three are all that is queued
    assert await queue_len(gw, "bob") == 3
    await held.close()
    assert all(r.max_tokens != 9 for r in backend.engine.records.values())


@pytest.mark.parametrize("via", ["header", "class"])
async def test_a_deadline_that_passes_while_queued_leaves_the_queue_undispatched(
        sim: SimFactory, gateway: GatewayFactory, busy: BusyFactory, via: str) -> None:
    backend = await sim(max_num_seqs=1)
    classes: dict[str, dict[str, Any]] = {"interactive": {"max_waiting": 1}}
    if via == "class":
        classes["interactive"]["ttft_slo_ms"] = 1500
    gw = await gateway([backend], classes=classes)
    held = busy(gw, backend)
    await held.fill()
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-bob", max_retries=0,
                                timeout=30)
    headers = {"X-Fairgate-Deadline-Ms": "1500"} if via == "header" else {}
    try:
        late = asyncio.create_task(client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=7, extra_body={"ignore_eos": True},
            extra_headers=headers))
        [request_id] = await queued_ids(gw, "bob", 1)  # estimate 0: nothing ahead
        with pytest.raises(openai.RateLimitError) as expired:
            await late
    finally:
        await client.close()
    assert expired.value.code == "deadline_unmeetable"
    assert "passed while the request was queued" in expired.value.message
    assert expired.value.response.headers["x-request-id"] == request_id
    assert int(expired.value.response.headers["retry-after"]) >= 1
    store = gw.services.store
    assert await queue_len(gw, "bob") == 0
    assert await store.reads.request_fields(MODEL, request_id) == {}
    await held.close()
    await backend.engine.wait_until(lambda: backend.engine.num_running == 0)
    # never dispatched: the backend saw no request of bob's
    assert all(r.max_tokens != 7 for r in backend.engine.records.values())


@pytest.mark.parametrize("value", ["0", "-5", "abc", "1.5", "", "99999999999", "１２"])
async def test_a_malformed_deadline_is_a_400(sim: SimFactory, gateway: GatewayFactory,
                                             value: str) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend])
    async with aiohttp.ClientSession() as http:
        status, body, _ = await call(http, "POST", gw.url + CHAT, key="sk-bob",
                                     json=chat_body(2),
                                     headers={"X-Fairgate-Deadline-Ms": value})
    assert status == 400
    assert "X-Fairgate-Deadline-Ms" in assert_error(body, type_="invalid_request_error")


async def test_queue_timeout_retry_after_comes_from_the_drain_rate(
        sim: SimFactory, gateway: GatewayFactory, busy: BusyFactory) -> None:
    """Three interactive requests queued ahead of a default one, behind a backend that
    served two: when the default one times out it is told to come back once the measured
    rate drained them (at most 2/s: at least 2 s), not after the 1 s constant."""
    backend = await sim(max_num_seqs=1)
    gw = await gateway([backend], classes={
        "interactive": {"max_waiting": 1},
        "default": {"max_waiting": 1, "max_queue_wait_s": 0.5}})
    held = busy(gw, backend)
    await held.fill()
    async with aiohttp.ClientSession() as http:
        ahead = [asyncio.create_task(call(http, "POST", gw.url + CHAT, key="sk-carol",
                                          json=chat_body(3))) for _ in range(3)]
        await queued_ids(gw, "carol", 3)
        status, body, headers = await call(http, "POST", gw.url + CHAT, key="sk-dflt",
                                           json=chat_body(3))
        assert status == 504
        assert_error(body, type_="server_error", code="queue_timeout")
        assert int(headers["Retry-After"]) >= 2
        await held.close()
        assert [r[0] for r in await asyncio.gather(*ahead)] == [200] * 3


async def test_a_deadline_shorter_than_dispatch_to_first_token_is_refused_at_once(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """The queue is empty, but a long prompt's prefill alone outlasts the deadline: the
    measured time from dispatch to first token counts against it."""
    gw = await gateway([await sim()])  # the H100 profile: a 12k-token prefill takes ~0.2 s
    long_prompt = [{"role": "user", "content": "tok " * 12000}]
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice", timeout=30)
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=long_prompt, max_tokens=2, stream=True)  # type: ignore[arg-type]
        [_ async for _ in stream]
        after = gw.services.admission.waits.to_first_token_s(MODEL)
        assert after > 0.05, after
        deadline_ms = int(after * 1000 / 2)
        with pytest.raises(openai.RateLimitError) as err:
            await client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=2,
                extra_headers={"X-Fairgate-Deadline-Ms": str(deadline_ms)})
        assert err.value.code == "deadline_unmeetable"
        assert "dispatch to first token" in err.value.message
    finally:
        await client.close()


async def test_a_users_deadline_request_goes_ahead_of_its_own_older_one(
        sim: SimFactory, gateway: GatewayFactory, busy: BusyFactory) -> None:
    backend = await sim(max_num_seqs=1)
    gw = await gateway([backend], classes=HELD)
    held = busy(gw, backend)
    await held.fill()
    async with aiohttp.ClientSession() as http:
        older = asyncio.create_task(call(http, "POST", gw.url + CHAT, key="sk-bob",
                                         json=chat_body(5)))
        await queued_ids(gw, "bob", 1)
        urgent = asyncio.create_task(call(
            http, "POST", gw.url + CHAT, key="sk-bob", json=chat_body(6),
            headers={"X-Fairgate-Deadline-Ms": "60000"}))
        ids = await queued_ids(gw, "bob", 2)
        await held.close()
        results = await asyncio.gather(older, urgent)
    assert [r[0] for r in results] == [200, 200]
    assert ids == [results[1][2]["X-Request-Id"], results[0][2]["X-Request-Id"]]
    # earliest deadline first: granted first, so it carries the lower vLLM priority (its
    # user's rank) when both go in one decision, or starts first when they go one by one.
    # (The engine's start order alone races: two requests granted together reach a free
    # slot in whichever order their connections land.)
    records = [r for r in backend.engine.records.values() if r.max_tokens in (5, 6)]
    started = sorted(records, key=lambda r: (r.priority, r.first_scheduled_s or float("inf")))
    assert [r.max_tokens for r in started] == [6, 5], [
        (r.max_tokens, r.priority, r.first_scheduled_s) for r in records]
