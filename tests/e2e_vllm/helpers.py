"""Load helpers for the real-vLLM tier: floods, completion order, /metrics sampling."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
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
    """Samples vLLM's running/waiting gauges every ``interval_s`` until stopped, with the
    time each answer came (``at``, monotonic). ``inflight``: the gateway's exact count of
    requests at the backend, read right after each answer (``beside``)."""

    base_url: str
    interval_s: float = 0.05
    inflight: Callable[[], Awaitable[int]] | None = None
    waiting: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    at: list[float] = field(default_factory=list)
    beside: list[int] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        async with httpx.AsyncClient(limits=limits(4)) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    m = await scrape(client, self.base_url)
                    at = time.monotonic()
                    beside = None if self.inflight is None else await self.inflight()
                    self.at.append(at)
                    self.waiting.append(m.waiting)
                    self.running.append(m.running)
                    if beside is not None:
                        self.beside.append(beside)
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
# The longest a run's vLLM queue may go unsampled for its p90 and max to count (seen with
# the server on a CPU of its own: 0.09-0.13 s idle, 0.51 s beside 3 busy loops at load 6)
MAX_SAMPLE_GAP_S = 1.0
# a run whose sampler was starved all the same (a loaded machine) measured nothing either
# way: it runs again, this many runs at most, and the last one is judged
PACED_RUNS = 3


@dataclass
class QueueLength:
    """vLLM's waiting queue over a stretch of time, two ways: its gauge as ``sampler`` saw
    it, and its time average by Little's law from its cumulative queue-time histogram
    (no burst missed while the CPU build's API server answers no /metrics)."""

    sampler: Sampler
    started_s: float = 0.0
    ended_s: float = 0.0
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
        self.ended_s = time.monotonic()
        elapsed = self.ended_s - self.started_s
        after = (await histogram_totals(self.sampler.base_url, (QUEUE_TIME,)))[QUEUE_TIME]
        self.mean = (after[0] - self.queued_before[0]) / elapsed if elapsed > 0 else None

    def fed(self) -> bool:
        """Whether the samples cover the run (no stretch over ``MAX_SAMPLE_GAP_S`` without
        one): only then do their p90 and max measure it."""
        return bool(self.sampler.waiting) and self.largest_gap() <= MAX_SAMPLE_GAP_S

    def largest_gap(self) -> float:
        """The longest stretch of the run without a sample (its start and end included)."""
        times = [self.started_s, *self.sampler.at, self.ended_s]
        return max(b - a for a, b in itertools.pairwise(times))

    def observed(self) -> str:
        values = sorted(self.sampler.waiting)
        top = p90(values) if values else None
        seen = (f"waiting p90 {top}, max {max(values, default=None)} of {len(values)} "
                f"samples over {self.ended_s - self.started_s:.1f} s (largest {values[-10:]}, "
                f"longest without a sample {self.largest_gap():.2f} s), time-averaged "
                f"{self.mean}")
        if not self.sampler.beside:
            return seen
        # the gateway's exact count beside each sample: at most the batch plus max_waiting;
        # less vLLM's running it over-counts the queue by the requests vLLM has finished
        # and the gateway has not settled yet (4 at once when a full batch ends together)
        beyond = sorted(max(0.0, n - r) for n, r in zip(self.sampler.beside,
                                                        self.sampler.running, strict=True))
        return (f"{seen}; gateway in flight at vLLM max {max(self.sampler.beside)}, "
                f"less vLLM's running p90 {p90(beyond)}, max {beyond[-1]}")

    def assert_paced(self, p90_at_most: float, max_at_most: float) -> None:
        """The pacing promise: the sampled waiting gauge's p90 and max, and the time-averaged
        queue (Little's law: misses no burst), within the bounds; the observed values in
        the message (printed too: ``-rP`` shows them for a passed test). The samples must
        cover the run (no stretch over ``MAX_SAMPLE_GAP_S`` without one): a starved
        sampler that saw a few moments is no measurement (the server on a CPU of its own,
        conftest's ``server_cpus``, keeps it fed)."""
        values = sorted(self.sampler.waiting)
        observed = self.observed()
        print(f"pacing: {observed}")
        assert values, "no /metrics sample of vLLM during the run"
        assert self.largest_gap() <= MAX_SAMPLE_GAP_S, f"sampling starved: {observed}"
        assert p90(values) <= p90_at_most and values[-1] <= max_at_most, observed
        assert self.mean is not None and self.mean <= p90_at_most, observed


def p90(values: list[float]) -> float:
    """The 90th percentile of sorted, non-empty ``values``."""
    return values[min(len(values) - 1, int(0.9 * len(values)))]
