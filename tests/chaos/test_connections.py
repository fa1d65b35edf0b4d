"""Hostile connections: idle or half-sent headers are closed after client_idle_timeout_s,
and connections over max_client_connections get a clear 503 instead of exhausting the
process's files; the gateway keeps serving everyone else throughout."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.gateway.conftest import GatewayFactory, SimFactory, complete

IDLE = 40


async def open_idle(port: int, partial: bytes) -> tuple[asyncio.StreamReader,
                                                        asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(partial)
    await writer.drain()
    return reader, writer


async def test_idle_and_half_sent_connections_are_closed(sim: SimFactory,
                                                         gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], client_idle_timeout_s=0.5)
    conns = [await open_idle(gw.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             if i % 2 else b"") for i in range(IDLE)]
    async with aiohttp.ClientSession() as session:  # others are served meanwhile
        assert (await complete(session, gw.url, "sk-alice", 3))["usage"]["completion_tokens"] == 3
    for reader, writer in conns:  # the server hangs up on every one (EOF), unprompted
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()


async def test_connections_over_the_cap_get_a_503(sim: SimFactory,
                                                  gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], max_client_connections=5)
    held = [await open_idle(gw.port, b"") for _ in range(5)]
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    raw = await asyncio.wait_for(reader.read(), 10)  # answered and closed, nothing sent
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("server_error", "too_many_connections")
    assert "too many open connections" in error["message"]
    for _, w in held:
        w.close()
        await w.wait_closed()
    async with aiohttp.ClientSession() as session:  # room again once they are gone
        for _ in range(200):
            try:
                await complete(session, gw.url, "sk-alice", 2)
                break
            except (AssertionError, aiohttp.ClientError):
                await asyncio.sleep(0.01)
        else:
            raise AssertionError("never served again after the held connections closed")


async def test_a_body_that_stops_arriving_gets_a_408(sim: SimFactory,
                                                    gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], client_idle_timeout_s=0.5)
    reader, writer = await open_idle(
        gw.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Authorization: Bearer sk-alice\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"model\": ")  # ...and nothing more
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 408")
    writer.close()


async def test_a_stream_longer_than_max_request_s_ends_with_an_error_event(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim(max_num_seqs=4)  # ~5 ms a token: 2,000 tokens take ~10 s
    gw = await gateway([backend], max_request_s=0.5)
    body = {"model": "llama-3.1-8b", "prompt": "x", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    events = []
    async with aiohttp.ClientSession() as session, session.post(
            gw.url + "/v1/completions", json=body,
            headers={"Authorization": "Bearer sk-alice"}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line)
    last = json.loads(events[-1][6:])
    assert last["error"]["code"] == "upstream_error", last  # not a silent truncation
    assert 1 < len(events) < 2000
    await backend.engine.wait_until(lambda: backend.engine.num_running == 0)
    assert all(r.aborted for r in backend.engine.records.values())  # vLLM stops too
