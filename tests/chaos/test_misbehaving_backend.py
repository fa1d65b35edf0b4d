"""A backend whose /metrics hangs, returns garbage or answers 500: its gates close with the
reason ``stale``, it turns unhealthy after ``unhealthy_after_failures`` scrapes, queued
clients get a clear 504 at their class's queue limit and new ones a clear 503, nothing
leaks; when /metrics recovers, the backend serves again. (Completions that fail or close
mid-answer: tests/gateway/test_errors.py.)"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from loadtest.sim.server import SimServer
from tests.gateway.conftest import (
    GatewayFactory,
    SimFactory,
    assert_settled,
    call,
    complete,
    until,
)


class FlakyMetrics:
    """Proxies a simulator, but its /metrics misbehaves while ``mode`` is set."""

    def __init__(self, sim: SimServer) -> None:
        self.sim, self.mode = sim, ""
        self.released = asyncio.Event()  # ends the hanging scrapes at stop
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{path:.*}", self._proxy)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        self.released.set()
        if self.runner is not None:
            await self.runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.mode == "hang":
            await self.released.wait()
        if self.mode == "garbage":
            return web.Response(text="<html>not metrics</html>\n{{{", content_type="text/html")
        if self.mode == "500":
            return web.Response(status=500, text="internal error")
        return web.Response(body=self.sim.metrics.render(self.sim.engine),
                            content_type="text/plain")

    async def _proxy(self, request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as http, http.request(
                request.method, self.sim.url + request.path, data=await request.read(),
                headers={"Content-Type": "application/json"}) as resp:
            return web.Response(body=await resp.read(), status=resp.status,
                                content_type=resp.content_type)


@pytest.mark.parametrize("mode", ["hang", "garbage", "500"])
async def test_bad_metrics_close_the_gates_with_clear_errors(
        sim: SimFactory, gateway: GatewayFactory, mode: str) -> None:
    source = await sim(profile="instant")
    flaky = FlakyMetrics(source)
    await flaky.start()
    try:
        gw = await gateway([flaky], scrape_timeout_s=0.2,
                           classes={"interactive": {"max_queue_wait_s": 1}})
        handle = gw.services.pool.handles["b0"]
        async with aiohttp.ClientSession() as http:
            flaky.mode = mode
            await until(lambda: handle.gates["interactive"].reason == "stale",
                        "the gate closed as stale")
            queued = await call(http, "POST", gw.url + "/v1/completions", key="sk-alice",
                                json={"model": "llama-3.1-8b", "prompt": "x", "max_tokens": 2})
            assert queued[0] in (503, 504), queued  # queue limit, or already unhealthy
            await until(lambda: not handle.healthy, "the backend marked unhealthy")
            status, body, _ = await call(http, "POST", gw.url + "/v1/completions",
                                         key="sk-bob", json={"model": "llama-3.1-8b",
                                                             "prompt": "x", "max_tokens": 2})
            assert (status, body["error"]["code"]) == (503, "no_healthy_backend")
            flaky.mode = ""
            await until(lambda: handle.healthy and handle.gates["interactive"].open,
                        "the backend back")
            assert (await complete(http, gw.url, "sk-carol", 2))["usage"]["completion_tokens"] \
                == 2
        await assert_settled(gw)
    finally:
        await flaky.stop()
