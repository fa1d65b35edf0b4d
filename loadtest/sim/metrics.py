"""vLLM's Prometheus metrics (names, types, labels and buckets as vLLM 0.32 exports them).

Each server owns a ``CollectorRegistry``; nothing is registered globally. Gauges are
refreshed from the engine at scrape time; histograms and counters are fed by engine
events through the ``EngineObserver`` methods. Like vLLM, a request aborted by its client
counts in no per-request histogram and not in ``request_success`` (its prompt and
generated tokens do count). The prefix cache's families count as vLLM's do: queries and
hits (tokens) at a request's first admission, cached and computed prompt tokens at its
first token. Families vLLM exports that the simulator does not model (KV connector and
multimodal caches, MFU estimates, admission caps, cache config info) are absent;
``loadtest/sim/conformance.py`` lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

from loadtest.sim.exposition import Exposition
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
ITERATION_TOKEN_BUCKETS = (
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
)  # fmt: skip
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
PREEMPTION_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_SOURCES = ("device", "host", "disk", "p2p", "external_unspecified")
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

    def __init__(
        self, model_name: str, max_model_len: int, registry: CollectorRegistry,
        max_lora: int | None = None, only: frozenset[str] | None = None,
    ) -> None:
        self.registry = registry
        self.exposition = Exposition()
        # ``only``: the sample names /metrics shows (None: all); the rest is still counted
        self.shown: Collector = registry if only is None else registry.restricted_registry(only)
        # vLLM's LoRA info gauge (only with --enable-lora): no model_name or engine label;
        # each (max_lora, waiting, running) combination is its own series, set to the time
        # it was last seen, and old combinations stay: the newest value is the current one
        self.max_lora = max_lora
        self.lora_info = None if max_lora is None else Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ("max_lora", "waiting_lora_adapters", "running_lora_adapters"), registry=registry,
        )  # fmt: skip
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
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.decode = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.req_preemptions = hist(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.", PREEMPTION_BUCKETS,
        )  # fmt: skip
        self.req_kv_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )  # fmt: skip
        self.req_max_generation = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", token_buckets,
        )  # fmt: skip
        self.params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self.params_max_tokens = hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            token_buckets,
        )  # fmt: skip
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            ITERATION_TOKEN_BUCKETS,
        )  # fmt: skip
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.", (*LABELS, "sleep_state"), registry=registry,
        )  # fmt: skip
        for state in SLEEP_STATES:
            sleep.labels(sleep_state=state, **labels).set(1 if state == "awake" else 0)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.", (*LABELS, "source"), registry=registry,
        )  # fmt: skip
        self.prompt_computed = by_source.labels(source="local_compute", **labels)
        self.prompt_local_hit = by_source.labels(source="local_cache_hit", **labels)
        by_source.labels(source="external_kv_transfer", **labels)
        cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            (*LABELS, "source"), registry=registry,
        )  # fmt: skip
        self.cached_device = cached_by_source.labels(source="device", **labels)
        for source in CACHE_SOURCES[1:]:
            cached_by_source.labels(source=source, **labels)
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            (*LABELS, "finished_reason"), registry=registry,
        )  # fmt: skip
        self.success = {r: success.labels(finished_reason=r, **labels) for r in FINISH_REASONS}

    def token(self, record: RequestRecord, emit_s: float, prev_emit_s: float | None) -> None:
        """A token was emitted (for a pooling request: its prompt was computed)."""
        if not record.pooling:
            self.generation_tokens.inc()
        if prev_emit_s is None:
            self.ttft.observe(emit_s - record.arrival_s)
            self.prompt_tokens.inc(record.prompt_tokens)
            self.prompt_cached.inc(record.cached_tokens)
            self.prompt_local_hit.inc(record.cached_tokens)
            self.prompt_computed.inc(record.prompt_tokens - record.cached_tokens)
        else:
            self.itl.observe(emit_s - prev_emit_s)

    def finished(self, record: RequestRecord) -> None:
        """A request finished or was aborted (an abort counts nowhere, as in vLLM)."""
        if record.aborted or record.finished_s is None:
            return
        self.success[record.finish_reason or "error"].inc()
        self.e2e.observe(record.finished_s - record.arrival_s)
        if record.first_scheduled_s is not None:
            self.queue.observe(record.first_scheduled_s - record.arrival_s)
            self.inference.observe(record.finished_s - record.first_scheduled_s)
            if record.first_token_s is not None:
                self.prefill.observe(record.first_token_s - record.first_scheduled_s)
        if record.first_token_s is not None:
            self.decode.observe(record.finished_s - record.first_token_s)
        self.req_prompt.observe(record.prompt_tokens)
        self.req_generation.observe(0 if record.pooling else record.output_tokens)
        self.req_kv_computed.observe(record.prompt_tokens - record.cached_tokens)
        self.req_preemptions.observe(record.num_preemptions)
        if record.pooling:  # no sampling parameters
            return
        self.req_max_generation.observe(record.max_tokens)
        self.params_max_tokens.observe(record.max_tokens)
        self.params_n.observe(record.n)
        if record.output_tokens > 1 and record.first_token_s is not None:
            decode_s = record.finished_s - record.first_token_s
            self.tpot.observe(decode_s / (record.output_tokens - 1))

    def step(self, batch_tokens: int) -> None:
        """An engine step computed ``batch_tokens`` tokens."""
        self.iteration_tokens.observe(batch_tokens)

    def prefix_cache(self, queries: int, hits: int) -> None:
        """Requests admitted for the first time looked up ``queries`` prompt tokens in the
        prefix cache and found ``hits`` of them."""
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)
        self.cached_device.inc(hits)

    def preempted(self, record: RequestRecord) -> None:
        """A running request was preempted."""
        self.preemptions.inc()

    def render(self, engine: SimEngine) -> bytes:
        """Refresh the gauges from ``engine`` and return the Prometheus text format."""
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.waiting_capacity.set(engine.num_waiting)
        self.kv_usage.set(engine.kv_usage)
        if self.lora_info is not None:
            # vLLM lists every adapter with a live request in both labels (its per-adapter
            # counts are not shown): LoRARequestStates.update_scheduler_stats
            adapters = ",".join(engine.lora_activity())
            self.lora_info.labels(
                max_lora=str(self.max_lora), waiting_lora_adapters=adapters,
                running_lora_adapters=adapters,
            ).set_to_current_time()  # fmt: skip
        return self.exposition.render(self.shown)
