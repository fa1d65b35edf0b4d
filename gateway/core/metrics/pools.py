"""The pools' demand and capacity (``gateway/ops/pools.py``, ``policies/autoscale.py``)
and each backend's measured service rate they are computed from."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from gateway.core.metrics.base import SHARED, Children, MetricGroup


class PoolMetrics(MetricGroup):
    def __init__(self, r: CollectorRegistry, child: Children) -> None:
        super().__init__(child)
        self.demand_tokens = Gauge(
            "fairgate_pool_queued_demand_tokens",
            "Queued demand on a pool (a model and prompt range) by class: estimated "
            "uncached prompt tokens plus expected output tokens", ["pool", "priority_class"],
            registry=r, multiprocess_mode=SHARED)
        self.queued = Gauge(
            "fairgate_pool_queued_requests", "Queued requests a pool's backends take, by "
            "class (estimated from a sample of the queue)", ["pool", "priority_class"],
            registry=r, multiprocess_mode=SHARED)
        self.wait = Gauge(
            "fairgate_pool_wait_estimate_seconds",
            "Estimated queue wait of the pool's queued requests by class, of the request "
            "halfway (p50) and 90 % (p90) down the class's queue (NaN: no rate measured yet)",
            ["pool", "priority_class", "percentile"], registry=r, multiprocess_mode=SHARED)
        self.at_risk = Gauge(
            "fairgate_pool_requests_at_risk",
            "Queued requests whose wait estimate passes their deadline (first-token "
            "deadline, else the class's max_queue_wait_s), by class",
            ["pool", "priority_class"], registry=r, multiprocess_mode=SHARED)
        self.ready = Gauge(
            "fairgate_pool_ready_replicas", "Backends of the pool that take work now",
            ["pool"], registry=r, multiprocess_mode=SHARED)
        self.desired = Gauge(
            "fairgate_pool_desired_replicas",
            "Backends the pool needs for each class's queue-wait target (Little's law on "
            "the measured per-backend rate, with hysteresis and a scale-down delay; "
            "docs/autoscaling.md)", ["pool"], registry=r, multiprocess_mode="livemax")
        self.service_tokens = Gauge(
            "fairgate_backend_service_tokens_per_second",
            "Tokens a backend computed per second (uncached prompt + output), from vLLM's "
            "counters over the last 30 s", ["backend"], registry=r, multiprocess_mode=SHARED)
        self.service_requests = Gauge(
            "fairgate_backend_service_requests_per_second",
            "Requests a backend finished per second, from vLLM's counters over the last "
            "30 s", ["backend"], registry=r, multiprocess_mode=SHARED)
