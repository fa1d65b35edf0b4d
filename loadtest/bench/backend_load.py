"""The backend's own queue during a run: its ``/metrics`` waiting gauge, sampled.

The gateway's pacing promise is that the backend's waiting queue stays at most
``max_waiting`` (3) plus the requests still in transit; this is what shows whether it
held, per endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import TracebackType
from typing import Any

import aiohttp

from gateway.backends.vllm_metrics import parse_metrics
from loadtest.bench.stats import percentile

SAMPLE_INTERVAL_S = 0.05


class WaitingSampler:
    """``async with WaitingSampler(url) as s``: samples ``url``'s waiting gauge until exit."""

    def __init__(self, url: str, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.url = url
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []  # (monotonic s, waiting)
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    async with http.get(self.url + "/metrics") as resp:
                        raw = parse_metrics(await resp.text())
                    self.samples.append((time.monotonic(), raw.waiting))
                await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> WaitingSampler:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def summary(self) -> dict[str, Any]:
        """Max, p50, p90, p99 and mean of the sampled waiting gauge."""
        values = [w for _, w in self.samples]
        return {
            "samples": len(values),
            "max": max(values) if values else None,
            "p50": percentile(values, 50),
            "p90": percentile(values, 90),
            "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else None,
        }
