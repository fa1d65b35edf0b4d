"""The dashboard's last 15 minutes: a bounded ring buffer of samples, fed by one loop.

Owned by the read model (``gateway/ops/read_model.py`` builds it; ``gateway/services.py``
runs :meth:`History.run` supervised as the ``history`` loop). One sample every
``interval_s`` (5 s) into a ring of ``window_s / interval_s`` (180) samples, in this
replica's memory (a restart starts empty; each replica keeps its own):

- queue depth per (model, class): read from Redis, so every replica sees the same;
- dispatches per second per model: this replica's, from the deltas of
  ``fairgate_dispatches_total`` over the interval;
- TTFT p50 and p99 as clients see them (streams, all classes), per interval: the deltas
  of the ``fairgate_time_to_first_token_seconds`` bucket counts between two samples, the
  quantile interpolated linearly inside its bucket as PromQL's ``histogram_quantile``
  does. Chosen over a window of raw observations: no extra hook or memory on the request
  path, and it agrees with what Grafana shows from the same histogram; the price is
  bucket resolution (a p99 in the 1–2 s bucket reads somewhere in it). ``None`` when no
  stream got its first token in the interval; above the last finite bucket it reads as
  that bucket's bound (600 s);
- gate-closed seconds per (backend, class) in the interval (all reasons), from the
  deltas of ``fairgate_gate_closed_seconds_total``.

The same loop adds, every ``tick_s`` (1 s), the service this replica served to the
cross-replica service shares in Redis, with the tenant and weights of the users it
queued requests for (``Store.add_service``; the read model also does before it reads
them), batched so the request path makes no extra Redis call.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.core.errors import StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.core.user_series import MAX_SHARE_USERS, SHARE_HALF_LIFE_S
from gateway.storage.store import Store, Who
from policies.classes import CLASS_ORDER

log = structlog.get_logger("fairgate.history")

INTERVAL_S = 5.0
WINDOW_S = 900.0
TICK_S = 1.0
SHARE_TTL_S = 3600.0  # the shares of a model nobody used for an hour are forgotten
QUANTILES = {"ttft_p50_s": 0.5, "ttft_p99_s": 0.99}


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of cumulative ``(upper bound, count)`` buckets, ascending and
    ending with +Inf; linear inside the bucket (``histogram_quantile``'s rule)."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count <= below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


@dataclass(slots=True)
class _Totals:
    """Counter and bucket totals of this replica at one moment."""
    at: float
    dispatches: dict[str, float] = field(default_factory=dict)  # model -> total
    ttft: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative
    gate_closed: dict[tuple[str, str], float] = field(default_factory=dict)


def _totals(metrics: GatewayMetrics) -> _Totals:
    out = _Totals(time.monotonic())
    for family in metrics.dispatches.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                model = s.labels["model"]
                out.dispatches[model] = out.dispatches.get(model, 0.0) + s.value
    for family in metrics.ttft.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                out.ttft[le] = out.ttft.get(le, 0.0) + s.value
    for family in metrics.gate_closed_time.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                key = (s.labels["backend"], s.labels["priority_class"])
                out.gate_closed[key] = out.gate_closed.get(key, 0.0) + s.value
    return out


class History(ReadsSettings):
    def __init__(self, settings: SettingsHolder, store: Store, metrics: GatewayMetrics,
                 interval_s: float = INTERVAL_S, window_s: float = WINDOW_S,
                 tick_s: float = TICK_S) -> None:
        self.holder = settings
        self.store = store
        self.metrics = metrics
        self.interval_s = interval_s  # read at every tick: a test may shorten it
        self.window_s = window_s
        self.tick_s = tick_s
        self.samples: deque[dict[str, Any]] = deque(maxlen=max(1, int(window_s // interval_s)))
        self._previous = _totals(metrics)

    async def run(self) -> None:
        """Forever: add pending service to Redis every tick, take a sample when due."""
        while True:
            await self.flush_service()
            if time.monotonic() >= self._previous.at + self.interval_s:
                await self.sample()
            due = self._previous.at + self.interval_s - time.monotonic()
            await asyncio.sleep(max(0.0, min(self.tick_s, due)))

    async def flush_service(self) -> None:
        """Move this replica's pending service, and who its queued users are, into the
        shares every replica reads."""
        pending, self.metrics.pending_service = self.metrics.pending_service, {}
        queued, self.metrics.pending_who = self.metrics.pending_who, {}
        for model in pending.keys() | queued.keys():
            amounts, who = pending.get(model, {}), queued.get(model, {})
            if not amounts and not who:
                continue
            try:
                await self.store.add_service(model, amounts, time.time(), SHARE_HALF_LIFE_S,
                                             MAX_SHARE_USERS, SHARE_TTL_S,
                                             {user: Who(*entry) for user, entry in who.items()})
            except StoreUnavailable as exc:  # kept for the next tick, still bounded
                log.warning("service_shares_deferred", model=model, error=str(exc))
                kept = self.metrics.pending_service.setdefault(model, {})
                for user, amount in amounts.items():
                    if user in kept or len(kept) < MAX_SHARE_USERS:
                        kept[user] = kept.get(user, 0.0) + amount
                kept_who = self.metrics.pending_who.setdefault(model, {})
                for user, entry in who.items():
                    if user in kept_who or len(kept_who) < MAX_SHARE_USERS:
                        kept_who.setdefault(user, entry)

    async def sample(self) -> dict[str, Any]:
        """Take one sample (deltas since the previous one) and append it to the ring."""
        now = _totals(self.metrics)
        before, self._previous = self._previous, now
        dt = max(now.at - before.at, 1e-9)
        models: dict[str, Any] = {}
        for model in self.settings.models():
            try:
                depth: dict[str, int] | None = await self.store.depths(model)
            except StoreUnavailable:
                depth = None
            rate = (now.dispatches.get(model, 0.0) - before.dispatches.get(model, 0.0)) / dt
            models[model] = {"depth": depth, "dispatch_rate_per_s": rate}
        buckets = sorted((le, count - before.ttft.get(le, 0.0))
                         for le, count in now.ttft.items())
        closed: dict[str, dict[str, float]] = {}
        for (backend, klass), seconds in now.gate_closed.items():
            delta = seconds - before.gate_closed.get((backend, klass), 0.0)
            closed.setdefault(backend, dict.fromkeys(CLASS_ORDER, 0.0))[klass] = delta
        sample: dict[str, Any] = {
            "t": time.time(), "interval_s": dt,
            "ttft_count": int(buckets[-1][1]) if buckets else 0,
            **{name: bucket_quantile(q, buckets) for name, q in QUANTILES.items()},
            "models": models, "gate_closed_s": closed,
        }
        self.samples.append(sample)
        return sample

    def view(self) -> dict[str, Any]:
        """What ``GET /admin/state`` shows under ``history``."""
        return {"interval_s": self.interval_s, "window_s": self.window_s,
                "samples": list(self.samples)}
