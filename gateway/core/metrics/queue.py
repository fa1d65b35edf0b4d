"""The fair queue in Redis: depth and oldest wait (read by ``gateway/ops/read_model.py``
at each scrape of ``/metrics``) and each request's wait for its dispatch
(``gateway/scheduling/admission.py``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram

from gateway.core.metrics.base import SHARED, WAIT_BUCKETS, Children, MetricGroup


class QueueMetrics(MetricGroup):
    def __init__(self, r: CollectorRegistry, child: Children) -> None:
        super().__init__(child)
        self.depth = Gauge(
            "fairgate_queue_depth", "Requests queued in Redis", ["model", "priority_class"],
            registry=r, multiprocess_mode=SHARED)
        self.oldest_wait = Gauge(
            "fairgate_queue_oldest_wait_seconds", "Age of the oldest queued request",
            ["model", "priority_class"], registry=r, multiprocess_mode=SHARED)
        self.wait = Histogram(
            "fairgate_queue_wait_seconds", "Time from enqueue to dispatch", ["priority_class"],
            buckets=WAIT_BUCKETS, registry=r)
