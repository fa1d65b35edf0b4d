"""Load helpers for the real-vLLM tier: floods, completion order, /metrics sampling."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.vllm_metrics import RawMetrics, parse_metrics


async def scrape(client: httpx.AsyncClient, base_url: str) -> RawMetrics:
    r = await client.get(base_url + "/metrics", timeout=5)
    r.raise_for_status()
    return parse_metrics(r.text)


async def histogram_totals(base_url: str, names: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """(sum, count) of vLLM's histograms ``names`` (the ``vllm:`` ones, all label sets
    added up). Cumulative, so unlike a sampled gauge no burst is missed while the CPU
    build's API server answers no /metrics; retried until it answers."""
    totals = {n: (0.0, 0.0) for n in names}
    async with httpx.AsyncClient() as client:
        for _ in range(60):
            with contextlib.suppress(httpx.HTTPError):
                r = await client.get(base_url + "/metrics", timeout=10)
                r.raise_for_status()
                break
            await asyncio.sleep(1)
        else:
            raise AssertionError(f"{base_url}/metrics answered nothing for a minute")
    for family in text_string_to_metric_families(r.text):
        if family.name in names:
            for s in family.samples:
                total, count = totals[family.name]
                if s.name.endswith("_sum"):
                    totals[family.name] = (total + s.value, count)
                elif s.name.endswith("_count"):
                    totals[family.name] = (total, count + s.value)
    return totals


@dataclass
class Sampler:
    """Samples vLLM's running/waiting gauges every ``interval_s`` until stopped."""

    base_url: str
    interval_s: float = 0.05
    waiting: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        async with httpx.AsyncClient(limits=limits(4)) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    m = await scrape(client, self.base_url)
                    self.waiting.append(m.waiting)
                    self.running.append(m.running)
                await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def __aenter__(self) -> Sampler:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


@dataclass
class Finished:
    tag: str
    at: float  # monotonic seconds
    completion_tokens: int


async def complete(
    client: httpx.AsyncClient,
    url: str,
    tag: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    retry_dropped: bool = False,
) -> Finished:
    """POST one non-streaming completion; return when (monotonic) it finished.

    ``retry_dropped``: straight to vLLM, whose CPU build's API server (2 cores, a burst of
    dozens of long requests) now and then closes a connection before answering; such a
    request is sent once more. Never set through fairgate, which must not drop any."""
    try:
        r = await client.post(url, json=body, headers=headers or {}, timeout=300)
    except (httpx.ReadError, httpx.RemoteProtocolError):
        if not retry_dropped:
            raise
        r = await client.post(url, json=body, headers=headers or {}, timeout=300)
    assert r.status_code == 200, f"{tag}: {r.status_code} {r.text[:300]}"
    usage = r.json()["usage"]
    return Finished(tag, time.monotonic(), int(usage["completion_tokens"]))


def completion_body(
    model: str, max_tokens: int, priority: int | None = None, prompt: str = "the fair queue"
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    if priority is not None:
        body["priority"] = priority
    return body


async def wait_until(pred: Any, timeout_s: float, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(interval_s)


# vLLM's server (uvicorn) closes idle keep-alive connections after 5 s, httpx's default
# expiry: reusing one at that moment fails with ReadError. Expire ours well before.
KEEPALIVE_EXPIRY_S = 2.0


def limits(n: int) -> httpx.Limits:
    return httpx.Limits(max_connections=n, max_keepalive_connections=n,
                        keepalive_expiry=KEEPALIVE_EXPIRY_S)


QUEUE_TIME = "vllm:request_queue_time_seconds"


@dataclass
class QueueLength:
    """vLLM's waiting queue over a stretch of time, two ways: its gauge as ``sampler`` saw
    it, and its time average by Little's law from its cumulative queue-time histogram
    (no burst missed while the CPU build's API server answers no /metrics)."""

    sampler: Sampler
    started_s: float = 0.0
    queued_before: tuple[float, float] = (0.0, 0.0)
    mean: float | None = None

    @property
    def running(self) -> list[float]:
        return self.sampler.running

    async def __aenter__(self) -> QueueLength:
        self.queued_before = (await histogram_totals(self.sampler.base_url, (QUEUE_TIME,)))[
            QUEUE_TIME]
        self.started_s = time.monotonic()
        await self.sampler.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sampler.__aexit__(*exc)
        elapsed = time.monotonic() - self.started_s
        after = (await histogram_totals(self.sampler.base_url, (QUEUE_TIME,)))[QUEUE_TIME]
        self.mean = (after[0] - self.queued_before[0]) / elapsed if elapsed > 0 else None

    def assert_paced(self, mean_at_most: float, max_at_most: float) -> None:
        """The pacing promise: the queue's time average (Little's law: misses no burst)
        within ``mean_at_most``, and no gauge sample above ``max_at_most``; the observed
        values in the message. The sampled p90 is reported, not judged: on a starved CPU
        the API server answers /metrics in bursts, so its samples are not spread in time."""
        values = sorted(self.sampler.waiting)
        assert values, "no /metrics sample of vLLM during the run"
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        observed = (f"time-averaged {self.mean}; waiting p90 {p90}, max {values[-1]} of "
                    f"{len(values)} samples (largest {values[-10:]})")
        assert self.mean is not None and self.mean <= mean_at_most, observed
        assert values[-1] <= max_at_most, observed
