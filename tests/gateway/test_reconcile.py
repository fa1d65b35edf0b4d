"""After a Redis restart from an AOF that lost its last writes, Redis may say a replica
holds requests it already finished: reconcile() settles exactly those."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import SettingsHolder, load_settings
from gateway.scheduling.grants import Waiter
from gateway.scheduling.replicas import RECONCILE_GRACE_S
from gateway.services import build_dispatcher, build_pool
from gateway.storage.keys import ModelKeys
from gateway.storage.records import QueuedRequest
from gateway.storage.redis_client import BoundaryRedis, connect
from gateway.storage.store import Store

M = "m"
K = ModelKeys(M)
OPEN = {"interactive": 10, "default": 10, "batch": 10}


@pytest.fixture
async def client(redis_url: str, redis: object) -> AsyncIterator[BoundaryRedis]:
    c = connect(redis_url)
    yield c
    await c.aclose()


async def test_reconcile_releases_only_what_the_replica_does_not_hold(
        client: BoundaryRedis) -> None:
    settings = load_settings(None, backends=[{"name": "b1", "url": "http://127.0.0.1:1",
                                              "model": M}])
    store = Store.over(client, request_ttl_s=600)
    async with aiohttp.ClientSession() as session:
        holder = SettingsHolder(settings)
        pool = build_pool(holder, session, store.fleet, GatewayMetrics())
        dispatcher = build_dispatcher(holder, store, pool, GatewayMetrics(), "r1")
        now = 1000.0
        await store.replicas.heartbeat([M], "r1", now)
        for rid, user in (("held", "a"), ("finished", "b"), ("young", "c")):
            await store.queue.enqueue(M, QueuedRequest(rid, user, "default", "r1", 1.0, now), 10)
        grants, _ = await store.queue.dispatch(M, "b1", OPEN, "r1", now, 10.0, max_grants=3)
        by_id = {g.request_id: g for g in grants}
        dispatcher.held["held"] = by_id["held"]  # still streaming on this replica
        # "young" was dispatched just now: its grant may still be on its way
        await client.hset(K.request("young"), "dispatched_at", now + RECONCILE_GRACE_S)

        assert await dispatcher.replicas.reconcile(M, now + RECONCILE_GRACE_S + 1) == 1
        assert await client.hgetall(K.user_inflight) == {"a": "1", "c": "1"}
        assert await client.get(K.backend_inflight("b1")) == "2"
        assert await client.smembers(K.running("r1")) == {"held", "young"}
        # nothing more to do on a second pass
        assert await dispatcher.replicas.reconcile(M, now + RECONCILE_GRACE_S + 1) == 0


async def test_reconcile_delivers_a_grant_whose_client_still_waits(
        client: BoundaryRedis) -> None:
    """A grant popped from a store that died before answering never reached the replica:
    Redis says it holds the request, its client still waits, so reconcile hands it over
    (instead of releasing it, which would leave the client waiting for nothing)."""
    settings = load_settings(None, backends=[{"name": "b1", "url": "http://127.0.0.1:1",
                                              "model": M}])
    store = Store.over(client, request_ttl_s=600)
    async with aiohttp.ClientSession() as session:
        holder = SettingsHolder(settings)
        pool = build_pool(holder, session, store.fleet, GatewayMetrics())
        dispatcher = build_dispatcher(holder, store, pool, GatewayMetrics(), "r1")
        now = 1000.0
        await store.replicas.heartbeat([M], "r1", now)
        queued = QueuedRequest("lost-reply", "a", "default", "r1", 1.0, now)
        future = asyncio.get_running_loop().create_future()
        dispatcher.waiters["lost-reply"] = Waiter(queued, M, future)
        await store.queue.enqueue(M, queued, 10)
        await store.queue.dispatch(M, "b1", OPEN, "r1", now, 10.0)
        await client.delete(K.grants("r1"))  # the grant list entry went with the reply

        assert await dispatcher.replicas.reconcile(M, now + RECONCILE_GRACE_S + 1) == 0
        assert future.done(), "the waiting client got no grant"
        grant = future.result()
        assert (grant.request_id, grant.backend) == ("lost-reply", "b1"), grant
        assert dispatcher.held["lost-reply"] == grant
        assert await client.hget(K.request("lost-reply"), "state") == "dispatched"
