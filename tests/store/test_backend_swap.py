"""``backend_swap.lua``: a runtime backend's entry changes only if it is still what the
caller read, so processes that race (a DNS answer seen by every process, two operators)
change it once."""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from gateway.storage.keys import RUNTIME_BACKENDS
from gateway.storage.scripts import load_script


async def test_swap_adds_changes_and_deletes_only_from_what_was_read(
        redis: aioredis.Redis) -> None:
    swap = redis.register_script(load_script("backend_swap"))

    async def run(expected: str | None, wanted: str | None) -> dict[str, object]:
        """(None: no entry expected; the entry deleted)"""
        args = {"backends": RUNTIME_BACKENDS, "name": "rt0"}
        if expected is not None:
            args["expected"] = expected
        if wanted is not None:
            args["wanted"] = wanted
        out: dict[str, object] = json.loads(await swap(keys=[RUNTIME_BACKENDS],
                                                       args=[json.dumps(args)]))
        return out

    assert await run(None, "one") == {"swapped": True}
    assert await redis.hget(RUNTIME_BACKENDS, "rt0") == "one"
    # a second add (another process read "none" too) changes nothing and sees the entry
    assert await run(None, "other") == {"swapped": False, "found": "one"}
    assert await run("stale", "two") == {"swapped": False, "found": "one"}
    assert await redis.hget(RUNTIME_BACKENDS, "rt0") == "one"
    assert await run("one", "two") == {"swapped": True}
    # deleting what changed meanwhile: refused
    assert await run("one", None) == {"swapped": False, "found": "two"}
    assert await run("two", None) == {"swapped": True}
    assert await redis.hexists(RUNTIME_BACKENDS, "rt0") == 0
    assert await run("two", None) == {"swapped": False}  # gone already
