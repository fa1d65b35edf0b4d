"""The Batch API (``/v1/batches``, ``gateway/batch/runner.py``): job counts by status and
per-line outcomes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.core.metrics.base import SHARED, Children, MetricGroup


class BatchMetrics(MetricGroup):
    def __init__(self, r: CollectorRegistry, child: Children) -> None:
        super().__init__(child)
        self.jobs = Gauge(
            "fairgate_batch_jobs", "Batch jobs by status", ["status"], registry=r,
            multiprocess_mode=SHARED)
        self.requests = Counter(
            "fairgate_batch_requests_total", "Batch lines finished, by outcome", ["outcome"],
            registry=r)
