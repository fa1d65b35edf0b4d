"""The pools' demand and capacity, and how many backends each needs (the autoscaling signal).

A pool is one model and prompt range: the backends that share a ``pool`` name (or, naming
none, a model). Every ``autoscale.interval_s`` the ``pools`` loop (supervised, started in
``gateway/services.py``) reads, per model, what every replica shares:

- the queue: each class's depth and a sample of its requests (estimated prompt tokens,
  deadline) from Redis; a sampled request counts for each pool whose backends' prompt
  range takes it (split evenly when several do), scaled to the class's depth;
- each backend's service rate: vLLM's token and request counters as its scraper
  published them (``gateway/backends/scrape.py``), over 30 s; the rate it served while it
  had work waiting is its capacity (before it ever had, the most it served);
- the prefix-cache hit ratio (a prompt's uncached share) and the output tokens per
  finished request (a queued request's expected output);
- the classes of the model's latest dispatches (their share of what is served now);
- the wait estimator (``gateway/scheduling/waits.py``, this replica's measured rate);
- the Batch API's backlog: the lines of unfinished batches not queued yet (the runner
  feeds a few at a time), shared among the pools in proportion to the batch requests each
  has queued, at their size, and the earliest batch's expiry (its completion window).

``policies/autoscale.py`` turns them into the desired replicas; the view is kept for
``GET /admin/pools`` and set on the ``fairgate_pool_*`` gauges, one snapshot for both.
Each replica computes the same inputs (its hysteresis state is its own): read the
signal as the ``max`` over replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.backends.handle import BackendHandle
from gateway.backends.scrape import BackendPool
from gateway.backends.vllm_metrics import OUTPUT, SERVICE
from gateway.core.errors import StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, Settings, SettingsHolder
from gateway.scheduling.waits import Waits
from gateway.storage.read_store import ReadStore
from gateway.storage.records import QueuedSample
from policies.autoscale import (
    ClassDemand,
    PoolDemand,
    ScaleRules,
    ScaleState,
    class_needs,
    decide,
    replicas_needed,
    window_at_risk,
    with_burst_baseline,
)
from policies.classes import CLASS_ORDER
from policies.wait_estimate import fits_deadline

log = structlog.get_logger("fairgate.pools")

PERCENTILES = {"p50": 0.5, "p90": 0.9}  # of a class's queue: the waits shown
CAPACITY_ALPHA = 0.2  # EWMA weight of a new busy-rate sample in a backend's capacity
BATCH_CLASS = "batch"  # the class the Batch API's lines run in (gateway/batch/runner.py)

BatchBacklog = Callable[[], Awaitable[tuple[int, float | None]]]
"""The unfinished batches' lines without a result, and the earliest expiry (unix s)."""


@dataclass(slots=True)
class _Capacity:
    """One backend's capacity estimate (tokens/s, requests/s)."""

    tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    busy: bool = False  # measured while work waited there (else: the most it served)


@dataclass(frozen=True, slots=True)
class _Batches:
    """The Batch API's lines not queued yet, all models, and the earliest expiry."""

    unqueued: int
    queued: int  # batch-class requests queued, all models
    expires_at: float | None


@dataclass(slots=True)
class _Queue:
    """One model's queue as the pools read it."""

    depths: dict[str, int]
    samples: dict[str, list[QueuedSample]]
    recent: list[str]  # classes of the latest dispatches, newest first
    waits: dict[str, Callable[[int], float | None]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Rates:
    """A pool's measured rates: what its ready backends serve now (tokens/s), what one
    backend can serve, a prompt's uncached share and the output tokens per request."""

    served: float
    mu: float | None  # None: never measured, none configured
    uncached: float
    output: float


def rules_of(settings: Settings) -> ScaleRules:
    a = settings.autoscale
    return ScaleRules(a.headroom, a.scale_down_delay_s, a.min_replicas, a.max_replicas,
                      a.burst_baseline_s)


def class_target_s(settings: Settings, klass: str) -> float | None:
    """A class's queue-wait target: its ``ttft_slo_ms``, else ``autoscale.queue_target_s``;
    None: it only fills idle backends (batch)."""
    slo = settings.classes[klass].ttft_slo_ms
    return slo / 1000 if slo is not None else settings.autoscale.queue_target_s.get(klass)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class PoolWatch(ReadsSettings):
    def __init__(self, settings: SettingsHolder, store: ReadStore, pool: BackendPool,
                 waits: Waits, metrics: GatewayMetrics,
                 batch_backlog: BatchBacklog | None = None) -> None:
        self.holder = settings
        self.batch_backlog = batch_backlog
        self.store = store
        self.pool = pool
        self.waits = waits
        self.metrics = metrics
        self.states: dict[str, ScaleState] = {}
        # per pool: (time, targeted load) over autoscale.burst_baseline_s
        self.loads: dict[str, tuple[tuple[float, float], ...]] = {}
        self.capacity: dict[str, _Capacity] = {}
        self.views: dict[str, dict[str, Any]] = {}
        self.computed_at: float | None = None  # unix s of the views

    async def run(self) -> None:
        while True:
            with contextlib.suppress(StoreUnavailable):  # the next tick reads again
                await self.refresh()
            await asyncio.sleep(self.settings.autoscale.interval_s)

    def pools(self) -> dict[str, list[BackendHandle]]:
        """The backends of each pool, by pool name."""
        out: dict[str, list[BackendHandle]] = {}
        for handle in self.pool.handles.values():
            out.setdefault(handle.config.pool_name, []).append(handle)
        return out

    async def refresh(self) -> dict[str, dict[str, Any]]:
        """Read every pool's inputs, decide, publish; the views (``GET /admin/pools``)."""
        now, mono = time.time(), time.monotonic()
        pools = self.pools()
        for handles in pools.values():
            for h in handles:
                self._measure(h)
        queues = {m: await self._queue(m) for m in {h.config.model for hs in pools.values()
                                                   for h in hs}}
        fits = {name: [h.fit.prompt_range for h in hs] for name, hs in pools.items()}
        lines, expires_at = (0, None) if self.batch_backlog is None else await self.batch_backlog()
        queued = sum(q.depths.get(BATCH_CLASS, 0) for q in queues.values())
        batches = _Batches(max(0, lines - queued), queued, expires_at)
        views = {}
        for name, handles in sorted(pools.items()):
            model = handles[0].config.model
            siblings = {p: r for p, r in fits.items() if pools[p][0].config.model == model}
            views[name] = self._pool(name, model, handles, queues[model], siblings, batches,
                                     now, mono)
        for gone in set(self.states) - set(views):
            del self.states[gone]
        for gone in set(self.capacity) - set(self.pool.handles):
            del self.capacity[gone]
        self.views, self.computed_at = views, now
        return views

    def _measure(self, h: BackendHandle) -> None:
        """The backend's service rate now, into its capacity estimate and gauges."""
        rates = h.windows.service.rates(SERVICE) if h.healthy else None
        tokens, requests = rates or (0.0, 0.0)
        self.metrics.pools.service_tokens.labels(h.name).set(tokens)
        self.metrics.pools.service_requests.labels(h.name).set(requests)
        if rates is None:
            return
        cap = self.capacity.setdefault(h.name, _Capacity())
        busy = h.last is not None and h.last.waiting > 0
        if busy:
            if not cap.busy:
                cap.tokens_per_s, cap.requests_per_s, cap.busy = tokens, requests, True
            else:
                cap.tokens_per_s += CAPACITY_ALPHA * (tokens - cap.tokens_per_s)
                cap.requests_per_s += CAPACITY_ALPHA * (requests - cap.requests_per_s)
        elif not cap.busy:
            cap.tokens_per_s = max(cap.tokens_per_s, tokens)
            cap.requests_per_s = max(cap.requests_per_s, requests)

    async def _queue(self, model: str) -> _Queue:
        depths = await self.store.depths(model)
        _, recent = await self.store.class_service(model)
        by_class: dict[str, list[QueuedSample]] = {c: [] for c in CLASS_ORDER}
        queue = _Queue(depths, by_class, recent, dict.fromkeys(CLASS_ORDER, _no_wait))
        if not any(depths.values()):
            return queue  # nothing queued: nothing to sample, no wait
        for s in await self.store.queued_sample(model, self.settings.autoscale.sample_requests):
            by_class[s.klass].append(s)
        for klass in CLASS_ORDER:
            queue.waits[klass] = await self.waits.estimator(model, klass, depths)
        return queue

    def _pool(self, name: str, model: str, handles: list[BackendHandle], queue: _Queue,
              siblings: dict[str, list[Any]], batches: _Batches, now: float, mono: float
              ) -> dict[str, Any]:
        """One pool's view: its measured rates, each class's demand, the decision."""
        ready = [h for h in handles if h.healthy and not h.drained]
        rates = self._rates(handles, ready)
        mix = {c: queue.recent.count(c) / len(queue.recent) if queue.recent else 0.0
               for c in CLASS_ORDER}
        demands, shown, window = [], {}, None
        for klass in CLASS_ORDER:
            demand, shown[klass], left = self._class(name, klass, queue, siblings, batches,
                                                     rates, rates.served * mix[klass], now)
            demands.append(demand)
            if left is not None:
                window = left if window is None else min(window, left)
            self._record(name, klass, shown[klass])
        pool_demand, state = self._decide(name, demands, rates, ready, window, mono)
        return {
            "pool": name, "model": model, "ready_replicas": len(ready),
            "desired_replicas": state.desired,
            "needed_replicas": replicas_needed(pool_demand),
            "class_needs": class_needs(pool_demand),
            "scale_down_pending_since_s": (None if state.below_since is None
                                           else mono - state.below_since),
            "backend_tokens_per_s": rates.mu, "served_tokens_per_s": rates.served,
            "uncached_prompt_share": rates.uncached,
            "output_tokens_per_request": rates.output,
            "batch_window_left_s": window,
            "batch_window_at_risk": any(window_at_risk(pool_demand, d.klass)
                                        for d in demands if d.target_s is None),
            "classes": shown,
            "backends": [self._backend(h) for h in handles],
        }

    def _rates(self, handles: list[BackendHandle], ready: list[BackendHandle]) -> _Rates:
        """What the pool's backends serve now and can serve, and what a request costs."""
        s = self.settings
        served = sum((h.windows.service.rates(SERVICE) or (0.0, 0.0))[0] for h in ready)
        caps = [c.tokens_per_s for h in handles
                if (c := self.capacity.get(h.name)) is not None and c.tokens_per_s > 0]
        hits = [h.prefix_hit_ratio for h in ready if h.prefix_hit_ratio is not None]
        outputs = [o[0] / o[1] for h in ready
                   if (o := h.windows.service.rates(OUTPUT)) and o[1] > 0]
        return _Rates(served, _mean(caps) or s.autoscale.backend_tokens_per_s,
                      1.0 - (_mean(hits) or 0.0),
                      _mean(outputs) or float(s.autoscale.output_tokens))

    def _class(self, name: str, klass: str, queue: _Queue, siblings: dict[str, list[Any]],
               batches: _Batches, rates: _Rates, served: float, now: float
               ) -> tuple[ClassDemand, dict[str, Any], float | None]:
        """A class's demand on the pool (its share of the sampled queue, scaled to its
        depth; batch lines not queued yet), its view, and the earliest time left before a
        deadline that bounds the batch window (None: none). ``served``: the tokens/s the
        pool serves this class now."""
        s = self.settings
        depth = queue.depths.get(klass, 0)
        sample = queue.samples[klass]
        scale = depth / len(sample) if sample else 0.0
        mine = [(r, share) for r in sample
                if (share := _share(r.prompt_tokens, name, siblings)) > 0]
        requests = sum(share for _, share in mine) * scale
        tokens = (sum(r.prompt_tokens * share for r, share in mine) * scale * rates.uncached
                  + requests * rates.output)
        window: float | None = None
        if klass == BATCH_CLASS and requests > 0 and batches.queued > 0:
            # this pool's share of the batch lines not queued yet, at the same size
            extra = batches.unqueued * requests / batches.queued
            tokens, requests = tokens * (1 + extra / requests), requests + extra
            if batches.expires_at is not None:
                window = batches.expires_at - now
        target = class_target_s(s, klass)
        limit_s = s.classes[klass].max_queue_wait_s
        estimate = queue.waits[klass]
        at_risk = 0.0
        for i, (r, share) in enumerate(sorted(mine, key=lambda e: e[0].enqueued_at)):
            deadline = r.deadline_at or r.enqueued_at + limit_s
            wait = estimate(round(i * scale))
            if wait is not None and not fits_deadline(wait, deadline - now):
                at_risk += share * scale
            if target is None:
                left = deadline - now
                window = left if window is None else min(window, left)
        waits = {p: estimate(round(q * depth)) if depth else 0.0
                 for p, q in PERCENTILES.items()}
        shown = {"queued_requests": requests, "queued_demand_tokens": tokens,
                 "served_tokens_per_s": served, "target_s": target,
                 "wait_estimate_s": waits, "at_risk": round(at_risk)}
        return ClassDemand(klass, tokens, requests, served, target), shown, window

    def _decide(self, name: str, demands: list[ClassDemand], rates: _Rates,
                ready: list[BackendHandle], window: float | None, mono: float
                ) -> tuple[PoolDemand, ScaleState]:
        """The pool's demand and its scaling decision (kept, and set on the gauges)."""
        s = self.settings
        demand = PoolDemand(demands, rates.mu, len(ready),
                            sum(h.last.running + h.last.waiting for h in ready
                                if h.last is not None), window,
                            s.autoscale.target_utilization)
        rules = rules_of(s)
        demand, self.loads[name] = with_burst_baseline(demand, rules,
                                                       self.loads.get(name, ()), mono)
        state = self.states[name] = decide(demand, rules,
                                           self.states.get(name, ScaleState(len(ready))),
                                           mono)
        self.metrics.pools.ready.labels(name).set(len(ready))
        self.metrics.pools.desired.labels(name).set(state.desired)
        return demand, state

    def _backend(self, h: BackendHandle) -> dict[str, Any]:
        tokens, requests = h.windows.service.rates(SERVICE) or (0.0, 0.0)
        cap = self.capacity.get(h.name)
        return {"name": h.name, "healthy": h.healthy, "drained": h.drained,
                "service_tokens_per_s": tokens, "service_requests_per_s": requests,
                "capacity_tokens_per_s": None if cap is None else cap.tokens_per_s,
                "capacity_measured_busy": cap is not None and cap.busy}

    def _record(self, pool: str, klass: str, shown: dict[str, Any]) -> None:
        m = self.metrics
        m.pools.demand_tokens.labels(pool, klass).set(shown["queued_demand_tokens"])
        m.pools.queued.labels(pool, klass).set(shown["queued_requests"])
        m.pools.at_risk.labels(pool, klass).set(shown["at_risk"])
        for p, wait in shown["wait_estimate_s"].items():
            m.pools.wait.labels(pool, klass, p).set(float("nan") if wait is None else wait)


def _no_wait(ahead: int) -> float:
    return 0.0


def _share(tokens: int, pool: str, ranges: dict[str, list[Any]]) -> float:
    """The share of a queued request of ``tokens`` estimated prompt tokens that ``pool``
    takes: 1 / the number of the model's pools whose backends take it (0: not this one)."""
    taking = [p for p, rs in ranges.items() if any(r.admits(tokens) for r in rs)]
    return 1.0 / len(taking) if pool in taking else 0.0
