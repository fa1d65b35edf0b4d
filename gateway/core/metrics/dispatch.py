"""Dispatches: to which backend, at what rank and why (``gateway/scheduling/
dispatcher.py``, ``admission.py``), the prefix index's predicted hits, those granted
locally while Redis was unreachable, and this replica's recent dispatch rate and
predictions (the read model's backend rows)."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.core.metrics.base import Children, MetricGroup
from gateway.core.metrics.usage import UsageMetrics

RANK_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50, 100, 500)
DISPATCH_RATE_WINDOW_S = 10.0


class DispatchMetrics(MetricGroup):
    def __init__(self, r: CollectorRegistry, child: Children, usage: UsageMetrics) -> None:
        super().__init__(child)
        self.usage = usage
        self.recent: dict[str, deque[float]] = {}
        # per backend: (time, hit blocks, query blocks) of this replica's recent dispatches
        self.recent_predictions: dict[str, deque[tuple[float, int, int]]] = {}
        self.decision_counts: dict[str, dict[str, int]] = {}  # backend → reason → count
        self.dispatches = Counter(
            "fairgate_dispatches_total", "Requests dispatched to a backend",
            ["model", "backend", "priority_class"], registry=r)
        self.rank = Histogram(
            "fairgate_dispatch_priority_rank",
            "vLLM priority of dispatched requests minus the class base (user's in-flight rank)",
            ["priority_class"], buckets=RANK_BUCKETS, registry=r)
        self.decisions = Counter(
            "fairgate_dispatch_decisions_total",
            "Dispatches by why the request went to the backend: cache_hit (its prefix index "
            "held the prompt's first blocks), load (placed by load: least_loaded routing, or "
            "the backend holding its prefix was too busy), fairness_order (locality, nothing "
            "cached anywhere: the fairness order's next)", ["model", "backend", "reason"],
            registry=r)
        self.stale_view = Counter(
            "fairgate_dispatch_stale_view_total",
            "Dispatch decisions that admitted nothing because the deciding process's gates "
            "came from a snapshot older than the one before the backend's stored one (the "
            "process is behind the backend's snapshots; its next snapshot decides again)",
            ["model", "backend"], registry=r)
        self.predicted_blocks = Counter(
            "fairgate_prefix_predicted_blocks_total",
            "Prompt blocks (policies/locality.py chain) dispatched to a backend (kind=query) "
            "and those its prefix index held at dispatch (kind=hit): the predicted hit rate",
            ["backend", "kind"], registry=r)
        self.local = Counter(
            "fairgate_local_dispatches_total",
            "Requests this replica granted on its own while Redis was unreachable "
            "(store_outage: local)", ["model", "backend", "priority_class"], registry=r)
        self.serving_locally = Gauge(
            "fairgate_serving_locally",
            "1 while this replica serves from its own queues because Redis is unreachable "
            "(store_outage: local)", registry=r, multiprocess_mode="livemax")

    def on_dispatch(self, model: str, backend: str, klass: str, user: str, rank: int) -> None:
        self.child(self.rank, klass).observe(rank)
        recent = self.recent.get(backend)
        if recent is None:  # not built per dispatch just to be thrown away
            recent = self.recent[backend] = deque(maxlen=100_000)
        recent.append(time.monotonic())
        self.usage.on_dispatched(model, user)

    def on_decision(self, model: str, backend: str, reason: str,
                    matched_blocks: int, prompt_blocks: int) -> None:
        """Why a request went to ``backend`` and how much of its prompt the backend's
        prefix index held (``routing: locality``; blocks of ``policies/locality.py``)."""
        self.child(self.decisions, model, backend, reason).inc()
        counts = self.decision_counts.setdefault(backend, {})
        counts[reason] = counts.get(reason, 0) + 1
        if prompt_blocks > 0:
            self.predicted_blocks.labels(backend, "query").inc(prompt_blocks)
            self.predicted_blocks.labels(backend, "hit").inc(matched_blocks)
            recent = self.recent_predictions.setdefault(backend, deque(maxlen=100_000))
            recent.append((time.monotonic(), matched_blocks, prompt_blocks))

    def predicted_hit_ratio(self, backend: str, window_s: float) -> float | None:
        """The share of the prompt blocks dispatched to ``backend`` in the last
        ``window_s`` that its prefix index held (this replica's dispatches; None: none)."""
        recent = self.recent_predictions.get(backend)
        cutoff = time.monotonic() - window_s
        while recent and recent[0][0] < cutoff:
            recent.popleft()
        queried = sum(q for _, _, q in recent) if recent else 0
        return sum(h for _, h, _ in recent) / queried if recent and queried else None

    def rate(self, backend: str) -> float:
        """Dispatches per second to ``backend`` over the last few seconds (this replica)."""
        recent = self.recent.get(backend)
        if not recent:
            return 0.0
        cutoff = time.monotonic() - DISPATCH_RATE_WINDOW_S
        while recent and recent[0] < cutoff:
            recent.popleft()
        return len(recent) / DISPATCH_RATE_WINDOW_S

    def forget_backend(self, backend: str) -> int:
        for per_backend in (self.recent, self.recent_predictions, self.decision_counts):
            per_backend.pop(backend, None)
        return super().forget_backend(backend)
