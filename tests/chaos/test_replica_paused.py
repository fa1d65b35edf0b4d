"""A gateway replica paused (SIGSTOP) past the heartbeat TTL while it holds queued
clients, then resumed: the kind of stall a CPU-starved or frozen machine makes.

Meanwhile the other replica takes it for dead: its queued requests are dropped when
dispatch reaches them and what it held is reaped. Once resumed, the paused replica's
clients still wait on their connections, so nothing they asked for may be lost: each
request the store forgot goes in again (a CI run on a loaded machine answered one
``503 queued_request_lost``), and none runs twice at the engine.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis

from gateway.http.server import GatewayServer
from gateway.storage.keys import ModelKeys
from tests.gateway.conftest import MODEL, SimFactory, complete, gateway_settings, until
from tests.processes import replica_config, start_gateway, until_ready

CLIENTS = 10
TTL_S = "1"  # both replicas take a replica silent this long for dead


async def test_a_paused_replica_loses_none_of_its_queued_clients(
        sim: SimFactory, redis: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    backend = await sim(max_num_seqs=2)
    config, port = replica_config(tmp_path, "paused", redis_url, [backend.url])
    paused = await start_gateway(config, port, {
        "FAIRGATE_SCRAPE_INTERVAL_S": "0.02", "FAIRGATE_REPLICA_HEARTBEAT_S": "0.2",
        "FAIRGATE_REPLICA_TTL_S": TTL_S})
    paused_url = f"http://127.0.0.1:{port}"
    await until_ready(paused_url)
    other = GatewayServer(gateway_settings(redis_url, [backend], replica_ttl_s=float(TTL_S)))
    await other.start()
    k = ModelKeys(MODEL)
    try:
        async with aiohttp.ClientSession() as http:
            clients = [asyncio.create_task(complete(http, paused_url, "sk-alice", 40 + i))
                       for i in range(CLIENTS)]

            async def queued() -> int:
                return int(await redis.hget(k.depth, "interactive") or 0)

            await until(lambda: backend.engine.num_running == 2, "the backend full", 30)
            async def four_queued() -> bool:
                return await queued() >= 4

            await until(four_queued, "the paused replica's clients queued", 30)
            waiting = await redis.lrange(k.queue("interactive", "alice"), 0, -1)
            paused_id = await redis.hget(k.request(waiting[0]), "owner")
            at_pause = await queued()
            paused.send_signal(signal.SIGSTOP)
            try:
                async def taken_for_dead() -> bool:  # reaped, its queue dropped: the
                    # paused replica cannot dispatch, and the other grants no dead one
                    return (await redis.zscore(k.replicas, paused_id) is None
                            and await queued() == 0)

                await until(taken_for_dead, "the paused replica taken for dead", 60)
            finally:
                paused.send_signal(signal.SIGCONT)
            answers = await asyncio.gather(*clients, return_exceptions=True)
    finally:
        if paused.returncode is None:
            paused.terminate()
        await paused.wait()
        await other.stop()
    failed = [a for a in answers if isinstance(a, BaseException)]
    assert not failed, f"{len(failed)} of {CLIENTS} clients failed ({at_pause} queued at the " \
        f"pause): {failed[:2]}"
    served = Counter(r.max_tokens for r in backend.engine.records.values()
                     if r.finished_s is not None and not r.aborted)
    assert sorted(served) == [40 + i for i in range(CLIENTS)], served
    assert max(served.values()) == 1, f"a request ran twice: {served}"
