"""``/tokenize`` and ``/detokenize`` are not queued, but not free either (issue 29, item
3): each call counts against its key's rpm, a user has at most
``max_unqueued_per_user`` of them at the backends at once, and their bodies have a size
limit of their own (``max_unqueued_body_bytes``)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from loadtest.sim.server import SimServer
from tests.gateway.conftest import (
    MODEL,
    GatewayFactory,
    SimFactory,
    assert_error,
    call,
    until,
)


class HeldTokenizer:
    """A backend whose /tokenize answers only when released; its /metrics come from a
    simulator so the gateway sees it healthy."""

    def __init__(self, metrics_from: SimServer) -> None:
        self.source = metrics_from
        self.release = asyncio.Event()
        self.arrived = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.source.metrics.render(self.source.engine),
                            content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.arrived += 1
        await self.release.wait()
        return web.json_response({"count": 1, "max_model_len": 4096, "tokens": [1]})


async def test_tokenize_counts_against_the_keys_rpm(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], api_keys=[
        {"key": "sk-rpm", "user": "rita", "limits": {"rpm": 3}}])
    statuses = []
    for path in ("/tokenize", "/detokenize", "/tokenize", "/tokenize"):
        body = {"model": MODEL, "prompt": "hi"} if path == "/tokenize" else {
            "model": MODEL, "tokens": [1, 2]}
        status, answer, headers = await call(http, "POST", gw.url + path, key="sk-rpm",
                                             json=body)
        statuses.append(status)
    assert statuses == [200, 200, 200, 429], statuses
    assert_error(answer, type_="rate_limit_error", code="rate_limit_exceeded")
    assert int(headers["Retry-After"]) >= 1, headers


async def test_a_users_tokenize_calls_in_flight_are_bounded(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    held = HeldTokenizer(await sim(profile="instant"))
    await held.start()
    try:
        gw = await gateway([held], max_unqueued_per_user=2)  # serves /metrics and /tokenize
        calls = [asyncio.create_task(call(http, "POST", gw.url + "/tokenize",
                                          json={"model": MODEL, "prompt": "hi"}))
                 for _ in range(6)]
        await until(lambda: held.arrived >= 2 and sum(t.done() for t in calls) >= 4,
                    "two calls at the backend and the other four answered")
        refused = [t.result() for t in calls if t.done()]
        assert [r[0] for r in refused] == [429] * 4, [r[:2] for r in refused]
        assert_error(refused[0][1], type_="rate_limit_error", code="rate_limit_exceeded")
        # another user is not held back by alice's calls
        other = asyncio.create_task(call(http, "POST", gw.url + "/tokenize", key="sk-bob",
                                         json={"model": MODEL, "prompt": "hi"}))
        await until(lambda: held.arrived == 3, "bob's call reached the backend")
        held.release.set()
        results = await asyncio.gather(*calls, other)
        assert sorted(r[0] for r in results) == [200, 200, 200, 429, 429, 429, 429], [
            r[0] for r in results]
        assert held.arrived == 3, held.arrived
    finally:
        held.release.set()
        await held.stop()


async def test_tokenize_bodies_have_their_own_size_limit(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], max_unqueued_body_bytes=100_000)
    status, answer, _ = await call(http, "POST", gw.url + "/tokenize",
                                   json={"model": MODEL, "prompt": "x" * 400_000})
    assert status == 413, (status, answer)
    status, answer, _ = await call(http, "POST", gw.url + "/tokenize",
                                   json={"model": MODEL, "prompt": "x" * 90_000})
    assert status == 200, (status, answer)
