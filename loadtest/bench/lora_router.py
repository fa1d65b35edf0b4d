"""A client-side LoRA router: the baselines of ``fairgate bench adapters``.

It stands where a router without a shared queue stands in front of vLLM: it picks a
backend for each request (``round_robin``: the next in turn; ``least_loaded``: the one
with the fewest requests in flight from this router), loads the request's adapter there
if it is not (``POST /v1/load_lora_adapter``), making room first when the backend's
slots are full (``POST /v1/unload_lora_adapter`` of its least recently used adapter, an
idle one before a busy one, with no minimum residency), and sends the request straight to
that backend. Loads and unloads on one backend are made one at a time; requests whose
adapter is loaded do not wait for them.

An unload can overtake a request already placed on the unloaded adapter but not yet
admitted by vLLM (which answers 404 for a name it no longer has): :func:`send_routed`
places such a request again, at most ``ATTEMPTS`` times, and counts it
(``Router.replaced``).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from loadtest.bench.client import Result, Spec, Target, send

POLICIES = ("round_robin", "least_loaded")
ATTEMPTS = 5


class RouterError(Exception):
    """A backend refused a load or an unload."""


@dataclass
class Host:
    """One backend as the router sees it."""

    name: str
    url: str
    loaded: dict[str, float] = field(default_factory=dict)  # adapter -> last used (monotonic)
    in_flight: Counter[str] = field(default_factory=Counter)  # adapter -> requests placed
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # its loads and unloads

    @property
    def load(self) -> int:
        return sum(self.in_flight.values())

    def victim(self) -> str:
        """The adapter to unload: an idle one before a busy one, then the least recently
        used."""
        return min(self.loaded, key=lambda a: (self.in_flight[a] > 0, self.loaded[a]))


class Router:
    """``policy`` placement over ``urls`` with ``slots`` adapters kept per backend, its
    loads taking the backends' own load time (``paths``: adapter -> path to load)."""

    def __init__(self, policy: str, urls: list[str], slots: int, paths: dict[str, str],
                 http: aiohttp.ClientSession, seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown placement {policy!r} (one of {POLICIES})")
        self.policy = policy
        self.hosts = [Host(f"b{i}", url) for i, url in enumerate(urls)]
        self.slots = slots
        self.paths = paths
        self.http = http
        self.loads = self.unloads = self.replaced = 0
        self._turn = itertools.cycle(self.hosts)
        self._rng = random.Random(seed)

    def pick(self) -> Host:
        if self.policy == "round_robin":
            return next(self._turn)
        least = min(h.load for h in self.hosts)
        return self._rng.choice([h for h in self.hosts if h.load == least])

    async def place(self, adapter: str) -> Host:
        """A backend for one request of ``adapter``, with ``adapter`` loaded there; the
        caller calls :meth:`done` when the request ends."""
        host = self.pick()
        host.in_flight[adapter] += 1
        try:
            if adapter not in host.loaded:
                async with host.lock:
                    if adapter not in host.loaded:
                        if len(host.loaded) >= self.slots:
                            await self._unload(host, host.victim())
                        await self._load(host, adapter)
            host.loaded[adapter] = time.monotonic()
        except BaseException:
            self.done(host, adapter)
            raise
        return host

    def done(self, host: Host, adapter: str) -> None:
        host.in_flight[adapter] -= 1
        if host.in_flight[adapter] <= 0:
            del host.in_flight[adapter]

    async def _load(self, host: Host, adapter: str) -> None:
        body = {"lora_name": adapter, "lora_path": self.paths[adapter]}
        status, text = await self._post(host, "/v1/load_lora_adapter", body)
        if status != 200 and "already been loaded" not in text:
            raise RouterError(f"{host.name}: load {adapter}: {status} {text[:200]}")
        host.loaded[adapter] = time.monotonic()
        self.loads += 1

    async def _unload(self, host: Host, adapter: str) -> None:
        del host.loaded[adapter]  # no request is placed on it from now on
        status, text = await self._post(host, "/v1/unload_lora_adapter",
                                        {"lora_name": adapter})
        if status not in (200, 404):
            raise RouterError(f"{host.name}: unload {adapter}: {status} {text[:200]}")
        self.unloads += 1

    async def _post(self, host: Host, path: str, body: dict[str, str]) -> tuple[int, str]:
        async with self.http.post(host.url + path, json=body) as resp:
            return resp.status, await resp.text()


async def send_routed(router: Router, http: aiohttp.ClientSession, spec: Spec,
                      sink: list[Result]) -> None:
    """Send ``spec`` (its ``tag`` is the adapter) where ``router`` places it. The request's
    times start before its placement, so a wait for a load counts in its TTFT; one still
    waiting for a load when the run is cancelled is recorded as cancelled."""
    adapter, started = spec.tag, time.perf_counter()
    mine: list[Result] = []
    try:
        for attempt in range(ATTEMPTS):
            try:
                host = await router.place(adapter)
            except (RouterError, aiohttp.ClientError, TimeoutError) as exc:
                mine.append(Result(spec.user, adapter, spec.prompt_tokens, started,
                                   time.perf_counter(), error=repr(exc)[:300]))
                return
            try:
                result = await send(http, Target(router.policy, host.url, adapter, False),
                                    spec, mine)
            finally:
                router.done(host, adapter)
            if result.status != 404 or attempt == ATTEMPTS - 1:
                return
            mine.remove(result)  # unloaded before vLLM admitted it: placed again
            router.replaced += 1
    except asyncio.CancelledError:
        if not mine:
            mine.append(Result(spec.user, adapter, spec.prompt_tokens, started,
                               time.perf_counter(), error="cancelled"))
        raise
    finally:
        for result in mine:
            result.sent_s = started
        sink.extend(mine)
