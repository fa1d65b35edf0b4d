"""Queue status while waiting (``X-Fairgate-Queue-Status: 1``): the 200 comes at once,
SSE comment lines tell the place while queued, the answer follows in the same stream, a
refusal after the 200 is an error event; the ``openai`` SDK reads such a stream as any
other."""

from __future__ import annotations

import asyncio

import aiohttp
import openai

from gateway.http.queue_status import QUEUE_STATUS_HEADER
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory
from tests.ops.conftest import ADMIN, admin_call, until

STATUS_ON = {QUEUE_STATUS_HEADER: "1"}
BODY = {"model": MODEL, "prompt": "where do I stand", "max_tokens": 6, "ignore_eos": True,
        "temperature": 0, "stream": True}


async def queued_depth(http: aiohttp.ClientSession, url: str) -> int:
    _, state = await admin_call(http, "GET", url + "/admin/queues")
    return int(sum(c["depth"] for c in state["data"][MODEL].values()))


async def test_the_200_comes_at_once_and_the_place_while_queued(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    gw = await gateway([await sim()], admin_keys=[ADMIN], queue_status_interval_s=0.05)
    async with aiohttp.ClientSession() as http:
        # the backend is drained: the request stays queued until it is undrained
        assert (await admin_call(http, "POST", gw.url + "/admin/backends/b0/drain"))[0] == 200
        async with http.post(gw.url + "/v1/completions", json=BODY,
                             headers={"Authorization": "Bearer sk-alice", **STATUS_ON}) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            assert len(resp.headers["X-Request-Id"]) == 32
            lines = []
            while len([x for x in lines if x.startswith(b": queue position=")]) < 2:
                lines.append((await resp.content.readuntil(b"\n\n")).strip())
            assert await queued_depth(http, gw.url) == 1  # still queued: nothing dispatched
            place = next(x for x in lines if x.startswith(b": queue position="))
            assert place.startswith(b": queue position=0 eta_ms="), lines
            await admin_call(http, "POST", gw.url + "/admin/backends/b0/undrain")
            rest = (await resp.read()).split(b"\n\n")
    frames = [f for f in rest if f.startswith(b"data: ")]
    assert frames and frames[-1] == b"data: [DONE]", rest
    text = b"".join(f for f in frames if b'"text"' in f)
    assert text, frames
    # no status line once the answer began
    first_data = next(i for i, f in enumerate(rest) if f.startswith(b"data: "))
    assert not any(f.startswith(b":") for f in rest[first_data:]), rest


async def test_the_openai_sdk_reads_the_stream_as_any_other(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    gw = await gateway([await sim()], admin_keys=[ADMIN], queue_status_interval_s=0.05)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0)
    args = {k: v for k, v in BODY.items() if k not in ("model", "prompt", "stream",
                                                        "ignore_eos")}
    try:
        plain = await client.completions.create(model=MODEL, prompt=BODY["prompt"],
                                                extra_body={"ignore_eos": True}, **args)
        async with aiohttp.ClientSession() as http:
            await admin_call(http, "POST", gw.url + "/admin/backends/b0/drain")
            stream = await client.completions.create(
                model=MODEL, prompt=BODY["prompt"], stream=True, extra_headers=STATUS_ON,
                extra_body={"ignore_eos": True}, **args)

            async def read() -> str:
                return "".join([c.choices[0].text async for c in stream if c.choices])
            reading = asyncio.create_task(read())
            await until(lambda: queued_depth_is(http, gw.url, 1), what="the request queued")
            await admin_call(http, "POST", gw.url + "/admin/backends/b0/undrain")
            streamed = await asyncio.wait_for(reading, 30)
        assert streamed == plain.choices[0].text, (streamed, plain.choices[0].text)
    finally:
        await client.close()


async def queued_depth_is(http: aiohttp.ClientSession, url: str, depth: int) -> bool:
    return await queued_depth(http, url) == depth


async def test_a_refusal_after_the_200_is_an_error_event(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    gw = await gateway([await sim()], admin_keys=[ADMIN], queue_status_interval_s=0.05,
                       classes={"interactive": {"max_queue_wait_s": 0.3}})
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0)
    try:
        async with aiohttp.ClientSession() as http:
            await admin_call(http, "POST", gw.url + "/admin/backends/b0/drain")
            stream = await client.completions.create(
                model=MODEL, prompt="never served", max_tokens=4, stream=True,
                extra_headers=STATUS_ON)
            try:
                async for _ in stream:
                    pass
            except openai.APIError as exc:
                error = exc
            else:
                raise AssertionError("the stream ended without the queue timeout's event")
        assert "queue" in error.message.lower(), error.message
        assert isinstance(error.body, dict) and error.body.get("code") == "queue_timeout", (
            error.body)
    finally:
        await client.close()


async def test_the_header_is_checked(sim: SimFactory, gateway: GatewayFactory) -> None:
    gw = await gateway([await sim(profile="instant")])
    async with aiohttp.ClientSession() as http:
        for body, value, needle in (({**BODY, "stream": False}, "1", "needs a streamed"),
                                    (BODY, "maybe", "must be 1 or 0")):
            async with http.post(gw.url + "/v1/completions", json=body, headers={
                    "Authorization": "Bearer sk-alice", QUEUE_STATUS_HEADER: value}) as resp:
                answer = await resp.json()
                assert resp.status == 400 and needle in answer["error"]["message"], answer
        async with http.post(gw.url + "/v1/completions", json=BODY, headers={
                "Authorization": "Bearer sk-alice", QUEUE_STATUS_HEADER: "0"}) as resp:
            body = await resp.read()
            assert resp.status == 200 and not body.startswith(b":"), body[:80]
