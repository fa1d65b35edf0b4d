"""Read a vLLM server's Prometheus text into the numbers the gates need.

Sums over the ``engine`` label (data-parallel ranks), ignores ``*_created`` samples,
accepts the names of old servers (``vllm:gpu_cache_usage_perc``,
``vllm:time_per_output_token_seconds``), and turns the TPOT histogram into a *recent* mean
(and the TTFT histogram, which the adaptive pacing reads) into a *recent* mean by
differencing ``_sum``/``_count`` over a sliding window; the prefix cache's recent hit
rate (``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``, tokens;
``vllm:gpu_prefix_cache_*`` on servers before 0.11) the same way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# Preference order: per-request TPOT, then per-token ITL, then the pre-2026 name.
TPOT_HISTOGRAMS = (
    "vllm:request_time_per_output_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
)
TTFT_HISTOGRAMS = ("vllm:time_to_first_token_seconds",)
HISTOGRAMS = TPOT_HISTOGRAMS + TTFT_HISTOGRAMS
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PREFIX_CACHE = "vllm:prefix_cache"
"""The key of the (hits, queries) pair in a :class:`HistogramWindow`: its recent mean is
the recent hit rate."""


@dataclass(frozen=True, slots=True)
class RawMetrics:
    waiting: float
    running: float
    kv_usage: float
    sums: dict[str, tuple[float, float]]  # histogram → (sum, count)
    prefix_cache: tuple[float, float] | None = None  # (hits, queries) tokens; None: no APC


class MetricsFormatError(ValueError):
    """The text is not Prometheus exposition or lacks vLLM's queue gauges."""


def parse_metrics(text: str) -> RawMetrics:
    totals: dict[str, float] = {}
    wanted = {RUNNING, WAITING, *KV_USAGE}
    wanted |= {h + "_sum" for h in HISTOGRAMS} | {h + "_count" for h in HISTOGRAMS}
    wanted |= {*PREFIX_QUERIES, *PREFIX_HITS}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except ValueError as exc:
        raise MetricsFormatError(f"unparsable /metrics: {exc}") from exc
    if RUNNING not in totals or WAITING not in totals:
        raise MetricsFormatError("no vllm:num_requests_running/waiting in /metrics")
    kv = next((totals[name] for name in KV_USAGE if name in totals), 0.0)
    sums = {
        h: (totals[h + "_sum"], totals[h + "_count"])
        for h in HISTOGRAMS
        if h + "_count" in totals
    }
    prefix = next(((totals.get(hits, 0.0), totals[queries])
                   for queries, hits in zip(PREFIX_QUERIES, PREFIX_HITS, strict=True)
                   if queries in totals), None)
    return RawMetrics(totals[WAITING], totals[RUNNING], kv, sums, prefix)


@dataclass
class HistogramWindow:
    """Recent mean of one histogram (the first of ``names`` the server has) from
    cumulative samples within ``window_s``."""

    window_s: float
    names: tuple[str, ...] = TPOT_HISTOGRAMS
    _points: deque[tuple[float, dict[str, tuple[float, float]]]] = field(default_factory=deque)

    def add(self, now_s: float, sums: dict[str, tuple[float, float]]) -> float | None:
        self._points.append((now_s, sums))
        while len(self._points) > 2 and self._points[1][0] <= now_s - self.window_s:
            self._points.popleft()
        oldest = self._points[0][1]
        for name in self.names:
            if name in sums and name in oldest:
                d_sum = sums[name][0] - oldest[name][0]
                d_count = sums[name][1] - oldest[name][1]
                if d_count > 0 and d_sum >= 0:
                    return d_sum / d_count
        return None
