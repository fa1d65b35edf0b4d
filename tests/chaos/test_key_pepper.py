"""Without ``key_pepper``, the runtime keys' pepper is the store's (issue 29, item 8): a
``fairgate serve`` process, its Redis SIGKILLed and started again empty, a second process
started after that. Each says at start that it generated the pepper (the store it found
had none); a key created on either works on both."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from gateway.storage.embedded_redis import EmbeddedRedis
from tests.gateway.conftest import SimFactory, until
from tests.gateway.test_runtime_keys import ADMIN, admin, works
from tests.gateway.test_workers import Served, serve


@contextlib.asynccontextmanager
async def gateway(backend_url: str, redis_url: str, where: Path) -> AsyncIterator[Served]:
    os.mkdir(where)
    async with serve(backend_url, redis_url, where, 1, admin_keys=[ADMIN]) as served:
        yield served


async def new_key(http: aiohttp.ClientSession, served: Served, user: str) -> str:
    status, created = await admin(http, "POST", served.url + "/admin/keys", json={"user": user})
    assert status == 201, (status, created)
    return str(created["key"])


async def test_processes_started_before_and_after_an_empty_redis_share_the_pepper(
        sim: SimFactory, tmp_path: Path) -> None:
    redis = EmbeddedRedis(data_dir=tmp_path / "redis").start()  # no AOF: restarts empty
    backend = await sim(profile="instant")
    try:
        async with aiohttp.ClientSession() as http, \
                gateway(backend.url, redis.url, tmp_path / "early") as early:
            said = await early.event("key_pepper_generated")
            assert "key_pepper" in said["hint"], said
            assert await works(early, await new_key(http, early, "before"))
            redis.kill()
            redis = EmbeddedRedis(port=redis.port, data_dir=redis.data_dir).start()
            async with gateway(backend.url, redis.url, tmp_path / "late") as late:
                await late.event("key_pepper_generated")  # the store it found was empty
                secret = await new_key(http, late, "after")
                assert await works(late, secret)
                await until(lambda: works(early, secret),
                            "a key created on the later process works on the earlier one")
                changed = await early.event("key_pepper_changed")
                assert "restarted empty" in changed["reason"], changed
                secret = await new_key(http, early, "again")
                assert await works(early, secret)
                assert await works(late, secret), "a key of the earlier process, on the later"
            generated = [e for e in early.events if e["event"] == "key_pepper_generated"]
            assert len(generated) == 1, f"the earlier process drew a second pepper: {generated}"
    finally:
        redis.stop()
