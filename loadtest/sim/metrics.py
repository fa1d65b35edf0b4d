"""vLLM's Prometheus metrics (names, types, labels and buckets as vLLM 0.32 exports them).

Each server owns a ``CollectorRegistry``; nothing is registered globally. Gauges are
refreshed from the engine at scrape time; histograms and counters are fed by engine
events through the ``EngineObserver`` methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from loadtest.sim.records import RequestRecord

if TYPE_CHECKING:
    from loadtest.sim.engine import SimEngine

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def token_count_buckets(max_model_len: int) -> list[float]:
    """vLLM's 1-2-5 series up to ``max_model_len`` (for the per-request token histograms)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        scale *= 10


class SimMetrics:
    """The metric families, bound to one model name and ``engine="0"``."""

    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry) -> None:
        self.registry = registry
        labels = {"model_name": model_name, "engine": "0"}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=registry).labels(**labels)

        def hist(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=registry).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            (*LABELS, "reason"),
            registry=registry,
        )
        self.waiting_capacity = by_reason.labels(reason="capacity", **labels)
        by_reason.labels(reason="deferred", **labels).set(0)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )  # fmt: skip
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS,
        )  # fmt: skip
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "E2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        token_buckets = token_count_buckets(max_model_len)
        self.req_prompt = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.req_generation = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            token_buckets,
        )  # fmt: skip
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            (*LABELS, "finished_reason"), registry=registry,
        )  # fmt: skip
        self.success = {r: success.labels(finished_reason=r, **labels) for r in FINISH_REASONS}

    def token(self, record: RequestRecord, emit_s: float, prev_emit_s: float | None) -> None:
        """A token was emitted."""
        self.generation_tokens.inc()
        if prev_emit_s is None:
            self.ttft.observe(emit_s - record.arrival_s)
            self.prompt_tokens.inc(record.prompt_tokens)
        else:
            self.itl.observe(emit_s - prev_emit_s)

    def finished(self, record: RequestRecord) -> None:
        """A request finished or was aborted."""
        self.success[record.finish_reason or "error"].inc()
        if record.aborted or record.finished_s is None:
            return
        self.e2e.observe(record.finished_s - record.arrival_s)
        if record.first_scheduled_s is not None:
            self.queue.observe(record.first_scheduled_s - record.arrival_s)
        self.req_prompt.observe(record.prompt_tokens)
        self.req_generation.observe(record.output_tokens)
        if record.output_tokens > 1 and record.first_token_s is not None:
            decode_s = record.finished_s - record.first_token_s
            self.tpot.observe(decode_s / (record.output_tokens - 1))

    def preempted(self, record: RequestRecord) -> None:
        """A running request was preempted."""
        self.preemptions.inc()

    def render(self, engine: SimEngine) -> bytes:
        """Refresh the gauges from ``engine`` and return the Prometheus text format."""
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.waiting_capacity.set(engine.num_waiting)
        self.kv_usage.set(engine.kv_usage)
        return generate_latest(self.registry)
