"""``fairgate_share_ratio``: who each user is reaches Redis with its service (share.lua on
a real Redis), and every replica's /metrics and /admin/state read the same fleet-wide
ratio of each backlogged user (two replicas on one Redis)."""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp
import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.records import Who
from gateway.storage.store import Store
from policies.share_ratio import Account
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory
from tests.ops.conftest import ADMIN, admin_call, samples, until

K = ModelKeys("m")
WEIGHTED_KEYS = [
    {"key": "sk-heavy", "user": "heavy", "priority_class": "interactive", "weight": 4.0},
    {"key": "sk-light", "user": "light", "priority_class": "interactive", "weight": 1.0},
    {"key": "sk-r1", "user": "r1", "priority_class": "interactive", "tenant": "research"},
]


async def test_accounts_carry_weights_and_tenants_and_stay_bounded(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    # scores are service ÷ key weight: heavy's 200 at weight 4 cost 800
    await store.shares.add_service("m", {"heavy": 200.0, "light": 200.0}, 1000.0, 60.0, 3, 120,
                            {"heavy": Who("", 4.0, 4.0), "light": Who("", 1.0, 1.0),
                             "r1": Who("research", 1.0, 2.0)})
    accounts = await store.shares.service_accounts("m")
    assert accounts == {"heavy": Account(800.0, 4.0, "", 4.0),
                        "light": Account(200.0, 1.0, "", 1.0),
                        "r1": Account(0.0, 1.0, "research", 2.0)}, accounts
    assert await store.shares.service_shares("m") == {"heavy": 0.5, "light": 0.5}  # served only
    # past the cap the smallest goes, and who it was with it
    await store.shares.add_service("m", {"carol": 500.0}, 1000.0, 60.0, 3, 120)
    assert set(await store.shares.service_accounts("m")) == {"heavy", "light", "carol"}
    assert set(await redis.hkeys(K.service_who)) == {"heavy", "light"}
    assert 0 < await redis.ttl(K.service_who) <= 120
    # a user served by a replica that records nobody reads as weight 1, its own tenant
    assert (await store.shares.service_accounts("m"))["carol"] == Account(500.0)


async def queued_request(session: aiohttp.ClientSession, url: str, key: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    async with session.post(url + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        await resp.read()


async def test_every_replica_reports_the_same_ratio_of_each_backlogged_user(
        sim: SimFactory, gateway: GatewayFactory, redis: aioredis.Redis) -> None:
    backend = await sim()
    first = await gateway([backend], admin_keys=[ADMIN], api_keys=WEIGHTED_KEYS)
    second = await gateway([backend], admin_keys=[ADMIN], api_keys=WEIGHTED_KEYS)
    store = first.services.store
    # recent service as if served: scores 150 each, so heavy's cost 600 at weight 4 and
    # light's 150 at weight 1 (4:1, as their weights), r1's none
    await store.shares.add_service(MODEL, {"heavy": 150.0, "light": 150.0}, time.time(), 60.0, 1000,
                            600)
    async with aiohttp.ClientSession() as http:
        status, _ = await admin_call(http, "POST", first.url + "/admin/backends/b0/drain")
        assert status == 200
        waiting = [asyncio.create_task(queued_request(http, gw.url, key))
                   for gw, key in ((first, "sk-heavy"), (second, "sk-light"),
                                   (second, "sk-r1"))]
        try:
            async def all_queued() -> bool:
                return sum((await store.reads.depths(MODEL)).values()) == 3
            await until(all_queued, what="three requests queued behind the drained backend")

            async def r1_known() -> bool:  # the other replica's history adds it within a tick
                return "r1" in await store.shares.service_accounts(MODEL)
            await until(r1_known, what="r1's tenant and weight in Redis")
            for gw in (first, second):
                async with http.get(gw.url + "/metrics") as resp:
                    parsed = samples(await resp.text())
                ratios = {(level, name): parsed.get(("fairgate_share_ratio", frozenset(
                              {"model": MODEL, "level": level, "name": name}.items())))
                          for level, name in (("user", "heavy"), ("user", "light"),
                                              ("user", "r1"), ("tenant", "research"),
                                              ("tenant", "heavy"))}
                # weights 4, 1 and research's 1 (unlisted): entitled 4/6, 1/6 and 1/6 of 750,
                # served 600, 150 and 0: r1's sixth went to the other two in proportion
                heavy, light = ratios[("user", "heavy")], ratios[("user", "light")]
                assert math.isclose(heavy or 0, (600 / 750) / (4 / 6)), ratios
                assert math.isclose(light or 0, (150 / 750) / (1 / 6)), ratios
                assert ratios[("user", "r1")] == 0.0 and ratios[("tenant", "research")] == 0.0
                assert ratios[("tenant", "heavy")] is None, ratios  # its own tenant: no series
                status, state = await admin_call(http, "GET", gw.url + "/admin/state")
                shown = state["models"][MODEL]["share_ratios"]
                assert math.isclose(shown["users"]["light"], 1.2), shown
                assert shown["tenants"] == {"research": 0.0}, shown
        finally:
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)

        async def none_queued() -> bool:
            return sum((await store.reads.depths(MODEL)).values()) == 0
        await until(none_queued, what="the cancelled clients' requests leaving the queue")
        async with http.get(second.url + "/metrics") as resp:
            text = await resp.text()
        assert "fairgate_share_ratio{" not in text, "nobody backlogged: no ratio series"
        await admin_call(http, "POST", first.url + "/admin/backends/b0/undrain")
