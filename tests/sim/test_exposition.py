"""The simulator's /metrics text is prometheus_client's, byte for byte, at a fraction of
its cost (``loadtest/sim/exposition.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import generate_latest

from gateway.backends.vllm_metrics import WANTED, parse_metrics
from loadtest.sim.engine import EngineConfig
from loadtest.sim.server import SimServer


async def busy_sim(**config: object) -> SimServer:
    server = SimServer(EngineConfig("m", profile="instant", **config))  # type: ignore[arg-type]
    server.engine.start()
    streams = [server.engine.add_request(f"r{i}", prompt_tokens=16 + i, max_tokens=4 + i)
               for i in range(20)]
    server.engine.abort_stream(streams[0])
    await server.engine.wait_until(lambda: not server.engine.scheduler.has_work())
    return server


async def test_the_text_is_generate_latest_s_byte_for_byte() -> None:
    for config in ({}, {"enable_lora": True, "max_loras": 2}):
        server = await busy_sim(**config)
        try:
            for _ in range(2):  # the second call from the kept series
                assert server.metrics.render(server.engine) == generate_latest(
                    server.metrics.registry)
        finally:
            await server.engine.stop()


async def test_the_gateway_view_shows_what_the_scraper_reads_and_costs_a_fraction() -> None:
    """``fairgate sim --metrics gateway`` (the fleet bench): the samples fairgate reads,
    the same numbers as the whole text, without the buckets nobody reads."""
    server = await busy_sim()
    lean = SimServer(EngineConfig("m", profile="instant"), metrics_only=WANTED)
    try:
        lean.metrics.registry = server.metrics.registry  # the same numbers, both views
        lean.metrics.shown = server.metrics.registry.restricted_registry(WANTED)
        full = server.metrics.render(server.engine).decode()
        shown = lean.metrics.exposition.render(lean.metrics.shown).decode()
        assert parse_metrics(shown) == parse_metrics(full)
        assert shown.count("\n") < full.count("\n") / 5, (shown.count("\n"), full.count("\n"))

        def cost(render: Callable[[], object]) -> float:
            start = time.perf_counter()
            for _ in range(20):
                render()
            return time.perf_counter() - start

        fast = cost(lambda: lean.metrics.exposition.render(lean.metrics.shown))
        slow = cost(lambda: generate_latest(server.metrics.registry))
        print(f"\ngateway view: {fast * 50:.2f} ms, generate_latest {slow * 50:.2f} ms")
        assert fast < slow / 3, (fast, slow)
    finally:
        await server.engine.stop()
