"""What each backend's latest snapshot says (``gateway/backends/``): its queue, batch,
KV cache, TPOT and prefix hits, health, lease, drain, and requests that waited for its
first scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.core.metrics.base import SHARED, Children, MetricGroup


class BackendMetrics(MetricGroup):
    def __init__(self, r: CollectorRegistry, child: Children) -> None:
        super().__init__(child)
        self.waiting = Gauge(
            "fairgate_backend_waiting_requests", "vllm:num_requests_waiting at last scrape",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.waiting_queued = Gauge(
            "fairgate_backend_waiting_queued_requests",
            "Of vllm:num_requests_waiting at last scrape, those beyond the batch's free slots "
            "(the most seen running less those running): they wait for a running request to "
            "finish. The rest entered a free slot and start at the next engine step",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.running = Gauge(
            "fairgate_backend_running_requests", "vllm:num_requests_running at last scrape",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.kv = Gauge(
            "fairgate_backend_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc at last scrape",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.tpot = Gauge(
            "fairgate_backend_tpot_seconds", "Recent mean time per output token", ["backend"],
            registry=r, multiprocess_mode=SHARED)
        self.prefix_hit_ratio = Gauge(
            "fairgate_backend_prefix_cache_hit_ratio",
            "vLLM's recent prefix cache hit rate: Δvllm:prefix_cache_hits_total / "
            "Δvllm:prefix_cache_queries_total (tokens) over the TPOT window; NaN: no queries",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.pending_prefill = Gauge(
            "fairgate_backend_pending_prefill_tokens",
            "Estimated uncached prompt tokens dispatched to a backend and maybe not yet "
            "scheduled there, by the latest snapshot (the prefill-token gate's count)",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.healthy = Gauge(
            "fairgate_backend_healthy", "1 when the last scrapes succeeded", ["backend"],
            registry=r, multiprocess_mode=SHARED)
        self.scraping = Gauge(
            "fairgate_backend_scraping",
            "1 while this process holds the backend's scrape lease (scrapes it for all)",
            ["backend"], registry=r, multiprocess_mode="livesum")
        self.drained = Gauge(
            "fairgate_backend_drained", "1 when an operator drained the backend (this replica)",
            ["backend"], registry=r, multiprocess_mode=SHARED)
        self.first_scrape_waits = Counter(
            "fairgate_first_scrape_waits_total",
            "Requests that found no healthy backend of their model before its backends' "
            "first scrape and waited for it (first_scrape_wait_s)", ["model"], registry=r)
