"""``store_outage: local``: Redis SIGKILLed under a queue of two users' requests. The
replica serves its own clients meanwhile (no 503), fairly and paced; when Redis comes back
from its AOF, what is still queued here goes back to it, and nothing runs twice."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from hypothesis import given
from hypothesis import strategies as st

from gateway.http.server import GatewayServer
from gateway.storage.embedded_redis import EmbeddedRedis
from policies.gates import Gate, share
from tests.gateway.conftest import MODEL, SimFactory, gateway_settings, store_is_idle, until

PER_USER = 12


@given(limit=st.integers(0, 50), free=st.integers(0, 50), occupancy=st.integers(0, 80),
       replicas=st.integers(1, 8))
def test_each_replicas_share_adds_up_to_the_gate_plus_less_than_one_each(
        limit: int, free: int, occupancy: int, replicas: int) -> None:
    gate = Gate(limit, None, min(free, limit), occupancy)
    part = share(gate, replicas)
    assert gate.limit <= replicas * part.limit < gate.limit + replicas, (gate, part)
    assert gate.max_inflight <= replicas * part.max_inflight < gate.max_inflight + replicas
    assert part.free_slots <= part.limit, part


def test_a_closed_gate_stays_closed_and_one_replica_keeps_it_whole() -> None:
    assert share(Gate(0, "stale"), 3) == Gate(0, "stale")
    assert share(Gate(5, None, 2, 9), 1) == Gate(5, None, 2, 9)


async def ask(http: aiohttp.ClientSession, url: str, key: str, max_tokens: int
              ) -> tuple[int, int]:
    """A completion through the gateway: (status, completion tokens)."""
    body = {"model": MODEL, "prompt": f"n{max_tokens}", "max_tokens": max_tokens,
            "ignore_eos": True}
    async with http.post(url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {key}"}) as resp:
        data: dict[str, Any] = await resp.json()
        return resp.status, (data.get("usage") or {}).get("completion_tokens", 0)


async def test_an_outage_is_served_here_and_the_queue_handed_back(
        sim: SimFactory, tmp_path: Path) -> None:
    server = EmbeddedRedis(data_dir=tmp_path / "redis", append_only=True).start()
    backend = await sim(max_num_seqs=2)
    gw = GatewayServer(gateway_settings(server.url, [backend], store_outage="local"))
    await gw.start()
    dispatcher = gw.services.dispatcher
    try:
        for handle in gw.services.pool.handles.values():
            await handle.scraped.wait()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            # alice and bob each queue PER_USER requests (distinct lengths: each names one)
            lengths = {key: [base + i for i in range(PER_USER)]
                       for key, base in (("sk-alice", 100), ("sk-bob", 200))}
            first = [asyncio.create_task(ask(http, gw.url, key, n))
                     for key, ns in lengths.items() for n in ns]
            depth = gw.services.store.reads.depths

            async def queued_in_redis() -> bool:
                return sum((await depth(MODEL)).values()) >= PER_USER

            await until(queued_in_redis, f"{PER_USER} requests queued in Redis")
            server.kill()
            # queued and new requests alike are served here, never 503
            await until(lambda: dispatcher.local.served != [], "a request granted locally")
            during = [asyncio.create_task(ask(http, gw.url, "sk-carol", 300 + i))
                      for i in range(4)]
            served_here = len(dispatcher.local.served)
            still_here = len(dispatcher.local.waiting)
            server = EmbeddedRedis(port=server.port, data_dir=server.data_dir,
                                   append_only=True).start()
            answers = await asyncio.gather(*first, *during)
            after = await ask(http, gw.url, "sk-alice", 400)
    finally:
        await gw.stop()
        server.stop()
    expected = [n for ns in lengths.values() for n in ns] + [300 + i for i in range(4)]
    assert answers == [(200, n) for n in expected], answers
    assert after == (200, 400), after
    ran = Counter(r.max_tokens for r in backend.engine.records.values())
    twice = {n: c for n, c in ran.items() if c > 1}
    assert not twice, f"dispatched more than once: {twice}"
    assert served_here >= 1 and still_here + served_here >= 1, (served_here, still_here)
    print(f"SCENARIO store_outage=local sent={len(expected) + 1} ok={len(expected) + 1} "
          f"served_locally>={served_here} queued_locally_at_restart={still_here} duplicated=0")


async def test_counters_converge_after_the_handback(sim: SimFactory, tmp_path: Path) -> None:
    """After an outage served locally the store's queues and in-flight counts are back to
    zero: requests granted here never entered its counts, those it still queued for them
    left its queues, and the settles it missed were retried."""
    server = EmbeddedRedis(data_dir=tmp_path / "redis", append_only=True).start()
    backend = await sim(max_num_seqs=2)
    gw = GatewayServer(gateway_settings(server.url, [backend], store_outage="local"))
    await gw.start()
    try:
        for handle in gw.services.pool.handles.values():
            await handle.scraped.wait()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            tasks = [asyncio.create_task(ask(http, gw.url, key, base + i))
                     for key, base in (("sk-alice", 100), ("sk-bob", 200))
                     for i in range(PER_USER)]

            async def queued_in_redis() -> bool:
                return sum((await gw.services.store.reads.depths(MODEL)).values()) >= PER_USER

            await until(queued_in_redis, f"{PER_USER} requests queued in Redis")
            server.kill()
            await until(lambda: gw.services.dispatcher.local.served != [],
                        "a request granted locally")
            server = EmbeddedRedis(port=server.port, data_dir=server.data_dir,
                                   append_only=True).start()
            answers = await asyncio.gather(*tasks)
        assert all(status == 200 for status, _ in answers), answers
        await store_is_idle(gw)
    finally:
        await gw.stop()
        server.stop()
