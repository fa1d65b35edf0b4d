"""Batch under an interactive flood: held back to its floor, then fills the idle backend."""

from __future__ import annotations

import asyncio

import aiohttp

from loadtest.sim.records import RequestRecord
from loadtest.sim.server import SimServer
from tests.gateway.conftest import GatewayFactory, SimFactory, complete

FLOOD, BATCH = 150, 30
ALICE, BATCH_TOKENS, BOB = 20, 19, 21


async def run_mix(gw_url: str, backend: SimServer) -> list[RequestRecord]:
    engine = backend.engine
    async with aiohttp.ClientSession() as session:
        flood = [asyncio.create_task(complete(session, gw_url, "sk-alice", ALICE))
                 for _ in range(FLOOD)]
        await engine.wait_until(lambda: len(engine.records) >= 3)
        batch = [asyncio.create_task(complete(session, gw_url, "sk-batch", BATCH_TOKENS))
                 for _ in range(BATCH)]
        await engine.wait_until(lambda: len(engine.records) >= FLOOD // 2)
        await asyncio.gather(*flood, *batch, complete(session, gw_url, "sk-bob", BOB))
    return sorted(engine.records.values(), key=lambda r: r.arrival_s)


def during_flood(records: list[RequestRecord]) -> list[RequestRecord]:
    last_alice = max(i for i, r in enumerate(records) if r.max_tokens == ALICE)
    return records[: last_alice + 1]


async def test_batch_waits_for_an_empty_queue_without_a_floor(sim: SimFactory,
                                                              gateway: GatewayFactory) -> None:
    backend = await sim(max_num_seqs=4)
    gw = await gateway([backend], class_floors={"batch": 0.0})
    records = await run_mix(gw.url, backend)
    assert sum(r.max_tokens == BATCH_TOKENS for r in during_flood(records)) <= 1
    assert sum(r.max_tokens == BATCH_TOKENS for r in records) == BATCH  # then all of it ran


async def test_starved_batch_gets_its_floor_and_no_more(sim: SimFactory,
                                                        gateway: GatewayFactory) -> None:
    backend = await sim(max_num_seqs=4)
    gw = await gateway([backend], class_floors={"batch": 0.1}, starvation_after_s=0.2,
                       starvation_window=20)
    records = await run_mix(gw.url, backend)
    flood = during_flood(records)
    first_batch = next(i for i, r in enumerate(flood) if r.max_tokens == BATCH_TOKENS)
    window = flood[first_batch:]
    share = sum(r.max_tokens == BATCH_TOKENS for r in window) / len(window)
    assert 0.05 <= share <= 0.2, share  # ≈ the 10 % floor while interactive saturates
    # the newcomer still overtakes the flood
    assert [r.max_tokens for r in records].index(BOB) < len(records) - FLOOD // 3
    # once interactive stops, batch runs back to back: its rate rises
    tail = records[len(flood):]
    batch_tail = [r for r in tail if r.max_tokens == BATCH_TOKENS]
    batch_window = [r for r in window if r.max_tokens == BATCH_TOKENS]
    assert len(batch_window) >= 2 and len(batch_tail) >= 2, (len(batch_window), len(batch_tail))
    rate_during = len(batch_window) / (window[-1].arrival_s - window[0].arrival_s)
    rate_after = len(batch_tail) / (batch_tail[-1].arrival_s - flood[-1].arrival_s)
    assert rate_after > 2 * rate_during, (rate_after, rate_during)
