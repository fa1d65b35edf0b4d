"""Per-key and per-tenant limits and budgets, end to end through the openai SDK, and the
budget script under heavy concurrency on a real Redis."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from gateway.core.errors import InsufficientQuota, RateLimitExceeded
from gateway.core.settings import ApiKey, SettingsHolder, load_settings
from gateway.http.server import GatewayServer
from gateway.proxy.completion_request import parse_body
from gateway.proxy.endpoints import COMPLETIONS, RESPONSES
from gateway.scheduling.quotas import Quotas
from gateway.storage.redis_client import connect
from policies.cost import prompt_token_bound
from tests.batch.test_batch_api import jsonl, wait_status
from tests.gateway.conftest import KEYS, MODEL, GatewayFactory, SimFactory, call, until

LIMITED = [*KEYS,
           {"key": "sk-rpm", "user": "rita", "limits": {"rpm": 3}},
           {"key": "sk-budget", "user": "bud", "tenant": "fin",
            "limits": {"daily_tokens": 60, "tpm": 100000}},
           {"key": "sk-t1", "user": "tim", "tenant": "team"},
           {"key": "sk-t2", "user": "tom", "tenant": "team"},
           {"key": "sk-bbatch", "user": "bea", "priority_class": "batch",
            "limits": {"daily_tokens": 100}},
           {"key": "sk-bbig", "user": "bo", "priority_class": "batch",
            "limits": {"daily_tokens": 2000}}]
TENANTS = {"team": {"weight": 1, "limits": {"max_concurrent": 1}}}


def sdk(gw: GatewayServer, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def limited_gateway(sim: SimFactory, gateway: GatewayFactory, **extra: Any
                          ) -> GatewayServer:
    backend = await sim(profile="instant")
    return await gateway([backend], api_keys=LIMITED, tenants=TENANTS,
                         admin_keys=["sk-admin"], **extra)


async def test_rate_limit_headers_and_429_through_the_sdk(sim: SimFactory,
                                                          gateway: GatewayFactory) -> None:
    gw = await limited_gateway(sim, gateway)
    client = sdk(gw, "sk-rpm")
    try:
        remaining = []
        for _ in range(3):
            raw = await client.completions.with_raw_response.create(
                model=MODEL, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
            assert raw.headers["x-ratelimit-limit-requests"] == "3"
            assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
            remaining.append(int(raw.headers["x-ratelimit-remaining-requests"]))
            raw.parse()
        assert remaining == [2, 1, 0]
        with pytest.raises(openai.RateLimitError) as caught:
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert caught.value.code == "rate_limit_exceeded"
        headers = caught.value.response.headers
        assert 1 <= int(headers["retry-after"]) <= 20  # one request refills in 20 s
        assert headers["x-ratelimit-remaining-requests"] == "0"
        # a stream's headers carry them too (sk-budget: a tpm limit, no rpm)
        budget, alice = sdk(gw, "sk-budget"), sdk(gw, "sk-alice")
        async with budget.chat.completions.with_streaming_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                stream=True) as streamed:
            assert streamed.headers["x-ratelimit-limit-tokens"] == "100000"
            assert int(streamed.headers["x-ratelimit-remaining-tokens"]) < 100000
            assert "x-ratelimit-limit-requests" not in streamed.headers
            async for _ in streamed.iter_lines():
                pass
        # a key without limits: no such headers
        raw = await alice.completions.with_raw_response.create(
            model=MODEL, prompt="hi", max_tokens=2)
        assert not any(h.startswith("x-ratelimit") for h in raw.headers)
        await budget.close()
        await alice.close()
    finally:
        await client.close()


async def test_daily_budget_insufficient_quota_and_exact_accounting(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    gw = await limited_gateway(sim, gateway)
    client = sdk(gw, "sk-budget")
    spent = 0
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            for _ in range(100):
                answer = await client.completions.create(
                    model=MODEL, prompt="hello there", max_tokens=4,
                    extra_body={"ignore_eos": True})
                assert answer.usage is not None
                spent += answer.usage.prompt_tokens + answer.usage.completion_tokens
        assert caught.value.code == "insufficient_quota"
        assert caught.value.status_code == 429
        assert int(caught.value.response.headers["retry-after"]) <= 86400
        reserve = prompt_token_bound(parse_body({"model": MODEL, "prompt": "hello there"},
                                                    COMPLETIONS).prompt) + 4
        assert spent > 0 and spent + reserve > 60  # refused only when it no longer fits
        # the key sees its budget: charged exactly what vLLM reported
        status, usage, _ = await call(http, "GET", gw.url + "/v1/fairgate/usage",
                                      key="sk-budget")
        assert status == 200, usage
        assert usage["tenant"] == "fin" and usage["user"] == "bud"
        (scope,) = usage["limits"]
        assert scope["scope"] == "key" and scope["limits"]["daily_tokens"] == 60
        assert scope["daily_tokens_used"] == spent
        assert scope["daily_tokens_remaining"] == 60 - spent
        assert 0 < scope["tokens_remaining"] <= 100000
        # and so does an admin
        status, view, _ = await call(http, "GET",
                                     gw.url + f"/admin/keys/{usage['key_id']}/usage",
                                     key="sk-admin")
        assert status == 200 and view["limits"][0]["daily_tokens_used"] == spent
    finally:
        await client.close()


async def test_responses_reservation_holds_max_output_tokens(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """A /v1/responses request reserves its ``max_output_tokens`` against the budget, as
    chat reserves ``max_tokens``: 1 prompt token + 100 output tokens do not fit a
    60-token day and are refused before they queue; 1 + 8 do."""
    gw = await limited_gateway(sim, gateway)
    client = sdk(gw, "sk-budget")
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            answer = await client.responses.create(model=MODEL, input="hi",
                                                   max_output_tokens=100)
            pytest.fail(f"served despite a 101-token reservation: usage {answer.usage}")
        assert caught.value.code == "insufficient_quota", caught.value.body
        raw = await client.responses.with_raw_response.create(
            model=MODEL, input="hi", max_output_tokens=8)
        # the tpm bucket shows the reservation: the prompt's bound plus the output bound
        reserved = 100000 - int(raw.headers["x-ratelimit-remaining-tokens"])
        assert reserved == prompt_token_bound(
            parse_body({"model": MODEL, "input": "hi"}, RESPONSES).prompt) + 8, reserved
        assert raw.parse().usage is not None
    finally:
        await client.close()


async def test_tenant_concurrency_limit_is_shared_by_its_keys(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    gw = await limited_gateway(sim, gateway)
    first, second = sdk(gw, "sk-t1"), sdk(gw, "sk-t2")
    try:
        stream = await first.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10000,
            stream=True, extra_body={"ignore_eos": True})
        chunks = stream.__aiter__()
        await chunks.__anext__()  # running: the tenant's one slot is taken
        with pytest.raises(openai.RateLimitError) as caught:
            await second.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert caught.value.code == "rate_limit_exceeded"
        assert "tenant 'team'" in caught.value.message
        await stream.close()  # the slot frees when the first request ends

        async def admitted() -> bool:
            try:
                await second.completions.create(model=MODEL, prompt="hi", max_tokens=2)
                return True
            except openai.RateLimitError:
                return False

        await until(admitted, "the tenant's slot freed")
    finally:
        await first.close()
        await second.close()


async def test_concurrent_requests_never_overspend_the_budget(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """Many clients at once on two replicas: the budget admits what it holds, no more."""
    backend = await sim(profile="instant")
    keys = [{"key": "sk-many", "user": "many", "limits": {"daily_tokens": 400}}]
    a = await gateway([backend], api_keys=keys)
    b = await gateway([backend], api_keys=keys)
    clients = [sdk(a, "sk-many"), sdk(b, "sk-many")]

    async def one(i: int) -> int:
        try:
            answer = await clients[i % 2].completions.create(
                model=MODEL, prompt="hi", max_tokens=8, extra_body={"ignore_eos": True})
        except openai.RateLimitError as exc:
            assert exc.code == "insufficient_quota"
            return 0
        assert answer.usage is not None
        return answer.usage.total_tokens

    try:
        spent = await asyncio.gather(*(one(i) for i in range(60)))
    finally:
        for c in clients:
            await c.close()
    served = [s for s in spent if s]
    assert 0 < sum(served) <= 400, served  # never more spent than the budget holds
    async with aiohttp.ClientSession() as http:
        status, usage, _ = await call(http, "GET", a.url + "/v1/fairgate/usage",
                                      key="sk-many")
    assert status == 200
    assert usage["limits"][0]["daily_tokens_used"] == sum(served)  # no lost count


def _key(limits: dict[str, int], tenant: str = "acme") -> ApiKey:
    return ApiKey(key="", id="k1", user="u", tenant=tenant, weight=1.0,
                  limits=limits)  # type: ignore[arg-type]


async def test_budget_script_admits_exactly_what_fits_under_concurrency(
        redis: aioredis.Redis, redis_url: str) -> None:
    settings = load_settings(None, redis_url=redis_url)
    clients = [connect(redis_url) for _ in range(4)]
    replicas = [Quotas(c, SettingsHolder(settings)) for c in clients]
    key = _key({"daily_tokens": 1000, "monthly_tokens": 5000})

    async def admit(i: int) -> Any:
        try:
            return await replicas[i % 4].admit(key, uuid.uuid4().hex, 10)
        except InsufficientQuota:
            return None

    try:
        held = await asyncio.gather(*(admit(i) for i in range(400)))
        admitted = [h for h in held if h is not None]
        assert len(admitted) == 100  # 1000 / 10, across four clients at once
        day_key = admitted[0].keys[3]
        assert int(await redis.get(day_key)) == 1000
        # each used 7 tokens in the end: the reservations are corrected
        await asyncio.gather(*(replicas[0].settle(h, 7) for h in admitted))
        assert int(await redis.get(day_key)) == 700
        assert int(await redis.get(admitted[0].keys[4])) == 700

        # concurrency slots: exactly max_concurrent at once
        conc = _key({"max_concurrent": 5}, tenant="other")

        async def slot(i: int) -> Any:
            try:
                return await replicas[i % 4].admit(conc, uuid.uuid4().hex, 1)
            except RateLimitExceeded as exc:
                assert exc.code == "rate_limit_exceeded"
                return None

        slots = [h for h in await asyncio.gather(*(slot(i) for i in range(50))) if h]
        assert len(slots) == 5
    finally:
        for c in clients:
            await c.aclose()


async def test_a_dead_replicas_slots_expire(redis: aioredis.Redis, redis_url: str) -> None:
    """No heartbeat renews the slot of a replica that died: its lease runs out."""
    settings = load_settings(None, redis_url=redis_url, quota_lease_s=0.3)
    client = connect(redis_url)
    try:
        holder = SettingsHolder(settings)
        dead, alive = Quotas(client, holder), Quotas(client, holder)
        key = _key({"max_concurrent": 1})
        await dead.admit(key, "held-by-dead", 1)  # never settled, never renewed
        with pytest.raises(RateLimitExceeded):
            await alive.admit(key, "r2", 1)

        async def free() -> bool:
            try:
                await alive.admit(key, "r3", 1)
                return True
            except RateLimitExceeded:
                return False

        await until(free, "the dead replica's slot expired")
        # a live replica's heartbeat renews its slot's lease
        conc_key = alive.held["r3"].keys[2]
        first = await redis.zscore(conc_key, "r3")
        runner = asyncio.create_task(alive.run())
        try:
            async def renewed() -> bool:
                return (await redis.zscore(conc_key, "r3") or 0) > (first or 0)

            await until(renewed, "the heartbeat renewed the slot's lease")
        finally:
            runner.cancel()
    finally:
        await client.aclose()


async def test_batch_stops_at_the_owners_budget(sim: SimFactory, gateway: GatewayFactory,
                                                tmp_path: Any) -> None:
    gw = await limited_gateway(sim, gateway, data_dir=tmp_path, batch_poll_s=0.05,
                               batch_max_in_flight=2)
    c = sdk(gw, "sk-bbatch")
    try:
        f = await c.files.create(file=("in.jsonl", jsonl(30)), purpose="batch")
        batch = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
        done = await wait_status(c, batch.id, {"completed", "failed", "expired"})
        assert done.status == "completed", done
        counts = done.request_counts
        assert counts is not None and counts.total == 30
        assert counts.completed + counts.failed == 30
        assert 0 < counts.completed < 30 and done.error_file_id
        errors = [json.loads(x) for x in
                  (await c.files.content(done.error_file_id)).text.splitlines()]
        assert len(errors) == counts.failed
        assert {e["error"]["code"] for e in errors} == {"insufficient_quota"}
        out = [json.loads(x) for x in
               (await c.files.content(done.output_file_id or "")).text.splitlines()]
        used = sum(x["response"]["body"]["usage"]["total_tokens"] for x in out)
        assert used <= 100
        ids = {x["custom_id"] for x in out} | {e["custom_id"] for e in errors}
        assert ids == {f"req-{i}" for i in range(30)}  # nothing silently dropped
    finally:
        await c.close()


async def test_a_batch_line_over_the_budget_fails_alone(sim: SimFactory, gateway: GatewayFactory,
                                                        tmp_path: Any) -> None:
    """A line whose reservation (5,000 output tokens) exceeds the whole 2,000-token day
    fails ``insufficient_quota`` on its own; the 30 small lines after it all run within
    the budget. Before: its refusal failed every line not yet fed (30 of 31)."""
    gw = await limited_gateway(sim, gateway, data_dir=tmp_path, batch_poll_s=0.05,
                               batch_max_in_flight=2)
    big = json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": MODEL, "max_tokens": 5000,
                               "messages": [{"role": "user", "content": "everything"}]}})
    c = sdk(gw, "sk-bbig")
    try:
        f = await c.files.create(file=("in.jsonl", big.encode() + b"\n" + jsonl(30)),
                                 purpose="batch")
        batch = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
        done = await wait_status(c, batch.id, {"completed", "failed", "expired"})
        assert done.status == "completed", done
        errors = [json.loads(x) for x in (await c.files.content(done.error_file_id or "")
                                          ).text.splitlines()]
        failed = {e["custom_id"]: e["error"]["code"] for e in errors}
        assert failed == {"big": "insufficient_quota"}, f"failed lines: {failed}"
        out = [json.loads(x) for x in
               (await c.files.content(done.output_file_id or "")).text.splitlines()]
        used = sum(x["response"]["body"]["usage"]["total_tokens"] for x in out)
        assert len(out) == 30 and used <= 2000, f"{len(out)} lines answered, {used} used"
    finally:
        await c.close()
