"""A gateway in front of simulated vLLM backends, all on loopback, on a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.server import GatewayServer
from gateway.settings import Settings, load_settings
from loadtest.sim.engine import EngineConfig
from loadtest.sim.server import SimServer

MODEL = "llama-3.1-8b"
KEYS = [
    {"key": "sk-alice", "user": "alice", "priority_class": "interactive"},
    {"key": "sk-bob", "user": "bob", "priority_class": "interactive"},
    {"key": "sk-carol", "user": "carol", "priority_class": "interactive"},
    {"key": "sk-dflt", "user": "dave", "priority_class": "default"},
    {"key": "sk-batch", "user": "bert", "priority_class": "batch"},
    {"key": "sk-app", "user": "app", "priority_class": "interactive", "trusted_end_users": True},
]

SimFactory = Callable[..., Awaitable[SimServer]]
GatewayFactory = Callable[..., Awaitable[GatewayServer]]


@pytest.fixture
async def sim() -> AsyncIterator[SimFactory]:
    started: list[SimServer] = []

    async def make(**overrides: Any) -> SimServer:
        reject = overrides.pop("reject_priority", False)
        config = EngineConfig(model=MODEL, **{"scheduling_policy": "priority", **overrides})
        server = SimServer(config, reject_priority=reject)
        await server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop()


async def assert_settled(server: GatewayServer) -> None:
    """Every exit path must have released its in-flight state and queue entries."""
    store = server.services.store
    for _ in range(200):  # settle() runs as the handler unwinds: give it a bounded moment
        if await store.user_inflight(MODEL) == {} and not any(
                (await store.depths(MODEL)).values()):
            return
        await asyncio.sleep(0.01)
    assert await store.user_inflight(MODEL) == {}
    assert await store.depths(MODEL) == {"interactive": 0, "default": 0, "batch": 0}


async def complete(session: aiohttp.ClientSession, base_url: str, key: str, max_tokens: int,
                   prompt: str = "hello", **extra: Any) -> dict[str, Any]:
    """A non-streaming completion through the gateway; returns the JSON body."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            **extra}
    async with session.post(base_url + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        data: dict[str, Any] = await resp.json()
        assert resp.status == 200, data
        return data


def gateway_settings(redis_url: str, backends: list[SimServer], **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"name": f"b{i}", "url": s.url, "model": MODEL}
                     for i, s in enumerate(backends)],
        "api_keys": KEYS,
        "scrape_interval_s": 0.02,
        "replica_heartbeat_s": 0.2,
    }
    values.update(overrides)
    return load_settings(None, **values)


@pytest.fixture
async def gateway(redis: aioredis.Redis, redis_url: str) -> AsyncIterator[GatewayFactory]:
    started: list[GatewayServer] = []

    async def make(backends: list[SimServer], **overrides: Any) -> GatewayServer:
        server = GatewayServer(gateway_settings(redis_url, backends, **overrides))
        await server.start()
        started.append(server)
        for handle in server.services.pool.handles.values():
            await handle.scraped.wait()
        return server

    yield make
    for server in started:
        await assert_settled(server)
    for server in started:
        await server.stop()
