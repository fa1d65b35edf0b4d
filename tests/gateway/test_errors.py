"""Every error status of the gateway, in OpenAI's format, against a real gateway + simulator.

Each error body must be ``{"error": {"message": str, "type": str, "param": ..., "code": ...}}``
and, after each test, the queue store's counters must be back to zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import json as jsonlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.http.server import GatewayServer
from loadtest.sim.server import SimServer
from tests.gateway.conftest import (
    HI,
    MODEL,
    BusyFactory,
    GatewayFactory,
    SimFactory,
    assert_error,
    auth,
    call,
    dead_redis_url,
    gateway_settings,
    long_chat,
    store_is_idle,
    until,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# --------------------------------------------------------------------------- 400


async def test_400_invalid_bodies(sim: SimFactory, gateway: GatewayFactory,
                                  http: aiohttp.ClientSession) -> None:
    gw = await gateway([await sim(profile="instant")])
    post = gw.url + CHAT
    cases: list[tuple[str, Any, str | None]] = [
        (CHAT, b"{not json", None),
        (CHAT, b"\xff\xfe\x00garbage", None),
        (CHAT, b"", None),
        (CHAT, b"[1, 2]", None),
        (CHAT, b"[" * 100_000, None),  # deeper than the decoder's recursion limit
        (CHAT, {"messages": HI}, "model"),
        (CHAT, {"model": "", "messages": HI}, "model"),
        (CHAT, {"model": 7, "messages": HI}, "model"),
        (CHAT, {"model": MODEL}, "messages"),
        (CHAT, {"model": MODEL, "messages": []}, "messages"),
        (CHAT, {"model": MODEL, "messages": "hi"}, "messages"),
        (CHAT, {"model": MODEL, "messages": [{"content": "no role"}]}, "messages"),
        (COMPLETIONS, {"model": MODEL}, "prompt"),
        (COMPLETIONS, {"model": MODEL, "prompt": 5}, "prompt"),
        (CHAT, {"model": MODEL, "messages": HI, "stream": "yes"}, "stream"),
        (COMPLETIONS, {"model": MODEL, "prompt": "p", "stream": 1}, "stream"),
        (CHAT, {"model": MODEL, "messages": HI, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"model": MODEL, "messages": HI, "max_tokens": -3}, "max_tokens"),
        (CHAT, {"model": MODEL, "messages": HI, "max_tokens": "10"}, "max_tokens"),
        (CHAT, {"model": MODEL, "messages": HI, "max_tokens": 2.5}, "max_tokens"),
        (CHAT, {"model": MODEL, "messages": HI, "max_tokens": True}, "max_tokens"),
        (COMPLETIONS, {"model": MODEL, "prompt": "p", "max_tokens": 0}, "max_tokens"),
        (CHAT, {"model": MODEL, "messages": HI, "max_completion_tokens": 0},
         "max_completion_tokens"),
        (CHAT, {"model": MODEL, "messages": HI, "stream": True, "stream_options": "x"},
         "stream_options"),
    ]
    for path, body, param in cases:
        kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        status, got, _ = await call(http, "POST", gw.url + path, **kwargs)
        assert status == 400, (path, body, got)
        msg = assert_error(got, type_="invalid_request_error", param=param)
        if param is None:
            assert "JSON" in msg, msg
    # the key is checked before the body: garbage without a key is a 401, not a 400
    status, got, _ = await call(http, "POST", post, key=None, data=b"{not json")
    assert status == 401
    await store_is_idle(gw)


async def test_400_through_the_sdk(sim: SimFactory, gateway: GatewayFactory) -> None:
    gw = await gateway([await sim(profile="instant")])
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as exc:
            await client.chat.completions.create(model=MODEL, messages=[], max_tokens=3)
        assert exc.value.status_code == 400
        assert exc.value.param == "messages" and exc.value.type == "invalid_request_error"
        with pytest.raises(openai.BadRequestError) as exc:
            await client.completions.create(model=MODEL, prompt="p", max_tokens=0)
        assert exc.value.param == "max_tokens"
    finally:
        await client.close()
    await store_is_idle(gw)


async def test_valid_body_arriving_in_pieces_is_read_whole(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    """A chunked body split over several TCP writes must be read to its end."""
    gw = await gateway([await sim(profile="instant")])
    raw = (b'{"model": "' + MODEL.encode() + b'", "max_tokens": 2, "ignore_eos": true, '
           b'"messages": [{"role": "user", "content": "' + b"x" * 3000 + b'"}]}')

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(raw), 1000):
            yield raw[i:i + 1000]
            # only makes the split likely; correct code must not depend on it
            await asyncio.sleep(0.02)

    status, got, _ = await call(http, "POST", gw.url + CHAT, data=pieces(),
                                headers={"Content-Type": "application/json"})
    assert status == 200, got
    assert got["usage"]["completion_tokens"] == 2
    await store_is_idle(gw)


# --------------------------------------------------------------------------- 401


async def test_401_missing_or_unknown_key(sim: SimFactory, gateway: GatewayFactory,
                                          http: aiohttp.ClientSession) -> None:
    gw = await gateway([await sim(profile="instant")])
    body = {"model": MODEL, "messages": HI, "max_tokens": 2}
    for headers in ({}, {"Authorization": ""}, {"Authorization": "Bearer "},
                    {"Authorization": "Basic sk-alice"}, {"Authorization": "sk-alice"}):
        status, got, _ = await call(http, "POST", gw.url + CHAT, key=None, json=body,
                                    headers=headers)
        assert status == 401, (headers, got)
        assert "didn't provide an API key" in assert_error(
            got, type_="invalid_request_error", code="invalid_api_key")
    for path, method in ((CHAT, "POST"), (COMPLETIONS, "POST"), ("/v1/models", "GET")):
        status, got, _ = await call(http, method, gw.url + path, key="sk-nobody",
                                    json=body if method == "POST" else None)
        assert status == 401, (path, got)
        assert "Incorrect API key" in assert_error(
            got, type_="invalid_request_error", code="invalid_api_key")

    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-wrong", max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError) as exc:
            await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    finally:
        await client.close()
    await store_is_idle(gw)


# --------------------------------------------------------------------------- 403


async def test_403_raising_the_class_lowering_works(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    gw = await gateway([await sim(profile="instant")])
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, "ignore_eos": True}
    for key, asked in (("sk-dflt", "interactive"), ("sk-batch", "default"),
                       ("sk-batch", "interactive"), ("sk-dflt", "urgent")):
        status, got, _ = await call(http, "POST", gw.url + CHAT, key=key, json=body,
                                    headers={"X-Priority-Class": asked})
        assert status == 403, (key, asked, got)
        msg = assert_error(got, type_="permission_error", code="class_not_allowed")
        assert asked in msg

    registry = gw.services.metrics.registry
    for key, asked in (("sk-dflt", "batch"), ("sk-dflt", "default"), ("sk-alice", "batch")):
        status, got, _ = await call(http, "POST", gw.url + CHAT, key=key, json=body,
                                    headers={"X-Priority-Class": asked})
        assert status == 200, (key, asked, got)
        assert got["usage"]["completion_tokens"] == 2
    # the lowered requests really ran in the class they asked for
    assert registry.get_sample_value(
        "fairgate_requests_total",
        {"model": MODEL, "priority_class": "batch", "status": "200"}) == 2

    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-dflt", max_retries=0,
                                default_headers={"X-Priority-Class": "interactive"})
    try:
        with pytest.raises(openai.PermissionDeniedError) as exc:
            await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        assert exc.value.code == "class_not_allowed"
    finally:
        await client.close()
    await store_is_idle(gw)


# --------------------------------------------------------------------------- 404 / 405


async def test_404_unknown_model_and_route(sim: SimFactory, gateway: GatewayFactory,
                                           http: aiohttp.ClientSession) -> None:
    gw = await gateway([await sim(profile="instant")])
    for path, body in ((CHAT, {"model": "gpt-17", "messages": HI}),
                       (COMPLETIONS, {"model": "gpt-17", "prompt": "p"})):
        status, got, _ = await call(http, "POST", gw.url + path, json=body)
        assert status == 404, got
        assert "gpt-17" in assert_error(got, type_="invalid_request_error", param="model",
                                        code="model_not_found")

    for method, path in (("POST", "/v1/images/generations"), ("GET", "/v2/models"),
                         ("GET", "/nothing/here")):
        status, got, _ = await call(http, method, gw.url + path, json={})
        assert status == 404, (path, got)
        # a missing route is not a missing model
        assert path in assert_error(got, type_="invalid_request_error", code=None)

    # a known route with the wrong method: 405, still in OpenAI's format
    status, got, headers = await call(http, "GET", gw.url + CHAT)
    assert status == 405, got
    assert headers["Allow"] == "POST"
    assert_error(got, type_="invalid_request_error")

    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError) as exc:
            await client.chat.completions.create(model="gpt-17", messages=HI, max_tokens=2)
        assert exc.value.code == "model_not_found" and exc.value.param == "model"
        with pytest.raises(openai.NotFoundError):
            await client.images.generate(model=MODEL, prompt="x")
    finally:
        await client.close()
    await store_is_idle(gw)


# --------------------------------------------------------------------------- 413


async def test_413_body_too_large(sim: SimFactory, gateway: GatewayFactory,
                                  http: aiohttp.ClientSession) -> None:
    gw = await gateway([await sim(profile="instant")], max_body_bytes=1000)
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    status, got, _ = await call(http, "POST", gw.url + CHAT, json=big)
    assert status == 413, got
    assert "1000" in assert_error(got, type_="invalid_request_error", code="request_too_large")

    # without a Content-Length (chunked), in pieces: the size is counted while reading
    raw = (b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", '
           b'"content": "' + b"y" * 5000 + b'"}]}')

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(raw), 400):
            yield raw[i:i + 400]
            await asyncio.sleep(0.01)  # only makes the split likely

    status, got, _ = await call(http, "POST", gw.url + CHAT, data=pieces(),
                                headers={"Content-Type": "application/json"})
    assert status == 413, got
    assert_error(got, type_="invalid_request_error", code="request_too_large")

    # just under the limit still works
    small = {"model": MODEL, "messages": HI, "max_tokens": 2, "ignore_eos": True}
    status, got, _ = await call(http, "POST", gw.url + CHAT, json=small)
    assert status == 200, got
    await store_is_idle(gw)


# --------------------------------------------------------------------------- 429


async def test_429_per_user_queue_cap(sim: SimFactory, gateway: GatewayFactory,
                                      http: aiohttp.ClientSession, busy: BusyFactory) -> None:
    backend = await sim(profile="h100-llama3.1-8b", max_num_seqs=1)
    gw = await gateway([backend], max_queued_per_user=1, retry_after_s=2,
                       classes={"interactive": {"max_waiting": 1}})
    store = gw.services.store
    load = busy(gw, backend)
    await load.fill("sk-alice")
    assert await store.reads.user_inflight(MODEL) == {"alice": 2}

    queued = load.send("sk-alice")
    await until(lambda: _depth(gw, "interactive", 1), "alice's third request queued")

    status, got, headers = await call(http, "POST", gw.url + CHAT, json=long_chat())
    assert status == 429, got
    assert headers["Retry-After"] == "2"
    assert "alice" in assert_error(got, type_="rate_limit_error", code="queue_full")

    # the cap is per user: bob may still queue
    bobs = load.send("sk-bob")
    await until(lambda: _depth(gw, "interactive", 2), "bob's request queued")
    assert not queued.done() and not bobs.done()

    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0)
    try:
        with pytest.raises(openai.RateLimitError) as exc:
            await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2000,
                                                 extra_body={"ignore_eos": True})
        assert exc.value.status_code == 429 and exc.value.code == "queue_full"
        assert exc.value.response.headers["Retry-After"] == "2"
    finally:
        await client.close()

    await load.close()  # the clients go away: queued requests leave, running ones abort
    await store_is_idle(gw)
    await until(lambda: backend.engine.num_running + backend.engine.num_waiting == 0,
                "the backend aborted the dropped requests")


async def _depth(gw: GatewayServer, klass: str, n: int) -> bool:
    return (await gw.services.store.reads.depths(MODEL))[klass] == n


# --------------------------------------------------------------------------- 504


async def test_504_queue_wait_timeout(sim: SimFactory, gateway: GatewayFactory,
                                      http: aiohttp.ClientSession, busy: BusyFactory) -> None:
    backend = await sim(profile="h100-llama3.1-8b", max_num_seqs=1)
    gw = await gateway([backend], retry_after_s=3,
                       classes={"interactive": {"max_queue_wait_s": 0.3, "max_waiting": 1}})
    load = busy(gw, backend)
    await load.fill("sk-alice")

    started = time.monotonic()
    status, got, headers = await call(http, "POST", gw.url + CHAT, key="sk-bob",
                                      json=long_chat())
    waited = time.monotonic() - started
    assert status == 504, got
    assert headers["Retry-After"] == "3"
    assert "0.3s" in assert_error(got, type_="server_error", code="queue_timeout")
    assert 0.3 <= waited < 5.0
    # the timed-out request left the queue; alice's two are still in flight
    assert await gw.services.store.reads.depths(MODEL) == {
        "interactive": 0, "default": 0, "batch": 0}
    assert await gw.services.store.reads.user_inflight(MODEL) == {"alice": 2}

    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-carol", max_retries=0)
    try:
        with pytest.raises(openai.InternalServerError) as exc:
            await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5)
        assert exc.value.status_code == 504 and exc.value.code == "queue_timeout"
    finally:
        await client.close()

    await load.close()
    await store_is_idle(gw)


# --------------------------------------------------------------------------- 503 / ready


async def test_503_no_healthy_backend_and_ready(sim: SimFactory, gateway: GatewayFactory,
                                                http: aiohttp.ClientSession) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], unhealthy_after_failures=1, scrape_interval_s=0.02,
                       scrape_timeout_s=0.5, retry_after_s=4)
    async with http.get(gw.url + "/ready") as resp:
        assert resp.status == 200
        assert await resp.json() == {"status": "ready"}
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, "ignore_eos": True}
    status, got, _ = await call(http, "POST", gw.url + CHAT, json=body)
    assert status == 200, got

    await backend.stop()
    await until(lambda: not gw.services.pool.any_healthy(), "the backend marked unhealthy")

    for path, payload in ((CHAT, body), (COMPLETIONS, {"model": MODEL, "prompt": "p"})):
        status, got, headers = await call(http, "POST", gw.url + path, json=payload)
        assert status == 503, got
        assert headers["Retry-After"] == "4"
        assert MODEL in assert_error(got, type_="server_error", code="no_healthy_backend")

    status, got, headers = await call(http, "GET", gw.url + "/ready", key=None)
    assert status == 503, got
    assert headers["Retry-After"] == "4"
    assert_error(got, type_="server_error", code="no_healthy_backend")
    # liveness is not readiness
    async with http.get(gw.url + "/health") as resp:
        assert resp.status == 200

    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0)
    try:
        with pytest.raises(openai.InternalServerError) as exc:
            await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        assert exc.value.status_code == 503 and exc.value.code == "no_healthy_backend"
    finally:
        await client.close()
    await store_is_idle(gw)


async def _ready_with_dead_store(http: aiohttp.ClientSession
                                 ) -> tuple[int, dict[str, Any], Mapping[str, str]]:
    gw = GatewayServer(gateway_settings(dead_redis_url(), [], retry_after_s=5))
    await gw.start()
    try:
        return await call(http, "GET", gw.url + "/ready", key=None)
    finally:
        await gw.stop()


async def test_ready_503_when_the_store_is_down(http: aiohttp.ClientSession) -> None:
    status, got, headers = await _ready_with_dead_store(http)
    assert status == 503, got
    assert headers["Retry-After"] == "5"
    # a Redis outage has its own code: it is not a backend problem
    assert "queue store unavailable" in assert_error(got, type_="server_error",
                                                     code="queue_store_unavailable")


# --------------------------------------------------------------------------- 502


class BrokenBackend:
    """Serves a real simulator's /metrics (so it is healthy) but breaks completions."""

    def __init__(self, metrics_from: SimServer, mode: str) -> None:
        self.source, self.mode = metrics_from, mode
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post(CHAT, self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.source.metrics.render(self.source.engine),
                            content_type="text/plain")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        received = await request.read()
        assert request.transport is not None
        if self.mode == "echo":  # answer with the body exactly as the gateway sent it
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            return web.json_response({"echo": json.loads(received), "usage": usage})
        if self.mode == "drop":  # hang up before any response
            request.transport.abort()
            raise asyncio.CancelledError
        if self.mode == "midstream":  # one SSE frame, then hang up
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"id": "x", "object": "chat.completion.chunk", '
                             b'"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n')
            await resp.drain()
            request.transport.abort()
            raise asyncio.CancelledError
        # "truncate": promise 1000 bytes, send 10, hang up
        resp = web.StreamResponse(headers={"Content-Type": "application/json",
                                           "Content-Length": "1000"})
        await resp.prepare(request)
        await resp.write(b'{"id": "x"')
        request.transport.abort()
        raise asyncio.CancelledError


@pytest.mark.parametrize("mode", ["drop", "truncate"])
async def test_502_backend_breaks(mode: str, sim: SimFactory, gateway: GatewayFactory,
                                  http: aiohttp.ClientSession) -> None:
    source = await sim(profile="instant")
    broken = BrokenBackend(source, mode)
    await broken.start()
    try:
        gw = await gateway([broken])  # only .url is used
        body = {"model": MODEL, "messages": HI, "max_tokens": 2}
        status, got, _ = await call(http, "POST", gw.url + CHAT, json=body)
        assert status == 502, got
        assert "b0" in assert_error(got, type_="server_error", code="upstream_error")
        await store_is_idle(gw)
    finally:
        with contextlib.suppress(Exception):
            await broken.stop()


async def test_502_mid_stream_failure_ends_the_stream(sim: SimFactory,
                                                      gateway: GatewayFactory) -> None:
    """Once the 200 is out, a backend failure ends the SSE stream with an error event."""
    source = await sim(profile="instant")
    broken = BrokenBackend(source, "midstream")
    await broken.start()
    try:
        gw = await gateway([broken])  # only .url is used
        body = {"model": MODEL, "messages": HI, "max_tokens": 3, "stream": True}
        received = b""
        async with aiohttp.ClientSession() as session:
            async with session.post(gw.url + CHAT, json=body, headers=auth("sk-alice")) as resp:
                assert resp.status == 200  # the stream had started before the failure
                # the client must learn the stream is over, never hang on it, and never
                # see a second HTTP response inside the body
                async with asyncio.timeout(10):
                    async for chunk in resp.content.iter_any():
                        received += chunk
        assert b"HTTP/1.1" not in received
        frames = [f for f in received.split(b"\n\n") if f]
        assert frames[0].startswith(b"data: {") and b'"content": "a"' in frames[0]
        assert frames[-1].startswith(b"data: "), frames
        error = jsonlib.loads(frames[-1][len(b"data: "):])
        assert_error(error, type_="server_error", code="upstream_error")
        await store_is_idle(gw)
    finally:
        await broken.stop()
