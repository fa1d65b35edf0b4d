"""A replica that scrapes backends for all is SIGKILLed: another takes its scrape leases
over once they expire, scrapes, and serves on fresh snapshots."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis

from gateway.http.server import GatewayServer
from gateway.storage.keys import ModelKeys
from tests.gateway.conftest import MODEL, SimFactory, complete, gateway_settings, until
from tests.processes import replica_config, start_gateway, until_ready

INTERVAL_S = 0.05


async def test_a_killed_scraper_replica_hands_its_backends_to_another(
        sim: SimFactory, redis: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    backends = [await sim(profile="instant"), await sim(profile="instant")]
    config, port = replica_config(tmp_path, "scraper", redis_url, [b.url for b in backends])
    env = {"FAIRGATE_SCRAPE_INTERVAL_S": str(INTERVAL_S)}
    doomed = await start_gateway(config, port, env)
    await until_ready(f"http://127.0.0.1:{port}")  # it took the leases and scraped
    survivor = GatewayServer(gateway_settings(redis_url, backends,
                                              scrape_interval_s=INTERVAL_S))
    await survivor.start()
    k, pool = ModelKeys(MODEL), survivor.services.pool
    try:
        for name in ("b0", "b1"):
            await until(lambda n=name: pool.handles[n].scraped.is_set(),
                        f"the survivor reading {name}'s published snapshot")
        # the leases are shared: the survivor takes one of the two, the doomed keeps one
        leases: list[str | None] = []

        async def shared() -> bool:
            leases[:] = [await redis.get(k.backend_scraper(n)) for n in ("b0", "b1")]
            return (sum(h.lease.held for h in pool.handles.values()) == 1
                    and sum(f":{doomed.pid}:" in (lease or "") for lease in leases) == 1)
        await until(shared, "one lease held by each replica")
        doomed.send_signal(signal.SIGKILL)
        await doomed.wait()
        killed_at, killed_wall = time.monotonic(), time.time()
        # its leases expire (lease_s), the survivor's next tick takes them: a generous
        # bound for a loaded machine, the observed time reported
        bound = pool.lease_s + 10 * INTERVAL_S + 5.0
        await until(lambda: all(h.lease.held for h in pool.handles.values()),
                    "the survivor holding every scrape lease", timeout_s=bound)
        taken_s = time.monotonic() - killed_at
        await until(lambda: all(h.last is not None and h.last.taken_at_s > killed_wall
                                for h in pool.handles.values()),
                    "the survivor's own snapshots", timeout_s=bound)
        print(f"\nscrape leases taken over {taken_s:.2f}s after the kill "
              f"(lease {pool.lease_s}s, bound {bound:.1f}s)")
        for name in ("b0", "b1"):
            assert await redis.get(k.backend_scraper(name)) == pool.scraper_id
        now = time.time()
        for h in pool.handles.values():
            assert h.healthy and all(g.open for g in h.gates_at(
                now, survivor.services.settings.snapshot_stale_s).values()), (
                h.name, h.failures, h.gates, h.last)
        async with aiohttp.ClientSession() as session:
            await complete(session, survivor.url, "sk-bob", 2)
    finally:
        if doomed.returncode is None:
            doomed.kill()
        await survivor.stop()
