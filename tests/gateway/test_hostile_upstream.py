"""Backend answers that are not OpenAI-shaped (issue 10, item 5).

vLLM's own errors — ``{"error": {...}}`` (vLLM ≥ 0.10) or the older top-level
``{"object": "error", ...}`` — reach the client byte for byte. Anything else (a proxy's
text/plain 413, an HTML 502 page, FastAPI's ``{"detail": ...}``) is wrapped in OpenAI's
format with the upstream status kept, as status code and in the message.
"""

from __future__ import annotations

import asyncio
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


# A stream=true request answered 200 with something that is not a whole event stream
# (issue 29, item 9): the client's stream must end with an OpenAI error event.
CHUNK_A = (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m",'
           b'"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n')
BROKEN_STREAMS: dict[str, tuple[int, str, bytes]] = {
    "json-200": (200, "application/json", json.dumps({
        "id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}}]}).encode()),
    "text-200": (200, "text/plain", b"data: not an event stream\n\n"),
    "sse-without-done": (200, "text/event-stream", CHUNK_A),
}


class Trickle:
    """A stream that sends ``opening`` and then one byte of a frame every 20 ms, never
    completing it (at most 500 bytes: 10 s); ``cut`` is set when fairgate hangs up."""

    def __init__(self, opening: bytes, content_type: str = "text/event-stream") -> None:
        self.opening = opening
        self.content_type = content_type
        self.cut = asyncio.Event()

    async def answer(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": self.content_type})
        await out.prepare(request)
        try:
            await out.write(self.opening)
            for byte in (b'data: {"x": "' + b"y" * 500)[:500]:
                await asyncio.sleep(0.02)
                await out.write(bytes([byte]))
        except ConnectionError:
            self.cut.set()
            raise
        await out.write_eof()
        return out


class OddStreams(OddBackend):
    """Answers the first streamed requests from ``first`` (one each), then streams what
    the simulator streams."""

    def __init__(self, metrics_from: SimServer) -> None:
        super().__init__(metrics_from)
        self.first: list[tuple[int, str, bytes] | Trickle] = []

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.first:
            first = self.first.pop(0)
            if isinstance(first, Trickle):
                return await first.answer(request)
            status, content_type, data = first
            return web.Response(status=status, body=data, content_type=content_type)
        async with aiohttp.ClientSession() as http, http.post(
                self.source.url + request.path, json=body) as resp:
            out = web.StreamResponse(headers={"Content-Type": resp.headers["Content-Type"]})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        await out.write_eof()
        return out


# a stream no continuation can reproduce (docs/reliability.md, "Not continued"): the
# penalties' emulating logit_bias would be scaled by the repetition penalty
NOT_CONTINUED = {"presence_penalty": 0.5, "repetition_penalty": 1.1}


async def streamed(gw: GatewayServer, body: dict[str, Any]) -> tuple[int, list[bytes]]:
    async with aiohttp.ClientSession() as http, http.post(
            gw.url + CHAT, json=body, headers=auth("sk-alice")) as resp:
        return resp.status, [f for f in (await resp.read()).split(b"\n\n") if f]


@pytest.mark.parametrize("name", list(BROKEN_STREAMS))
async def test_a_stream_that_is_not_a_whole_event_stream_ends_with_an_error_event(
        name: str, sim: SimFactory, gateway: GatewayFactory) -> None:
    """Not continuable (:data:`NOT_CONTINUED`): the stream ends with an error event, and
    no foreign byte reaches the client."""
    backend = OddStreams(await sim(profile="instant"))
    await backend.start()
    try:
        backend.first = [BROKEN_STREAMS[name]]
        gw = await gateway([backend])  # only .url is used
        status, frames = await streamed(gw, {"model": MODEL, "messages": HI, "max_tokens": 2,
                                             "stream": True, **NOT_CONTINUED})
        assert status == 200 and frames, (status, frames)
        assert all(f.startswith(b"data: {") for f in frames), frames
        message = assert_error(json.loads(frames[-1][len(b"data: "):]),
                               type_="server_error", code="upstream_error")
        expected = "not an event stream" if name != "sse-without-done" else "no [DONE]"
        assert expected in message, message
        await store_is_idle(gw)
    finally:
        await backend.stop()


async def test_the_sdk_sees_the_error_event_of_a_json_200_stream(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = OddStreams(await sim(profile="instant"))
    await backend.start()
    client = None
    try:
        backend.first = [BROKEN_STREAMS["json-200"]]
        gw = await gateway([backend])
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice",
                                    max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2, stream=True,
            presence_penalty=NOT_CONTINUED["presence_penalty"],
            extra_body={"repetition_penalty": NOT_CONTINUED["repetition_penalty"]})
        with pytest.raises(openai.APIError) as exc:
            async for _ in stream:
                pass
        assert "not an event stream" in exc.value.message, exc.value.message
    finally:
        if client is not None:
            await client.close()
        await backend.stop()


@pytest.mark.parametrize("name", ["json-200", "text-200"])
async def test_a_continuable_stream_that_is_not_an_event_stream_is_sent_again(
        name: str, sim: SimFactory, gateway: GatewayFactory) -> None:
    """A continuable stream treats such an answer as its backend's failure: nothing
    reached the client, so it is sent again and ends with ``[DONE]`` (a stream cut short
    continues from its token ids: ``tests/chaos/test_continuation.py``)."""
    backend = OddStreams(await sim(profile="instant"))
    await backend.start()
    try:
        backend.first = [BROKEN_STREAMS[name]]
        gw = await gateway([backend])
        status, frames = await streamed(gw, {"model": MODEL, "messages": HI, "max_tokens": 3,
                                             "stream": True, "ignore_eos": True})
        assert status == 200 and frames[-1] == b"data: [DONE]", frames
        assert not any(b'"error"' in f for f in frames), frames
        assert backend.first == [], "the broken answer was never asked for"
        await store_is_idle(gw)
    finally:
        await backend.stop()



ROLE = (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        b'"finish_reason":null}]}\n\n')


@pytest.mark.parametrize("opening", [CHUNK_A, b""], ids=["after-a-frame", "from-the-start"])
async def test_a_trickling_stream_is_cut_by_the_idle_deadline(
        opening: bytes, sim: SimFactory, gateway: GatewayFactory) -> None:
    """A frame (or none), then a byte every 20 ms that never completes the next: aiohttp's
    sock_read never fires (each byte resets it); stream_idle_timeout_s cuts it with an
    error event and the backend's connection is closed. From the start: the deadline
    runs from the first byte (before, only a whole frame started it, and the trickle ran
    until the backend ended it)."""
    backend = OddStreams(await sim(profile="instant"))
    await backend.start()
    try:
        trickle = Trickle(opening)
        backend.first = [trickle]
        gw = await gateway([backend], stream_idle_timeout_s=0.3)
        status, frames = await streamed(gw, {"model": MODEL, "messages": HI, "max_tokens": 2,
                                             "stream": True, **NOT_CONTINUED})
        assert status == 200 and frames[:-1] == [opening.strip()][:len(opening)], frames
        message = assert_error(json.loads(frames[-1][len(b"data: "):]),
                               type_="server_error", code="upstream_error")
        assert "stream_idle_timeout_s" in message, message
        await trickle.cut.wait()  # fairgate hung up on the backend
        await store_is_idle(gw)
    finally:
        await backend.stop()


async def test_a_continuable_trickling_stream_is_sent_elsewhere(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """The same before any output (a role frame only): a backend failure, the request is
    sent again and the client gets a whole answer."""
    backend = OddStreams(await sim(profile="instant"))
    await backend.start()
    try:
        trickle = Trickle(ROLE)
        backend.first = [trickle]
        gw = await gateway([backend], stream_idle_timeout_s=0.3)
        status, frames = await streamed(gw, {"model": MODEL, "messages": HI, "max_tokens": 3,
                                             "stream": True, "ignore_eos": True})
        assert status == 200 and frames[-1] == b"data: [DONE]", frames
        assert not any(b'"error"' in f for f in frames), frames
        await trickle.cut.wait()
        await store_is_idle(gw)
    finally:
        await backend.stop()


async def test_a_trickling_whole_answer_is_cut_by_the_idle_deadline(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """A non-streamed answer whose body trickles a byte every 20 ms after its status line
    (vLLM sends it at once): failed after stream_idle_timeout_s, the backend's connection
    closed, the request sent again and answered whole (before: the trickle ran until the
    backend ended it, and its broken body was a 502)."""
    backend = OddStreams(await sim(profile="instant"))
    await backend.start()
    try:
        trickle = Trickle(b'{"id": "x", "choices": [', "application/json")
        backend.first = [trickle]
        gw = await gateway([backend], stream_idle_timeout_s=0.3)
        async with aiohttp.ClientSession() as http, http.post(
                gw.url + CHAT, json={"model": MODEL, "messages": HI, "max_tokens": 2,
                                     "ignore_eos": True}, headers=auth("sk-alice")) as resp:
            status, answer = resp.status, await resp.json()
        assert status == 200 and answer["usage"]["completion_tokens"] == 2, (status, answer)
        await asyncio.wait_for(trickle.cut.wait(), 30)  # fairgate hung up on the trickle
        await store_is_idle(gw)
    finally:
        await backend.stop()


async def test_a_bug_after_the_first_token_ends_the_stream_with_an_error_event(
        sim: SimFactory, gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected exception once the status line went (as redis-py's cluster pipeline
    raised one on a connection torn down in a failover): the client gets an error event
    and the end of the stream at once, not an open connection until its timeout."""
    gw = await gateway([await sim(profile="instant")])

    async def broken(*_: Any) -> None:
        raise AttributeError("'NoneType' object has no attribute 'writelines'")

    monkeypatch.setattr(gw.services.dispatcher, "started", broken)
    async with asyncio.timeout(30):  # the test's bound, not the gateway's behaviour
        status, frames = await streamed(gw, {"model": MODEL, "messages": HI,
                                             "max_tokens": 4, "stream": True})
    assert status == 200 and frames, (status, frames)
    message = assert_error(json.loads(frames[-1][len(b"data: "):]), type_="internal_error")
    assert "internal error" in message, frames
