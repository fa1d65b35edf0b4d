"""A gateway in front of simulated vLLM backends, all on loopback, on a real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

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
        for handle in server.context.pool.handles.values():
            await handle.scraped.wait()
        return server

    yield make
    for server in started:
        await server.stop()
