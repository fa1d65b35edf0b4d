"""The store behind Redis Sentinel (real master, replica and three sentinels): the
boundary client finds the master through the sentinels, counts commands and maps errors
as on a plain URL, and after the master is SIGKILLed it reaches the promoted replica with
its scripts loaded again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.core.errors import StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.storage.keys import ModelKeys
from gateway.storage.records import QueuedRequest
from gateway.storage.redis_client import connect_sentinel
from gateway.storage.store import Store
from tests.sentinel_rig import SentinelRig

M = "m"
K = ModelKeys(M)
OPEN = {"interactive": 10, "default": 10, "batch": 10}


@pytest.fixture
async def rig() -> AsyncIterator[SentinelRig]:
    made = SentinelRig()
    try:
        yield await made.start()
    finally:
        await made.stop()


def counted(metrics: GatewayMetrics, script: str) -> float:
    return sum(s.value for m in metrics.registry.collect()
               if m.name == "fairgate_redis_commands"
               for s in m.samples if s.name.endswith("_total")
               and s.labels.get("script") == script)


async def test_sentinel_client_follows_a_failover(rig: SentinelRig) -> None:
    metrics = GatewayMetrics()
    client = connect_sentinel(rig.config(), metrics.redis, socket_connect_timeout=2)
    store = Store.over(client, request_ttl_s=600)
    try:
        await store.replicas.heartbeat([M], "r1", 1000.0)
        assert await store.queue.enqueue(M, QueuedRequest("a", "u", "default", "r1", 1.0, 1000.0),
                                   10) == 1
        assert counted(metrics, "enqueue") >= 1, "the enqueue script was not counted"
        async with rig.master_client() as master:  # the client is on the master
            assert await master.exists(K.request("a")) == 1
        async with rig.replica_client() as replica:  # replicated before the kill
            for _ in range(500):
                if await replica.exists(K.request("a")):
                    break
                await asyncio.sleep(0.01)
            assert await replica.exists(K.request("a")) == 1

        rig.kill_master()
        with pytest.raises(StoreUnavailable):
            await store.queue.enqueue(M, QueuedRequest("b", "u", "default", "r1", 1.0, 1001.0), 10)
        await rig.until_promoted()

        async with rig.replica_client() as promoted:
            await promoted.script_flush()  # a promoted replica need not hold our scripts
        position = await store.queue.enqueue(
            M, QueuedRequest("c", "u", "default", "r1", 1.0, 1002.0), 10)
        assert position == 2, f"the promoted master answered position {position}"
        grants, _ = await store.queue.dispatch(M, "b1", OPEN, "r1", 1003.0, 10.0, max_grants=3)
        assert [g.request_id for g in grants][-1] == "c", grants
    finally:
        await client.aclose()
