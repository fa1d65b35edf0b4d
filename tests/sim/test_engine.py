"""The asyncio engine: scheduling outcomes seen through records and streams."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from loadtest.sim.engine import EngineConfig, SimEngine
from loadtest.sim.server import SimServer
from tests.sim.conftest import MODEL

EngineFactory = Callable[..., SimEngine]


@pytest.fixture
async def make_engine() -> AsyncIterator[EngineFactory]:
    engines: list[SimEngine] = []

    def factory(**overrides: Any) -> SimEngine:
        engine = SimEngine(EngineConfig(**{"model": MODEL, "profile": "instant", **overrides}))
        engine.start()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        await engine.stop()


def all_done(engine: SimEngine) -> Callable[[], bool]:
    return lambda: all(r.finished_s is not None for r in engine.records.values())


async def admission_order(engine: SimEngine) -> list[str]:
    for name, priority in [("a", 5), ("b", 1), ("c", 0), ("d", 1), ("e", 0)]:
        engine.add_request(name, prompt_tokens=8, max_tokens=3, priority=priority)
    await asyncio.wait_for(engine.wait_until(all_done(engine)), 10)
    records = sorted(engine.records.values(), key=lambda r: r.first_scheduled_s or 0.0)
    return [r.request_id for r in records]


async def test_priority_policy_orders_waiting_queue(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_seqs=1, scheduling_policy="priority")
    assert await admission_order(engine) == ["c", "e", "b", "d", "a"]


async def test_fcfs_ignores_priority_but_records_it(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_seqs=1)
    assert await admission_order(engine) == ["a", "b", "c", "d", "e"]
    assert engine.records["a"].priority == 5


async def test_max_num_seqs_respected(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_seqs=4)
    streams = [engine.add_request(f"r{i}", prompt_tokens=20, max_tokens=10) for i in range(12)]
    counts = await asyncio.gather(*(consume(s) for s in streams))
    assert counts == [10] * 12
    assert engine.step_stats().max_batch_seqs == 4
    assert max(step.num_seqs for step in engine.step_log) == 4


async def consume(stream: Any) -> int:
    emitted = [token async for token in stream]
    assert [t.index for t in emitted] == list(range(len(emitted)))
    assert all(a.emit_s <= b.emit_s for a, b in itertools.pairwise(emitted))
    return len(emitted)


async def test_preemption_under_kv_pressure_completes(make_engine: EngineFactory) -> None:
    engine = make_engine(scheduling_policy="priority", kv_blocks=6, max_model_len=96)
    for name, priority in [("a", 0), ("b", 5), ("c", 1)]:
        engine.add_request(name, prompt_tokens=32, max_tokens=40, priority=priority)
    await asyncio.wait_for(engine.wait_until(all_done(engine)), 10)
    records = engine.records
    assert records["b"].num_preemptions >= 1
    assert records["a"].num_preemptions == 0
    assert [records[n].output_tokens for n in "abc"] == [40, 40, 40]
    assert engine.kv_usage == 0.0


async def test_step_log_records_modelled_and_actual(make_engine: EngineFactory) -> None:
    engine = make_engine(profile="cpu-tiny")
    stream = engine.add_request("x", prompt_tokens=100, max_tokens=5)
    assert await consume(stream) == 5
    stats = engine.step_stats()
    assert stats.num_steps == 5
    assert stats.modelled_total_s > 0 and stats.actual_total_s > 0
    assert all(step.modelled_s > 0 for step in engine.step_log)


async def test_preemptions_reach_metrics() -> None:
    config = EngineConfig(
        model=MODEL, profile="h100-llama3.1-8b", scheduling_policy="priority", kv_blocks=6,
        max_model_len=96,
    )  # fmt: skip
    server = SimServer(config)
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "x" * 128, "max_tokens": 40, "ignore_eos": True}
            statuses = await asyncio.gather(
                *(post_status(http, server.url, {**body, "priority": p}) for p in (0, 5, 1))
            )
            assert statuses == [200, 200, 200]
            async with http.get(server.url + "/metrics") as resp:
                text = await resp.text()
    finally:
        await server.stop()
    preemptions = sum(r.num_preemptions for r in server.engine.records.values())
    assert preemptions >= 1
    assert f'vllm:num_preemptions_total{{engine="0",model_name="{MODEL}"}} {preemptions}.0' in text


async def post_status(http: aiohttp.ClientSession, url: str, body: Any) -> int:
    async with http.post(url + "/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status
