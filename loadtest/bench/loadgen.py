"""Load shapes, each bounded in request count and in time, with a tqdm progress bar."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from loadtest.bench.client import Result, Spec, Target, send


def progress(total: int | None, desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr (counts finished requests); silent when disabled."""
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, unit="req",
                file=sys.stderr, dynamic_ncols=True)


async def cancel_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class LoopUser:
    """A closed-loop user: ``concurrency`` workers, each sending ``spec`` back to back."""

    spec: Spec
    concurrency: int


async def closed_loop(session: aiohttp.ClientSession, target: Target, users: Sequence[LoopUser],
                      duration_s: float, bar: Any, max_requests: int = 1_000_000,
                      sink: list[Result] | None = None) -> list[Result]:
    """Run until ``duration_s`` or ``max_requests``; then cancel what is still in flight."""
    results: list[Result] = [] if sink is None else sink
    deadline = time.perf_counter() + duration_s
    budget = [max_requests]

    async def worker(spec: Spec) -> None:
        while time.perf_counter() < deadline and budget[0] > 0:
            budget[0] -= 1
            await send(session, target, spec, results)
            bar.update(1)

    tasks = [asyncio.create_task(worker(u.spec)) for u in users for _ in range(u.concurrency)]
    await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    await cancel_all(tasks)
    return results


async def open_loop(session: aiohttp.ClientSession, target: Target,
                    make: Callable[[int], Spec], rate: float, duration_s: float, bar: Any,
                    poisson: bool = True, seed: int = 0, drain_s: float = 30.0,
                    sink: list[Result] | None = None) -> list[Result]:
    """Send at ``rate`` req/s (Poisson or evenly spaced) for ``duration_s``; wait up to
    ``drain_s`` for the last answers, then cancel."""
    return await stepped_loop(session, target, make, [(rate, duration_s)], bar, poisson, seed,
                              drain_s, sink)


async def stepped_loop(session: aiohttp.ClientSession, target: Target,
                       make: Callable[[int], Spec], steps: Sequence[tuple[float, float]],
                       bar: Any, poisson: bool = True, seed: int = 0, drain_s: float = 30.0,
                       sink: list[Result] | None = None) -> list[Result]:
    """An open loop whose rate steps: each ``(rate, duration_s)`` in turn, ``rate ×
    duration_s`` requests each; then up to ``drain_s`` for the last answers, then cancel."""
    rng = random.Random(seed)
    results: list[Result] = [] if sink is None else sink
    tasks: list[asyncio.Task[Any]] = []
    start = time.perf_counter()
    step_at = 0.0
    for rate, duration_s in steps:
        at = step_at
        for _ in range(int(rate * duration_s)):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send(session, target, make(len(tasks)), results))
            task.add_done_callback(lambda _t: bar.update(1))
            tasks.append(task)
            at += rng.expovariate(rate) if poisson else 1.0 / rate
        step_at += duration_s
    if tasks:
        await asyncio.wait(tasks, timeout=drain_s)
    await cancel_all(tasks)
    return results


async def fire(session: aiohttp.ClientSession, target: Target, specs: Sequence[Spec], bar: Any,
               results: list[Result]) -> list[asyncio.Task[Any]]:
    """Send every spec at once; returns the tasks (the caller bounds and cancels them)."""
    tasks = []
    for spec in specs:
        task = asyncio.create_task(send(session, target, spec, results))
        task.add_done_callback(lambda _t: bar.update(1))
        tasks.append(task)
    await asyncio.sleep(0)
    return tasks
