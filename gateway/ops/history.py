"""The dashboard's last 15 minutes: one picture for every worker and replica, kept in Redis.

Owned by the read model (``gateway/ops/read_model.py`` builds it; ``gateway/services.py``
runs :meth:`History.run` supervised as the ``history`` loop). Time is cut into wall-clock
intervals of ``interval_s`` (5 s); at the end of each, every process adds what it counted
in it to that interval's hash in Redis (``ReadStore.add_history``, ``lua/history.lua``: sums
added, maxima kept), so every process draws the same history and a page load shows the
same charts whichever worker answers it. A restart of a process loses nothing but its
current interval; the hashes expire after the window (900 s). Per interval:

- queue depth per (model, class): read from Redis at its end (the same for everyone);
- dispatches per second per model: every process's dispatches (``fairgate_dispatches
  _total``) added up;
- TTFT as clients saw it (streams, all classes): every first token's time from arrival,
  counted in fine logarithmic buckets (5 % wide, so a quantile reads at most 5 % high and
  never above the slowest one seen, which is kept too); p50 and p99 of all processes' counts;
- gates closed, % of the time, per backend (all classes): sampled every ``tick_s`` (1 s)
  exactly as the dashboard's gate badges decide (the snapshot's gate once the requests in
  transit count against it, ``policies/gates.Gate.after``), by the process that scrapes
  the backend (its lease holder), as class-seconds closed over class-seconds observed.

The same loop adds, every ``tick_s``, the service this replica served to the
cross-replica service shares in Redis, with the tenant and weights of the users it
queued requests for (``ShareStore.add_service``; the read model also does before it reads
them), batched so the request path makes no extra Redis call.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.backends.scrape import BackendPool
from gateway.core.errors import StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.core.user_series import MAX_SHARE_USERS, SHARE_HALF_LIFE_S
from gateway.storage.records import Who
from gateway.storage.store import Store
from policies.classes import CLASS_ORDER

log = structlog.get_logger("fairgate.history")

INTERVAL_S = 5.0
WINDOW_S = 900.0
TICK_S = 1.0
SHARE_TTL_S = 3600.0  # the shares of a model nobody used for an hour are forgotten
QUANTILES = {"ttft_p50_s": 0.5, "ttft_p99_s": 0.99}
TTFT_FLOOR_S = 0.001  # the first fine bucket holds every TTFT up to 1 ms
TTFT_RATIO = 1.05  # each fine bucket's upper bound is 5 % above the previous one's


def ttft_bucket(seconds: float) -> int:
    """The fine bucket of a TTFT: bucket ``i`` holds (floor·ratio^(i-1), floor·ratio^i]."""
    if seconds <= TTFT_FLOOR_S:
        return 0
    return math.ceil(math.log(seconds / TTFT_FLOOR_S) / math.log(TTFT_RATIO) - 1e-9)


def ttft_bound(bucket: int) -> float:
    return TTFT_FLOOR_S * TTFT_RATIO ** bucket


def fine_quantile(q: float, counts: dict[int, float], largest: float | None) -> float | None:
    """The ``q`` quantile of fine-bucket counts: the upper bound of the bucket that holds
    it, never above ``largest`` (the slowest TTFT seen)."""
    total = sum(counts.values())
    if total <= 0:
        return None
    rank, seen = q * total, 0.0
    for bucket in sorted(counts):
        seen += counts[bucket]
        if seen >= rank:
            bound = ttft_bound(bucket)
            return bound if largest is None else min(bound, largest)
    return largest


@dataclass(slots=True)
class _Interval:
    """What this process counted since its interval began."""

    dispatches: dict[str, float] = field(default_factory=dict)  # model -> total at start
    closed: dict[str, float] = field(default_factory=dict)  # backend -> class-seconds closed
    observed: dict[str, float] = field(default_factory=dict)  # backend -> class-seconds seen


def _dispatch_totals(metrics: GatewayMetrics) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in metrics.dispatch.dispatches.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                out[s.labels["model"]] = out.get(s.labels["model"], 0.0) + s.value
    return out


class History(ReadsSettings):
    def __init__(self, settings: SettingsHolder, store: Store, metrics: GatewayMetrics,
                 pool: BackendPool, interval_s: float = INTERVAL_S,
                 window_s: float = WINDOW_S, tick_s: float = TICK_S) -> None:
        self.holder = settings
        self.store = store
        self.metrics = metrics
        self.pool = pool
        self.interval_s = interval_s  # read at every tick: a test may shorten it
        self.window_s = window_s
        self.tick_s = tick_s
        self._start = self._interval_start(time.time())
        self._counts = _Interval(_dispatch_totals(metrics))
        self._ticked: float | None = None  # monotonic s of the last gate sample

    def _interval_start(self, now: float) -> float:
        return math.floor(now / self.interval_s) * self.interval_s

    async def run(self) -> None:
        """Forever: add pending service to Redis and sample the gates every tick; add this
        process's counts to the shared history at the end of each interval."""
        while True:
            await self.flush_service()
            await self.sample_gates()
            if time.time() >= self._start + self.interval_s:
                await self.sample()
            due = self._start + self.interval_s - time.time()
            await asyncio.sleep(max(0.0, min(self.tick_s, due)))

    async def flush_service(self) -> None:
        """Move this replica's pending service, and who its queued users are, into the
        shares every replica reads."""
        pending, self.metrics.usage.pending_service = self.metrics.usage.pending_service, {}
        queued, self.metrics.usage.pending_who = self.metrics.usage.pending_who, {}
        for model in pending.keys() | queued.keys():
            amounts, who = pending.get(model, {}), queued.get(model, {})
            if not amounts and not who:
                continue
            try:
                await self.store.shares.add_service(model, amounts, time.time(), SHARE_HALF_LIFE_S,
                                             MAX_SHARE_USERS, SHARE_TTL_S,
                                             {user: Who(*entry) for user, entry in who.items()})
            except StoreUnavailable as exc:  # kept for the next tick, still bounded
                log.warning("service_shares_deferred", model=model, error=str(exc))
                kept = self.metrics.usage.pending_service.setdefault(model, {})
                for user, amount in amounts.items():
                    if user in kept or len(kept) < MAX_SHARE_USERS:
                        kept[user] = kept.get(user, 0.0) + amount
                kept_who = self.metrics.usage.pending_who.setdefault(model, {})
                for user, entry in who.items():
                    if user in kept_who or len(kept_who) < MAX_SHARE_USERS:
                        kept_who.setdefault(user, entry)

    async def sample_gates(self) -> None:
        """Charge the time since the last tick to the gates of the backends this process
        scrapes, each as its badge shows it now (``Inspector.backends``)."""
        now, mono = time.time(), time.monotonic()
        elapsed = 0.0 if self._ticked is None else min(mono - self._ticked, 3 * self.tick_s)
        self._ticked = mono
        if elapsed <= 0:
            return
        for model in self.settings.models():
            held = [h for h in self.pool.for_model(model) if h.lease.held]
            if not held:
                continue
            try:
                states = await self.store.fleet.backend_states(model, [h.name for h in held])
            except StoreUnavailable:
                return
            for handle in held:
                gates = handle.badge_gates(states[handle.name], now,
                                           self.settings.snapshot_stale_s)
                closed = sum(1 for g in gates.values() if not g.open)
                c = self._counts
                c.closed[handle.name] = c.closed.get(handle.name, 0.0) + closed * elapsed
                c.observed[handle.name] = (c.observed.get(handle.name, 0.0)
                                           + len(gates) * elapsed)

    async def sample(self) -> dict[str, float]:
        """Add this process's counts for the interval that just ended to the shared
        history, and begin the next one. Returns the fields added (sums and maxima)."""
        now = time.time()
        start, self._start = self._start, self._interval_start(now)
        counts = self._counts
        totals = _dispatch_totals(self.metrics)
        self._counts = _Interval(totals)
        ttfts, self.metrics.edge.recent_ttft = self.metrics.edge.recent_ttft, []
        sums: dict[str, float] = {"n": 1.0}
        maxima: dict[str, float] = {}
        for model in self.settings.models():
            sums[f"d:{model}"] = totals.get(model, 0.0) - counts.dispatches.get(model, 0.0)
            try:
                depth = await self.store.reads.depths(model)
            except StoreUnavailable:
                continue
            for klass, queued in depth.items():
                maxima[f"q:{model}:{klass}"] = float(queued)
        for seconds in ttfts:
            field_name = f"t:{ttft_bucket(seconds)}"
            sums[field_name] = sums.get(field_name, 0.0) + 1.0
        if ttfts:
            maxima["tmax"] = max(ttfts)
        for backend, seen in counts.observed.items():
            sums[f"go:{backend}"] = seen
            sums[f"gc:{backend}"] = counts.closed.get(backend, 0.0)
        try:
            await self.store.reads.add_history(round(start * 1000), sums, maxima,
                                         self.window_s + self.interval_s)
        except StoreUnavailable as exc:  # this interval is missing from the charts
            log.warning("history_sample_lost", error=str(exc))
        return {**sums, **maxima}

    async def view(self) -> dict[str, Any]:
        """What ``GET /admin/state`` shows under ``history``: every process's intervals
        of the window, each as one sample (``t``: its end)."""
        since = self._interval_start(time.time()) - self.window_s
        samples = []
        for start_ms, fields in await self.store.reads.history(round(since * 1000)):
            samples.append(_sample(start_ms / 1000, self.interval_s, fields,
                                   self.settings.models()))
        return {"interval_s": self.interval_s, "window_s": self.window_s,
                "scope": "all workers and replicas", "samples": samples}


def _sample(start: float, interval_s: float, fields: dict[str, float],
            models: list[str]) -> dict[str, Any]:
    """One interval's shared fields as the dashboard draws them."""
    ttft = {int(f[2:]): v for f, v in fields.items() if f.startswith("t:")}
    largest = fields.get("tmax")
    gates: dict[str, float] = {}
    for f, seen in fields.items():
        if f.startswith("go:") and seen > 0:
            backend = f[3:]
            gates[backend] = 100.0 * fields.get(f"gc:{backend}", 0.0) / seen
    return {
        "t": start + interval_s, "interval_s": interval_s,
        "processes": int(fields.get("n", 0)),
        "ttft_count": int(sum(ttft.values())), "ttft_max_s": largest,
        **{name: fine_quantile(q, ttft, largest) for name, q in QUANTILES.items()},
        "models": {m: {"depth": ({c: int(fields[f"q:{m}:{c}"]) for c in CLASS_ORDER}
                                 if f"q:{m}:{CLASS_ORDER[0]}" in fields else None),
                       "dispatch_rate_per_s": fields.get(f"d:{m}", 0.0) / interval_s}
                   for m in models},
        "gate_closed_pct": gates,
    }
