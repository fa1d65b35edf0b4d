"""Shared fixtures: a real Redis server (embedded Valkey, or FAIRGATE_TEST_REDIS_URL)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from gateway.embedded_redis import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    external = os.environ.get("FAIRGATE_TEST_REDIS_URL")
    if external:
        yield external
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client on a freshly flushed database."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()
