"""``backend_swap.lua``: a runtime backend's entry changes only if it is still what the
caller read, so processes that race (a DNS answer seen by every process, two operators)
change it once."""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway.storage.keys import RUNTIME_BACKENDS
from gateway.storage.scripts import load_script


async def test_swap_adds_changes_and_deletes_only_from_what_was_read(
        redis: aioredis.Redis) -> None:
    swap = redis.register_script(load_script("backend_swap"))

    async def run(expected: str, wanted: str) -> list[object]:
        return list(await swap(keys=[RUNTIME_BACKENDS], args=["rt0", expected, wanted]))

    assert await run("", "one") == [1, None]
    assert await redis.hget(RUNTIME_BACKENDS, "rt0") == "one"
    # a second add (another process read "none" too) changes nothing and sees the entry
    assert await run("", "other") == [0, "one"]
    assert await run("stale", "two") == [0, "one"]
    assert await redis.hget(RUNTIME_BACKENDS, "rt0") == "one"
    assert await run("one", "two") == [1, None]
    assert await run("one", "") == [0, "two"]  # deleting what changed meanwhile: refused
    assert await run("two", "") == [1, None]
    assert await redis.hexists(RUNTIME_BACKENDS, "rt0") == 0
    assert await run("two", "") == [0, None]  # gone already
