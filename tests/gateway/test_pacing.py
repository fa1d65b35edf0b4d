"""Adaptive pacing wired to the scrape loop: a backend's TPOT over the class's target
lowers the allowance at once and it comes back when the backend recovers; ``pacing:
fixed`` leaves ``max_waiting`` alone."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import aiohttp

from gateway.backends.handle import BackendHandle
from gateway.http.server import GatewayServer
from tests.gateway.conftest import GatewayFactory, SimFactory, complete

# A TPOT target no backend meets (the fixed gate then shuts on TPOT too), and a short TPOT
# window so the backend "recovers" once nothing finished for half a second.
SLOW = {"classes": {"interactive": {"max_tpot_ms": 0.001}}, "tpot_window_s": 0.5}


async def next_scrape_where(handle: BackendHandle, cond: Callable[[], bool]) -> None:
    async def loop() -> None:
        while not cond():
            handle.scraped.clear()
            await handle.scraped.wait()
    await asyncio.wait_for(loop(), 30)


async def two_requests(gw: GatewayServer) -> None:
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(complete(session, gw.url, "sk-alice", 8) for _ in range(2)))


async def test_slow_tpot_lowers_the_allowance_and_recovery_restores_it(
    sim: SimFactory, gateway: GatewayFactory
) -> None:
    gw = await gateway([await sim()], **SLOW)
    handle = gw.services.pool.handles["b0"]
    assert handle.pacing["interactive"].allowance == 3.0
    await two_requests(gw)
    await next_scrape_where(handle, lambda: handle.pacing["interactive"].reason == "tpot")
    assert handle.pacing["interactive"].allowance < 3.0
    # nothing finishes any more: no recent TPOT, the allowance climbs back to max_waiting
    await next_scrape_where(handle, lambda: handle.pacing["interactive"].allowance == 3.0)
    assert handle.pacing["interactive"].reason == "headroom"
    async with aiohttp.ClientSession() as session, session.get(gw.url + "/metrics") as r:
        text = await r.text()
    assert 'fairgate_pacing_changes_total{backend="b0",priority_class="interactive",' \
           'reason="tpot"}' in text
    # the allowance is back at max_waiting; the idle batch's free slots have a gauge of
    # their own (at most max_waiting)
    gauges = {name: re.search(name + r'\{backend="b0",priority_class="interactive"\} '
                              r'([0-9.]+)', text) for name in ("fairgate_pacing_allowance",
                                                               "fairgate_pacing_free_slots")}
    values = {name: float(m.group(1)) if m else None for name, m in gauges.items()}
    assert values["fairgate_pacing_allowance"] == 3.0, values
    free = values["fairgate_pacing_free_slots"]
    assert free is not None and 0.0 <= free <= 3.0, values


async def test_fixed_pacing_keeps_max_waiting(sim: SimFactory, gateway: GatewayFactory) -> None:
    gw = await gateway([await sim()], pacing="fixed", **SLOW)
    handle = gw.services.pool.handles["b0"]
    await two_requests(gw)
    # the TPOT gate shut (the snapshots saw the slow TPOT) but pacing did not move
    await next_scrape_where(handle, lambda: handle.gates["interactive"].reason == "tpot")
    assert handle.pacing["interactive"].allowance == 3.0
    assert handle.pacing["interactive"].reason == "start"
