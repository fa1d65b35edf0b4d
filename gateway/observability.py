"""The gateway's own Prometheus metrics (``fairgate_*``), on a registry passed in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "fairgate_queue_depth", "Requests queued in Redis", ["model", "priority_class"],
            registry=r)
        self.queue_wait = Histogram(
            "fairgate_queue_wait_seconds", "Time from enqueue to dispatch", ["priority_class"],
            buckets=WAIT_BUCKETS, registry=r)
        self.dispatches = Counter(
            "fairgate_dispatches_total", "Requests dispatched to a backend",
            ["model", "backend", "priority_class"], registry=r)
        self.gate_closed = Counter(
            "fairgate_gate_closed_total",
            "Backend snapshots that closed a class's gate, by reason",
            ["backend", "priority_class", "reason"], registry=r)
        self.backend_waiting = Gauge(
            "fairgate_backend_waiting_requests", "vllm:num_requests_waiting at last scrape",
            ["backend"], registry=r)
        self.backend_running = Gauge(
            "fairgate_backend_running_requests", "vllm:num_requests_running at last scrape",
            ["backend"], registry=r)
        self.backend_kv = Gauge(
            "fairgate_backend_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc at last scrape",
            ["backend"], registry=r)
        self.backend_tpot = Gauge(
            "fairgate_backend_tpot_seconds", "Recent mean time per output token", ["backend"],
            registry=r)
        self.backend_healthy = Gauge(
            "fairgate_backend_healthy", "1 when the last scrapes succeeded", ["backend"],
            registry=r)
        self.requests = Counter(
            "fairgate_requests_total", "Finished client requests by status",
            ["model", "priority_class", "status"], registry=r)
        self.tokens = Counter(
            "fairgate_tokens_total", "Tokens served, by kind", ["model", "kind"], registry=r)
