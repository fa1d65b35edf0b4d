"""Scale from zero (issue 25, item 3): a pool with no ready backend holds a request, up to
``cold_start_wait_s``, until a backend appears (here a simulator started mid-test and made
known by a config reload), and reports that it needs one; past the wait the client gets
a clear OpenAI error. Through the real ``openai`` SDK, on loopback, on a real Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from gateway.core.settings import load_settings
from gateway.http.server import GatewayServer
from tests.gateway.conftest import CHAT, HI, KEYS, MODEL, SimFactory, auth, closed_port, until

ADMIN = "sk-admin"


def write_config(path: Path, redis_url: str, backend_urls: dict[str, str],
                 cold_start_wait_s: float) -> None:
    path.write_text(yaml.safe_dump({
        "redis_url": redis_url, "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"name": name, "url": url, "model": MODEL}
                     for name, url in backend_urls.items()],
        "api_keys": KEYS, "admin_keys": [ADMIN],
        "scrape_interval_s": 0.02, "replica_heartbeat_s": 0.2,
        "unhealthy_after_failures": 1, "retry_after_s": 3,
        "cold_start_wait_s": cold_start_wait_s,
        "autoscale": {"interval_s": 0.05}, "queue_status_interval_s": 0.05,
    }))


async def admin(http: aiohttp.ClientSession, method: str, url: str) -> tuple[int, Any]:
    async with http.request(method, url, headers=auth(ADMIN)) as resp:
        return resp.status, await resp.json()


async def streamed_with_status(http: aiohttp.ClientSession, url: str,
                               placed: asyncio.Event) -> list[bytes]:
    """A stream asking for its queue status: its lines, ``placed`` set at the first that
    gives its position in the queue."""
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, "stream": True,
            "ignore_eos": True}
    headers = {**auth("sk-bob"), "X-Fairgate-Queue-Status": "1"}
    async with http.post(url + CHAT, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        lines = []
        async for line in resp.content:
            lines.append(line)
            if line.startswith(b": queue position="):
                placed.set()
        return lines


async def pool_view(http: aiohttp.ClientSession, gw: GatewayServer) -> dict[str, Any]:
    status, body = await admin(http, "GET", gw.url + "/admin/pools")
    assert status == 200, body
    views: dict[str, Any] = {p["pool"]: p for p in body["data"]}
    return views[MODEL]


async def test_a_pool_at_zero_holds_a_request_until_a_backend_appears(
        sim: SimFactory, redis_url: str, redis: Any, tmp_path: Path) -> None:
    path = tmp_path / "fairgate.yaml"
    nowhere = f"http://127.0.0.1:{closed_port()}"  # the pool's backend, not started yet
    write_config(path, redis_url, {"b0": nowhere}, cold_start_wait_s=60.0)
    gw = GatewayServer(load_settings(path))
    await gw.start()
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0)
    try:
        async with aiohttp.ClientSession() as http:
            held = asyncio.create_task(client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=3,
                extra_body={"ignore_eos": True}))

            async def queued() -> bool:
                assert not held.done(), f"answered while no backend was ready: {held}"
                return (await gw.services.store.reads.depths(MODEL))["interactive"] == 1

            await until(queued, "the request held in the queue")
            placed = asyncio.Event()
            streamed = asyncio.create_task(streamed_with_status(http, gw.url, placed))
            await asyncio.wait_for(placed.wait(), 30)  # its place while the pool is at zero

            async def asks_for_one() -> bool:
                view = await pool_view(http, gw)
                return bool(view["desired_replicas"] >= 1
                            and view["classes"]["interactive"]["queued_requests"] == 2)

            await until(asks_for_one, "the pool at zero to ask for a backend")
            view = await pool_view(http, gw)
            assert (view["ready_replicas"], view["desired_replicas"]) == (0, 1), view
            assert view["classes"]["interactive"]["queued_requests"] == 2, view
            async with http.get(gw.url + "/metrics") as resp:
                text = await resp.text()
            assert f'fairgate_pool_desired_replicas{{pool="{MODEL}"}} 1.0' in text, [
                line for line in text.splitlines() if "pool_desired" in line]

            backend = await sim(profile="instant")
            write_config(path, redis_url, {"b0": nowhere, "b1": backend.url},
                         cold_start_wait_s=60.0)
            status, got = await admin(http, "POST", gw.url + "/admin/reload")
            assert status == 200 and got["backends"]["added"] == ["b1"], got
            answer = await asyncio.wait_for(held, 30)
            assert answer.usage is not None and answer.usage.completion_tokens == 3, answer
            lines = await asyncio.wait_for(streamed, 30)
            assert lines[-2:] == [b"data: [DONE]\n", b"\n"], lines[-4:]
            assert len(backend.engine.records) == 2, backend.engine.records
    finally:
        await client.close()
        await gw.stop()


async def test_past_cold_start_wait_the_client_gets_a_503(
        redis_url: str, redis: Any, tmp_path: Path) -> None:
    path = tmp_path / "fairgate.yaml"
    write_config(path, redis_url, {"b0": f"http://127.0.0.1:{closed_port()}"},
                 cold_start_wait_s=0.3)
    gw = GatewayServer(load_settings(path))
    await gw.start()
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0)
    try:
        with pytest.raises(openai.InternalServerError) as exc:
            await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
        err = exc.value
        assert (err.status_code, err.code) == (503, "no_healthy_backend"), err.body
        assert "cold_start_wait_s (0.3 s)" in err.message, err.message
        assert err.response.headers["Retry-After"] == "3", dict(err.response.headers)
        # it left the queue
        assert await gw.services.store.reads.depths(MODEL) == {
            "interactive": 0, "default": 0, "batch": 0}
    finally:
        await client.close()
        await gw.stop()
