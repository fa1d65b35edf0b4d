"""Right after the start a request can come before its model's backends were scraped
once: it waits for that first scrape (at most ``first_scrape_wait_s``) instead of a
503 ``no_healthy_backend`` while ``/v1/models`` already answers 200 (issue 29, item 9)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from gateway.http.server import GatewayServer
from loadtest.sim.server import SimServer
from tests.gateway.conftest import MODEL, SimFactory, assert_settled, auth, gateway_settings, until


class HeldScrapes:
    """A backend whose ``/metrics`` answers only once ``release`` is set (completions go
    to a simulator)."""

    def __init__(self, sim: SimServer) -> None:
        self.sim = sim
        self.asked = asyncio.Event()
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completion)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _metrics(self, _: web.Request) -> web.Response:
        self.asked.set()
        await self.release.wait()
        return web.Response(body=self.sim.metrics.render(self.sim.engine),
                            content_type="text/plain")

    async def _completion(self, request: web.Request) -> web.Response:
        body = await request.json()
        async with aiohttp.ClientSession() as http, http.post(
                self.sim.url + "/v1/completions", json=body) as resp:
            return web.Response(status=resp.status, body=await resp.read(),
                                content_type="application/json")


async def test_a_request_before_the_first_scrape_waits_for_it(
        sim: SimFactory, redis_url: str, redis: Any) -> None:
    backend = HeldScrapes(await sim(profile="instant"))
    await backend.start()
    gw = GatewayServer(gateway_settings(redis_url, [backend],  # type: ignore[list-item]
                                        scrape_timeout_s=60.0, first_scrape_wait_s=60.0))
    await gw.start()
    try:
        await backend.asked.wait()  # the first scrape is under way, not answered
        async with aiohttp.ClientSession() as http:
            async with http.get(gw.url + "/v1/models", headers=auth("sk-alice")) as resp:
                assert resp.status == 200, await resp.text()

            async def complete() -> tuple[int, Any]:
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
                async with http.post(gw.url + "/v1/completions", json=body,
                                     headers=auth("sk-alice")) as resp:
                    return resp.status, json.loads(await resp.read())

            early = asyncio.create_task(complete())
            waits = gw.services.metrics.backends.first_scrape_waits.labels(MODEL)

            async def held() -> bool:
                assert not early.done(), f"answered before the first scrape: {early.result()}"
                return waits._value.get() >= 1

            await until(held, "the early request to wait for the first scrape")
            backend.release.set()
            status, answer = await early
            assert status == 200, answer
            assert answer["usage"]["completion_tokens"] == 2, answer
        await assert_settled(gw)
    finally:
        await gw.stop()
        await backend.stop()


async def test_the_wait_for_the_first_scrape_is_bounded(
        sim: SimFactory, redis_url: str, redis: Any) -> None:
    """A first scrape that never answers: the request gets its 503 after
    ``first_scrape_wait_s``."""
    backend = HeldScrapes(await sim(profile="instant"))
    await backend.start()
    gw = GatewayServer(gateway_settings(redis_url, [backend],  # type: ignore[list-item]
                                        scrape_timeout_s=60.0, first_scrape_wait_s=0.2))
    await gw.start()
    try:
        await backend.asked.wait()
        async with aiohttp.ClientSession() as http, http.post(
                gw.url + "/v1/completions", headers=auth("sk-alice"),
                json={"model": MODEL, "prompt": "hi", "max_tokens": 2}) as resp:
            answer = await resp.json()
            assert resp.status == 503, answer
            assert answer["error"]["code"] == "no_healthy_backend", answer
        assert gw.services.metrics.backends.first_scrape_waits.labels(MODEL)._value.get() == 1
    finally:
        backend.release.set()
        await gw.stop()
        await backend.stop()
