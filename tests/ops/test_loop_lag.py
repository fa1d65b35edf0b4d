"""``gateway/core/loop_lag.py``: a loop held busy shows as lag, and a running gateway
exposes the histogram."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway.core.loop_lag import watch
from gateway.core.metrics.process import LOOP_LAG_BUCKETS
from tests.gateway.conftest import GatewayFactory, SimFactory, until
from tests.ops.conftest import samples, value
from tests.ops.test_metrics import scrape

HELD_S = 0.3


async def test_a_callback_that_holds_the_loop_shows_as_lag() -> None:
    registry = CollectorRegistry()
    lag = Histogram("lag_seconds", "test", buckets=LOOP_LAG_BUCKETS, registry=registry)
    task = asyncio.create_task(watch(lag, every_s=0.01))

    def count() -> float:
        return registry.get_sample_value("lag_seconds_count") or 0.0
    def late() -> float:  # probes that fired more than 0.1 s late
        return count() - (registry.get_sample_value("lag_seconds_bucket", {"le": "0.1"})
                          or 0.0)
    try:
        await until(lambda: count() >= 1, "a first probe")
        late_before = late()  # none on a quiet machine; a loaded one may have some
        asyncio.get_running_loop().call_soon(time.sleep, HELD_S)  # a callback holding
        try:  # the probe pending when it ran fires late, or the next one does
            await until(lambda: late() > late_before, "a probe late by the held loop")
        except pytest.fail.Exception:
            pytest.fail(f"the loop was held {HELD_S}s, yet over {count():.0f} probes the "
                        f"lag summed {registry.get_sample_value('lag_seconds_sum')}s")
        total = registry.get_sample_value("lag_seconds_sum") or 0.0
        assert total >= HELD_S - 0.05, f"lag summed {total:.3f}s for a loop held {HELD_S}s"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_gateway_exposes_its_loop_lag(sim: SimFactory,
                                              gateway: GatewayFactory) -> None:
    gw = await gateway([await sim()])
    async with aiohttp.ClientSession() as http:
        async def probed() -> bool:
            m = samples(await scrape(http, gw.url))
            return (value(m, "fairgate_event_loop_lag_seconds_count") or 0) >= 1
        await until(probed, "fairgate_event_loop_lag_seconds_count in /metrics")
