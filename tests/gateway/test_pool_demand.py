"""The pools' demand and capacity end to end (issue 25, item 1): queued demand in tokens,
the backend's measured service rate, wait estimates and the desired replicas, the same on
``GET /admin/pools`` and ``/metrics``. A ``max_num_seqs=1`` simulator held full by two long
requests keeps further requests queued in Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.storage.keys import ModelKeys
from tests.gateway.conftest import (
    CHAT,
    MODEL,
    BusyFactory,
    GatewayFactory,
    SimFactory,
    auth,
    call,
    until,
)

ADMIN = "sk-admin"
K = ModelKeys(MODEL)


def chat(content: str, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "ignore_eos": True}


async def pools(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    status, body, _ = await call(http, "GET", url + "/admin/pools", key=ADMIN)
    assert status == 200, body
    return {p["pool"]: p for p in body["data"]}


def gauges(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_queued_demand_service_rate_and_desired_replicas(
        sim: SimFactory, gateway: GatewayFactory, busy: BusyFactory) -> None:
    backend = await sim(max_num_seqs=1)
    gw = await gateway([backend], classes={"interactive": {"max_waiting": 1}},
                       admin_keys=[ADMIN], autoscale={"interval_s": 0.05})
    async with aiohttp.ClientSession() as http:
        for _ in range(3):  # finished requests: the service rate and output per request
            status, body, _ = await call(http, "POST", gw.url + CHAT, json=chat("hi", 4))
            assert status == 200, body

        async def measured() -> bool:
            view = (await pools(http, gw.url))[MODEL]
            return bool(view["backends"][0]["service_requests_per_s"] > 0)

        await until(measured, "the backend's service rate measured from its counters")
        held = busy(gw, backend)
        await held.fill()
        queued = [asyncio.create_task(call(http, "POST", gw.url + CHAT, key="sk-bob",
                                           json=chat("x" * 400, 5))) for _ in range(4)]

        async def four_queued() -> bool:
            return int(await gw.services.store.client.llen(K.queue("interactive", "bob"))) == 4

        await until(four_queued, "bob's four requests queued in Redis")

        async def seen() -> bool:
            view = (await pools(http, gw.url))[MODEL]
            return bool(view["classes"]["interactive"]["queued_requests"] == 4)

        await until(seen, "the pools loop to count the queued requests")
        view = (await pools(http, gw.url))[MODEL]
        ids = await gw.services.store.client.lrange(K.queue("interactive", "bob"), 0, -1)
        prompt = [int(await gw.services.store.client.hget(K.request(i), "ptok")) for i in ids]
        interactive = view["classes"]["interactive"]
        # each queued request: its estimated uncached prompt plus the measured output per
        # finished request (vLLM's generation tokens over its finished requests: the
        # three short ones' 4 each, and what the long ones generated so far)
        output = view["output_tokens_per_request"]
        assert output >= 4.0, view
        expected = sum(prompt) * view["uncached_prompt_share"] + 4 * output
        assert interactive["queued_demand_tokens"] == pytest.approx(expected), (view, prompt)
        assert interactive["target_s"] == 2.0, interactive
        waits = interactive["wait_estimate_s"]
        assert waits["0.5"] is not None and waits["0.9"] >= waits["0.5"] > 0, waits
        assert view["ready_replicas"] == 1 and view["desired_replicas"] >= 1, view
        [b0] = view["backends"]
        assert b0["name"] == "b0" and b0["service_tokens_per_s"] > 0, b0

        async with http.get(gw.url + "/metrics", headers=auth(None)) as resp:
            parsed = gauges(await resp.text())

        def gauge(name: str, **labels: str) -> float:
            return parsed[(name, frozenset(labels.items()))]

        assert gauge("fairgate_pool_queued_requests", pool=MODEL,
                     priority_class="interactive") == 4
        # (a later tick of the loop than the view: the measured output per request and
        # the cache hit share move as the long requests run)
        assert gauge("fairgate_pool_queued_demand_tokens", pool=MODEL,
                     priority_class="interactive") >= 4 * 4.0
        assert gauge("fairgate_pool_desired_replicas", pool=MODEL) >= 1
        assert gauge("fairgate_pool_ready_replicas", pool=MODEL) == 1
        assert gauge("fairgate_backend_service_requests_per_second", backend="b0") > 0
        assert gauge("fairgate_pool_wait_estimate_seconds", pool=MODEL,
                     priority_class="interactive", quantile="0.5") > 0
        assert ("fairgate_pool_requests_at_risk",
                frozenset({("pool", MODEL), ("priority_class", "interactive")})) in parsed

        await held.close()
        results = await asyncio.gather(*queued)
        assert [r[0] for r in results] == [200] * 4, results
