"""The pools' demand and capacity end to end (issue 25, item 1): queued demand in tokens,
the backend's measured service rate, wait estimates and the desired replicas, the same on
``GET /admin/pools`` and ``/metrics``. A ``max_num_seqs=1`` simulator held full by two long
requests keeps further requests queued in Redis."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.storage.keys import ModelKeys
from policies.autoscale import BURST
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
        assert waits["p50"] is not None and waits["p90"] >= waits["p50"] > 0, waits
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
                     priority_class="interactive", percentile="p50") > 0
        assert ("fairgate_pool_requests_at_risk",
                frozenset({("pool", MODEL), ("priority_class", "interactive")})) in parsed

        await held.close()
        results = await asyncio.gather(*queued)
        assert [r[0] for r in results] == [200] * 4, results


async def test_a_burst_baseline_window_adds_its_need_to_the_pools_view(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """``autoscale.burst_baseline_s`` reaches the policy: the pool's needs show the room
    kept over the usual load (BURST, policies/autoscale.py with_burst_baseline),
    and the desired replicas cover it."""
    backend = await sim()
    gw = await gateway([backend], admin_keys=[ADMIN], autoscale={
        "interval_s": 0.05, "target_utilization": 0.25, "burst_baseline_s": 60.0,
        "backend_tokens_per_s": 1000.0})
    async with aiohttp.ClientSession() as http:
        async def shown() -> bool:
            return BURST in (await pools(http, gw.url))[MODEL]["class_needs"]

        await until(shown, "the burst room among the pool's needs")
        view = (await pools(http, gw.url))[MODEL]
        room = view["class_needs"][BURST]
        assert room >= 0 and view["needed_replicas"] >= room, view
        assert view["desired_replicas"] >= math.ceil(room - 1e-9), view


# b0 the short-context pool (named after the model), b1 the long_context one
SHORT_MAX = 600
RANGES: dict[str, dict[str, Any]] = {
    "b0": {"max_prompt_tokens": SHORT_MAX},
    "b1": {"min_prompt_tokens": SHORT_MAX + 1, "pool": "long_context"}}


async def test_each_pool_counts_the_requests_its_range_takes(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """One model, two length-aware pools, both drained (nothing dispatched): each pool
    counts the queued requests whose prompt it takes and asks for a backend for them."""
    short, long = await sim(profile="instant"), await sim(profile="instant")
    gw = await gateway([short, long], backend_options=RANGES, admin_keys=[ADMIN],
                       autoscale={"interval_s": 0.05})
    async with aiohttp.ClientSession() as http:
        for name in ("b0", "b1"):
            status, body, _ = await call(http, "POST", gw.url + f"/admin/backends/{name}/drain",
                                         key=ADMIN)
            assert status == 200, body
        sizes = [10, 20, 30, 4 * (SHORT_MAX + 200), 4 * (SHORT_MAX + 400)]  # characters
        queued = [asyncio.create_task(call(http, "POST", gw.url + CHAT,
                                           json=chat(f"{i} " + "w" * n, 2)))
                  for i, n in enumerate(sizes)]

        async def counted() -> bool:
            views = await pools(http, gw.url)
            return bool(views[MODEL]["classes"]["interactive"]["queued_requests"] == 3
                        and views["long_context"]["classes"]["interactive"][
                            "queued_requests"] == 2)

        await until(counted, "each pool to count the requests its range takes")
        views = await pools(http, gw.url)
        for name in (MODEL, "long_context"):
            view = views[name]
            # drained: nothing takes work, yet work is queued: at least one backend
            assert (view["ready_replicas"], view["desired_replicas"]) == (0, 1), view
        assert [b["name"] for b in views[MODEL]["backends"]] == ["b0"]
        assert [b["name"] for b in views["long_context"]["backends"]] == ["b1"]
        short_tokens = views[MODEL]["classes"]["interactive"]["queued_demand_tokens"]
        long_tokens = views["long_context"]["classes"]["interactive"]["queued_demand_tokens"]
        assert long_tokens > short_tokens > 0, views

        for name in ("b0", "b1"):
            await call(http, "POST", gw.url + f"/admin/backends/{name}/undrain", key=ADMIN)
        results = await asyncio.gather(*queued)
        assert [r[0] for r in results] == [200] * 5, results
    assert len(short.engine.records) == 3 and len(long.engine.records) == 2


async def test_batch_backlog_buys_backends_only_when_its_window_is_at_risk(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """One batch request queued (its backend drained) stands for a batch of 100 lines
    (the Batch API feeds a few at a time): 99 more at its size. A day left: no backend for
    it beyond the one its queued request needs; a minute left: enough to finish in time."""
    backend = await sim(profile="instant")
    gw = await gateway([backend], admin_keys=[ADMIN],
                       autoscale={"interval_s": 0.05, "backend_tokens_per_s": 100.0})
    watch = gw.services.pools
    expires = {"at": time.time() + 86400}

    async def backlog() -> tuple[int, float | None]:
        return 100, expires["at"]

    watch.batch_backlog = backlog
    async with aiohttp.ClientSession() as http:
        status, body, _ = await call(http, "POST", gw.url + "/admin/backends/b0/drain",
                                     key=ADMIN)
        assert status == 200, body
        queued = asyncio.create_task(call(http, "POST", gw.url + CHAT, key="sk-batch",
                                          json=chat("summarise this", 2)))

        async def counted() -> bool:
            view = (await pools(http, gw.url))[MODEL]
            return bool(view["classes"]["batch"]["queued_requests"] == 100)

        await until(counted, "the queued batch request and the 99 lines behind it")
        view = (await pools(http, gw.url))[MODEL]
        assert not view["batch_window_at_risk"], view
        assert view["desired_replicas"] == 1, view
        assert view["batch_window_left_s"] > 86000, view

        expires["at"] = time.time() + 60

        async def at_risk() -> bool:
            return bool((await pools(http, gw.url))[MODEL]["batch_window_at_risk"])

        await until(at_risk, "the window of a minute to be at risk")
        view = (await pools(http, gw.url))[MODEL]
        batch = view["classes"]["batch"]
        # 100 requests of (prompt + 256 expected output) tokens in 80 % of the minute left
        # at 100 tokens/s per backend
        need = batch["queued_demand_tokens"] / (0.8 * view["batch_window_left_s"]) / 100.0
        assert view["desired_replicas"] == math.ceil(need) >= 4, (need, view)

        await call(http, "POST", gw.url + "/admin/backends/b0/undrain", key=ADMIN)
        status, body, _ = await queued
        assert status == 200, body
