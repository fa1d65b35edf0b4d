"""What the client saw: finished requests and error answers, tokens served, and a
stream's latencies as the client received them (``gateway/core/edge.py``,
``gateway/http/routes.py``, ``gateway/scheduling/admission.py``)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.core.metrics.base import TPOT_BUCKETS, TTFT_BUCKETS, Children, MetricGroup
from gateway.core.metrics.usage import UsageMetrics

MAX_RECENT_TTFT = 100_000  # first-token times kept for the history's next interval


class StreamTiming:
    """Monotonic timestamps of one streamed answer, as the client received it."""

    __slots__ = ("arrived_s", "end_s", "first_token_s", "last_token_s")

    def __init__(self, arrived_s: float) -> None:
        self.arrived_s = arrived_s
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.end_s = arrived_s

    def token_frames_sent(self) -> None:
        now = time.monotonic()
        if self.first_token_s is None:
            self.first_token_s = now
        self.last_token_s = now


class EdgeMetrics(MetricGroup):
    def __init__(self, r: CollectorRegistry, child: Children, usage: UsageMetrics) -> None:
        super().__init__(child)
        self.usage = usage
        # streams' times to first token (s) since the history's last interval ended
        self.recent_ttft: list[float] = []
        self.ttft = Histogram(
            "fairgate_time_to_first_token_seconds",
            "Streams: from request arrival to the first token frame sent to the client",
            ["priority_class"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(
            "fairgate_time_per_output_token_seconds",
            "Streams: mean time between output tokens as the client received them",
            ["priority_class"], buckets=TPOT_BUCKETS, registry=r)
        self.duration = Histogram(
            "fairgate_request_duration_seconds", "From request arrival to the end of the answer",
            ["priority_class"], buckets=TTFT_BUCKETS, registry=r)
        self.requests = Counter(
            "fairgate_requests_total", "Finished client requests by status",
            ["model", "priority_class", "status"], registry=r)
        self.errors = Counter(
            "fairgate_errors_total", "Error responses by HTTP status and OpenAI error type",
            ["status", "type", "code"], registry=r)
        self.tokens = Counter(
            "fairgate_tokens_total", "Tokens served, by kind (prompt; prompt_cached: of the "
            "prompt, found in vLLM's prefix cache; completion)", ["model", "kind"], registry=r)

    def on_finish(self, model: str, klass: str, user: str, prompt_tokens: int,
                  output_tokens: int, service: float, timing: StreamTiming | None,
                  cached_tokens: int = 0) -> None:
        """After the answer went out (or failed): latency histograms, per-user counters."""
        child = self.child
        child(self.tokens, model, "prompt").inc(prompt_tokens)
        if cached_tokens:
            child(self.tokens, model, "prompt_cached").inc(cached_tokens)
        child(self.tokens, model, "completion").inc(output_tokens)
        if timing is not None:
            timing.end_s = time.monotonic()
            child(self.duration, klass).observe(timing.end_s - timing.arrived_s)
            if timing.first_token_s is not None:
                ttft = timing.first_token_s - timing.arrived_s
                child(self.ttft, klass).observe(ttft)
                if len(self.recent_ttft) < MAX_RECENT_TTFT:
                    self.recent_ttft.append(ttft)
                if output_tokens > 1 and timing.last_token_s is not None:
                    child(self.tpot, klass).observe(
                        (timing.last_token_s - timing.first_token_s) / (output_tokens - 1))
        self.usage.on_served(model, user, prompt_tokens, output_tokens, service)
