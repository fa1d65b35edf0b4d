"""Backend answers that are not OpenAI-shaped (issue 10, item 5).

vLLM's own errors — ``{"error": {...}}`` (vLLM ≥ 0.10) or the older top-level
``{"object": "error", ...}`` — reach the client byte for byte. Anything else (a proxy's
text/plain 413, an HTML 502 page, FastAPI's ``{"detail": ...}``) is wrapped in OpenAI's
format with the upstream status kept, as status code and in the message.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.http.server import GatewayServer
from loadtest.sim.server import SimServer
from tests.gateway.conftest import (
    CHAT,
    HI,
    MODEL,
    GatewayFactory,
    SimFactory,
    assert_error,
    auth,
    store_is_idle,
)

VLLM_NEW = json.dumps({"error": {"message": "max_tokens is too large", "type": "BadRequestError",
                                 "param": "max_tokens", "code": 400}}).encode()
VLLM_OLD = json.dumps({"object": "error", "message": "This model's maximum context length "
                       "is 2048 tokens", "type": "BadRequestError", "param": None,
                       "code": 400}).encode()

# name → (status, content type, body) the backend answers every completion with
ANSWERS: dict[str, tuple[int, str, bytes]] = {
    "proxy-413-text": (413, "text/plain", b"413 Request Entity Too Large"),
    "proxy-502-html": (502, "text/html", b"<html><body><h1>502 Bad Gateway</h1></body></html>"),
    "fastapi-404": (404, "application/json", b'{"detail":"Not Found"}'),
    "json-array-500": (500, "application/json", b"[1, 2]"),
    "empty-503": (503, "text/plain", b""),
    "not-json-200": (200, "text/html", b"<html>maintenance</html>"),
    "vllm-new-400": (400, "application/json", VLLM_NEW),
    "vllm-old-400": (400, "application/json", VLLM_OLD),
}


class OddBackend:
    """A server in front of a simulator: its /metrics pass through (so the gateway sees a
    healthy backend), completions get one fixed answer."""

    def __init__(self, metrics_from: SimServer) -> None:
        self.source = metrics_from
        self.answer = ANSWERS["proxy-413-text"]
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/v1/completions", self._answer)
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

    async def _answer(self, request: web.Request) -> web.Response:
        await request.read()
        status, content_type, body = self.answer
        return web.Response(status=status, body=body, content_type=content_type)


@pytest.fixture
async def odd(sim: SimFactory) -> AsyncIterator[OddBackend]:
    backend = OddBackend(await sim(profile="instant"))
    await backend.start()
    yield backend
    await backend.stop()


@pytest.fixture
async def gw(odd: OddBackend, gateway: GatewayFactory) -> GatewayServer:
    return await gateway([odd])  # only .url is used


async def post(gw: GatewayServer, body: dict[str, Any]) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as http, http.post(
            gw.url + CHAT, json=body, headers=auth("sk-alice")) as resp:
        return resp.status, resp.content_type, await resp.read()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["proxy-413-text", "proxy-502-html", "fastapi-404",
                                  "json-array-500", "empty-503"])
async def test_foreign_error_is_wrapped_in_openai_format(name: str, stream: bool,
                                                         odd: OddBackend,
                                                         gw: GatewayServer) -> None:
    odd.answer = ANSWERS[name]
    upstream_status, _, upstream_body = odd.answer
    status, content_type, raw = await post(gw, {"model": MODEL, "messages": HI,
                                                "max_tokens": 2, "stream": stream})
    assert status == upstream_status, raw
    assert content_type == "application/json"
    message = assert_error(json.loads(raw), type_="upstream_error", code="upstream_error")
    assert str(upstream_status) in message and "b0" in message
    if upstream_body and not upstream_body.startswith(b"<"):
        assert upstream_body.decode() in message  # what the upstream said, quoted
    await store_is_idle(gw)


async def test_non_json_success_is_a_502(odd: OddBackend, gw: GatewayServer) -> None:
    odd.answer = ANSWERS["not-json-200"]
    status, _, raw = await post(gw, {"model": MODEL, "messages": HI, "max_tokens": 2})
    assert status == 502, raw
    message = assert_error(json.loads(raw), type_="upstream_error", code="upstream_error")
    assert "200" in message
    await store_is_idle(gw)


@pytest.mark.parametrize("name", ["vllm-new-400", "vllm-old-400"])
async def test_vllm_errors_pass_untouched(name: str, odd: OddBackend, gw: GatewayServer) -> None:
    odd.answer = ANSWERS[name]
    for stream in (False, True):
        status, content_type, raw = await post(gw, {"model": MODEL, "messages": HI,
                                                    "max_tokens": 2, "stream": stream})
        assert (status, content_type, raw) == (400, "application/json", odd.answer[2])
    await store_is_idle(gw)


async def test_sdk_sees_the_wrapped_error(odd: OddBackend, gw: GatewayServer) -> None:
    odd.answer = ANSWERS["proxy-413-text"]
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0)
    try:
        with pytest.raises(openai.APIStatusError) as exc:
            await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    finally:
        await client.close()
    assert exc.value.status_code == 413
    assert exc.value.code == "upstream_error" and exc.value.type == "upstream_error"
    assert "413" in exc.value.message and "Request Entity Too Large" in exc.value.message
    await store_is_idle(gw)
