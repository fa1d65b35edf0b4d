"""A client that goes away aborts its request and frees its KV blocks."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.sim.conftest import MODEL, ServerFactory

LONG = {"model": MODEL, "prompt": "hi", "max_tokens": 100_000, "ignore_eos": True}


async def test_disconnect_mid_stream_aborts(make_server: ServerFactory) -> None:
    server = await make_server(profile="h100-llama3.1-8b")
    engine = server.engine
    async with aiohttp.ClientSession() as http:
        resp = await http.post(server.url + "/v1/completions", json={**LONG, "stream": True})
        line = await resp.content.readline()
        assert line.startswith(b"data: ")
        assert engine.num_running == 1 and engine.kv_usage > 0
        resp.close()
    await asyncio.wait_for(engine.wait_until(lambda: engine.num_running == 0), 10)
    (record,) = engine.records.values()
    assert record.aborted and record.finish_reason == "abort"
    assert 0 < record.output_tokens < 100_000
    assert engine.kv_usage == 0.0


async def test_disconnect_while_waiting_aborts(make_server: ServerFactory) -> None:
    server = await make_server(profile="h100-llama3.1-8b", max_num_seqs=1)
    engine = server.engine
    async with aiohttp.ClientSession() as http:
        running = await http.post(server.url + "/v1/completions", json={**LONG, "stream": True})
        await running.content.readline()
        waiting = asyncio.create_task(http.post(server.url + "/v1/completions", json=LONG))
        await asyncio.wait_for(engine.wait_until(lambda: len(engine.records) == 2), 10)
        assert engine.num_waiting == 1
        waiting.cancel()
        await asyncio.wait_for(engine.wait_until(lambda: engine.num_waiting == 0), 10)
        aborted = [r for r in engine.records.values() if r.aborted]
        assert len(aborted) == 1 and aborted[0].first_scheduled_s is None
        assert engine.num_running == 1
        running.close()
    await asyncio.wait_for(engine.wait_until(lambda: engine.num_running == 0), 10)
    assert engine.kv_usage == 0.0
    assert all(r.aborted for r in engine.records.values())


async def test_stop_aborts_open_streams(make_server: ServerFactory) -> None:
    server = await make_server(profile="h100-llama3.1-8b")
    async with aiohttp.ClientSession() as http:
        resp = await http.post(server.url + "/v1/completions", json={**LONG, "stream": True})
        await resp.content.readline()
        await server.engine.stop()
        rest = await resp.content.read()
    assert b"[DONE]" not in rest
    (record,) = server.engine.records.values()
    assert record.aborted
    assert server.engine.kv_usage == 0.0
