"""A trusted key's end users leave nothing in Redis once idle past ``end_user_idle_s``:
served through HTTP with the ``openai`` client, then forgotten by the heartbeat's pass,
while end users with a request queued or running keep their state."""

from __future__ import annotations

import time
from typing import Any

import openai
import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.values import SEEN
from tests.gateway.conftest import (
    MODEL,
    BusyFactory,
    GatewayFactory,
    SimFactory,
    long_chat,
    store_is_idle,
    until,
)
from tests.store.test_forget import count, end_user_state, memory

K = ModelKeys(MODEL)
DAY_S = 86400.0


def app_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-app", max_retries=0)


async def serve_end_users(url: str, names: list[str]) -> None:
    async with app_client(url) as client:
        for name in names:
            done = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                                   user=name)
            assert done.usage is not None and done.usage.completion_tokens == 2, done


def end_user(body: dict[str, Any], name: str) -> dict[str, Any]:
    return {**body, "user": name}


async def test_idle_end_users_are_forgotten_and_active_ones_kept(
        sim: SimFactory, gateway: GatewayFactory, busy: BusyFactory,
        redis: aioredis.Redis) -> None:
    backend = await sim(max_num_seqs=1)
    gw = await gateway([backend], classes={"interactive": {"max_waiting": 1}})
    names = [f"e{i}" for i in range(20)]
    await serve_end_users(gw.url, names)
    await store_is_idle(gw)  # every settle (charge, last-seen time) is in Redis

    async def shares_fed() -> bool:  # and every service share: none arrives later
        await gw.services.inspector.history.flush_service()
        shares = await redis.zrange(K.service, 0, -1)
        return len([u for u in shares if u.startswith("app/e")]) == len(names)

    await until(shares_fed, "the end users' service shares in Redis")
    # three end users stay active: one running, one waiting in vLLM, one queued here
    engine, load = backend.engine, busy(gw, backend)
    load.send("sk-app", end_user(long_chat(), "running"))
    await until(lambda: engine.num_running == 1, "the first long request running")
    load.send("sk-app", end_user(long_chat(), "waiting"))
    await until(lambda: engine.num_waiting == 1, "the second waiting in vLLM")
    handle = gw.services.pool.handles["b0"]
    await until(lambda: handle.last is not None and handle.last.waiting == 1
                and handle.last.running == 1, "a snapshot with the backend full")
    load.send("sk-app", end_user(long_chat(), "queued"))

    async def one_queued() -> bool:
        return (await gw.services.store.reads.depths(MODEL))["interactive"] == 1

    await until(one_queued, "the third queued in Redis")
    before, bytes_before = await end_user_state(redis), await memory(redis)
    served = [k for k in before if any("app/e" in n for n in before[k])]
    assert await redis.zcard(K.seen) == len(names) + 3, before

    # the heartbeat's pass, a day and a second later (its default setting)
    forgotten = await gw.services.dispatcher.replicas.forget_idle(MODEL, time.time() + DAY_S + 1)

    after, bytes_after = await end_user_state(redis), await memory(redis)
    message = (f"forgot {forgotten}; {count(before)} end-user fields/keys in {len(served)} "
               f"keys, {bytes_before} B before; {count(after)}, {bytes_after} B after: {after}")
    assert forgotten == len(names), message
    assert not [n for names_ in after.values() for n in names_ if "app/e" in n], message
    for name in ("running", "waiting", "queued"):
        # an end user of the app key (no tenant named) is a user of the app's own tenant
        assert await redis.zscore(K.seen, SEEN.encode("app", f"app/{name}")), message
    assert set(await gw.services.store.reads.user_inflight(MODEL)) == {"app/running",
                                                                "app/waiting"}, message
    await load.close()


async def test_the_heartbeat_forgets_end_users_idle_past_the_setting(
        sim: SimFactory, gateway: GatewayFactory, redis: aioredis.Redis) -> None:
    backend = await sim()
    gw = await gateway([backend], end_user_idle_s=0.5)
    await serve_end_users(gw.url, [f"h{i}" for i in range(5)])

    async def forgotten() -> bool:
        # the service shares are bounded and expire by themselves: a feed that lands
        # after the pass may bring a forgotten user's share back until then
        state = await end_user_state(redis)
        return not [k for k in state if k not in (K.service, K.service_who)]

    await until(forgotten, "no state of the end users left in Redis")
    assert await redis.zcard(K.seen) == 0
