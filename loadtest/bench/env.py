"""Options shared by every scenario and the environment of one bench run: a Redis for the
gateways, a fresh simulated backend per phase (or the external ``--backend``), and
``fairgate serve`` processes in front of it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis

from gateway.storage.embedded_redis import EmbeddedRedis, free_port
from loadtest.bench.client import Target
from loadtest.bench.procs import (
    Proc,
    SimSpec,
    backend_model,
    start_gateway,
    start_sim,
    start_together,
    wait_idle,
)

MODEL = "llama-3.1-8b"
DIAGNOSTICS = "gateway_diagnostics.json"
# Gateway series worth keeping with a run: why gates were closed, and for how long.
DIAGNOSTIC_SERIES = ("fairgate_gate_closed_seconds_total", "fairgate_gate_closed_total",
                     "fairgate_dispatches_total", "fairgate_redis_command_duration_seconds_sum",
                     "fairgate_redis_command_duration_seconds_count")


async def save_diagnostics(url: str, path: Path, label: str) -> None:
    """Append the gateway's gate and Redis counters (from its /metrics) to ``path``."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in DIAGNOSTIC_SERIES and sample.value:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                                  if k not in ("model", "backend"))
                found[f"{sample.name}{{{labels}}}"] = round(sample.value, 4)
    _merge_json(path, label, found)


def _merge_json(path: Path, label: str, found: dict[str, float]) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data[label] = found
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


@dataclass
class Options:
    out: Path
    backend: str | None = None
    quick: bool = False
    size: int | None = None
    duration_s: float | None = None
    progress: bool = True
    redis_url: str | None = None
    command: str = ""
    # Endpoints of the scenarios that run per endpoint (newcomer, mixed): "chat",
    # "completions" (see client.ENDPOINTS).
    endpoints: tuple[str, ...] = ("chat", "completions")
    # gateway processes (`fairgate serve --workers`); overhead measures 1 and N (default 2)
    workers: int = 1
    # overhead: the peers to measure beside fairgate (loadtest/bench/peers.py; None: all)
    peers: tuple[str, ...] | None = None
    # overhead: py-spy on the one-worker gateway at saturation (loadtest/bench/profile.py)
    profile: bool = False
    # overhead: one more one-worker fairgate phase served from this source tree (an
    # earlier commit's checkout), so before and after are measured in one run
    baseline_tree: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def pick(self, full: Any, quick: Any) -> Any:
        return quick if self.quick else full


@dataclass
class Backend:
    url: str
    model: str
    proc: Proc | None  # None: external, not ours to stop

    def target(self) -> Target:
        return Target("direct", self.url, self.model, via_gateway=False)


def gateway_target(gw: Proc, backend: Backend, name: str = "gateway") -> Target:
    return Target(name, gw.url, backend.model, via_gateway=True)


def api_keys(users: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """One key ``sk-<user>`` per (user, class)."""
    return [{"key": f"sk-{u}", "user": u, "priority_class": c} for u, c in users]


class Bench:
    """``async with Bench(opts) as bench``: owns the Redis; hands out backends/gateways."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.log_dir = opts.out / "logs"
        self._redis: EmbeddedRedis | None = None
        self.redis_url = opts.redis_url or ""

    async def __aenter__(self) -> Bench:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.opts.out / DIAGNOSTICS).unlink(missing_ok=True)
        if not self.redis_url:
            self._redis = EmbeddedRedis().start()
            self.redis_url = self._redis.url
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._redis is not None:
            self._redis.stop()

    @contextlib.asynccontextmanager
    async def backend(self, spec: SimSpec, label: str) -> AsyncIterator[Backend]:
        """A fresh simulator per phase, so phases never see each other's leftovers."""
        if self.opts.backend:
            url = self.opts.backend.rstrip("/")
            await wait_idle(url)
            yield Backend(url, await backend_model(url), None)
            return
        proc = await start_sim(spec, MODEL, self.log_dir, label)
        try:
            yield Backend(proc.url, MODEL, proc)
        finally:
            proc.stop()

    @contextlib.asynccontextmanager
    async def gateway(self, backend: Backend, users: Sequence[tuple[str, str]], label: str,
                      workers: int | None = None, source: Path | None = None,
                      **settings: Any) -> AsyncIterator[Proc]:
        """``fairgate serve`` in front of ``backend`` with one key per user, on a clean
        Redis database; ``workers`` processes (default: ``--workers``)."""
        self._flush()
        async with self.replica(backend, users, label, workers, source, **settings) as proc:
            yield proc

    @contextlib.asynccontextmanager
    async def served(self, spec: SimSpec, sim_label: str, users: Sequence[tuple[str, str]],
                     label: str, workers: int | None = None, **settings: Any
                     ) -> AsyncIterator[tuple[Backend, Proc]]:
        """:meth:`backend` and :meth:`gateway` in front of it, started side by side: the
        simulator's port is chosen first, so the gateway's config names its URL before
        either runs, and the two boots overlap (the gateway's /ready waits for the
        simulator's first healthy scrape). Stopped as the nested pair would be: the
        gateway, then the simulator."""
        if self.opts.backend:  # an external backend: nothing of ours to start beside it
            async with self.backend(spec, sim_label) as backend, \
                    self.gateway(backend, users, label, workers, **settings) as proc:
                yield backend, proc
            return
        self._flush()
        port = free_port()
        backend = Backend(f"http://127.0.0.1:{port}", MODEL, None)
        sim, proc = await start_together({
            sim_label: start_sim(spec, MODEL, self.log_dir, sim_label, port),
            label: start_gateway(self._config(backend, users, settings), self.log_dir, label,
                                 workers or self.opts.workers)})
        backend.proc = sim
        try:
            try:
                yield backend, proc
            finally:
                await self._stop_gateway(proc, label)
        finally:
            sim.stop()

    @contextlib.asynccontextmanager
    async def replica(self, backend: Backend, users: Sequence[tuple[str, str]], label: str,
                      workers: int | None = None, source: Path | None = None,
                      **settings: Any) -> AsyncIterator[Proc]:
        """Like :meth:`gateway`, on the Redis database as it is: one more replica
        (``source``: served from that source tree, :func:`~loadtest.bench.procs.start_gateway`)."""
        proc = await start_gateway(self._config(backend, users, settings), self.log_dir, label,
                                   workers or self.opts.workers, source)
        try:
            yield proc
        finally:
            await self._stop_gateway(proc, label)

    def _flush(self) -> None:
        client = redis.Redis.from_url(self.redis_url)
        try:
            client.flushdb()
        finally:
            client.close()

    def _config(self, backend: Backend, users: Sequence[tuple[str, str]],
                settings: dict[str, Any]) -> dict[str, Any]:
        return {
            "redis_url": self.redis_url,
            "backends": [{"name": "b0", "url": backend.url, "model": backend.model}],
            "api_keys": api_keys(users),
            **settings,
        }

    async def _stop_gateway(self, proc: Proc, label: str) -> None:
        try:
            await save_diagnostics(proc.url, self.opts.out / DIAGNOSTICS, label)
        finally:
            proc.stop()
