"""Read a vLLM server's Prometheus text into the numbers the gates need.

Sums over the ``engine`` label (data-parallel ranks), ignores ``*_created`` samples,
accepts the names of old servers (``vllm:gpu_cache_usage_perc``,
``vllm:time_per_output_token_seconds``), and turns the TPOT histogram into a *recent* mean
(and the TTFT histogram, which the adaptive pacing reads) into a *recent* mean by
differencing ``_sum``/``_count`` over a sliding window; the prefix cache's recent hit
rate (``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``, tokens;
``vllm:gpu_prefix_cache_*`` on servers before 0.11) the same way.

Only the sample lines of those families are read: a line filter by exact sample name (a
vLLM server's /metrics has ~600 lines, mostly histogram buckets nobody here needs), not a
full exposition parse. ``tests/test_backend_metrics.py`` checks it against
prometheus_client's parser on a real server's text.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

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
PROMPT_TOKENS = "vllm:prompt_tokens_total"
PROMPT_CACHED = "vllm:prompt_tokens_cached_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
SERVICE = "vllm:service"
"""The key of the (tokens computed, requests finished) pair in a :class:`HistogramWindow`:
its :meth:`~HistogramWindow.rates` are the backend's service rate (the autoscaling signal,
``policies/autoscale.py``) and its recent mean the output tokens per request (with
:data:`OUTPUT` the generation tokens alone)."""
OUTPUT = "vllm:output"
LORA_INFO = "vllm:lora_requests_info"
"""vLLM's LoRA gauge (only with ``--enable-lora``): its newest series is the current
state (:func:`lora_state`)."""
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class LoraState:
    """vLLM's ``vllm:lora_requests_info`` as of its newest series: the adapter slots of a
    batch (``--max-loras``) and the adapters with live requests (waiting or running)."""

    max_lora: int
    active: tuple[str, ...]


def lora_state(line: str) -> tuple[float, LoraState] | None:
    """One sample line of the gauge: (its value, the state it names); None when it is not
    vLLM's shape. The value is the time the series was set: the newest line is current."""
    labels_end = line.rfind("}")
    if labels_end < 0:
        return None
    labels = dict(_LABEL.findall(line[line.find("{") + 1:labels_end]))
    try:
        value = float(line[labels_end + 1:].split()[0])
        max_lora = int(labels["max_lora"])
    except (KeyError, ValueError, IndexError):
        return None
    names = {*labels.get("running_lora_adapters", "").split(","),
             *labels.get("waiting_lora_adapters", "").split(",")} - {""}
    return value, LoraState(max_lora, tuple(sorted(names)))



@dataclass(frozen=True, slots=True)
class RawMetrics:
    waiting: float
    running: float
    kv_usage: float
    sums: dict[str, tuple[float, float]]  # histogram → (sum, count)
    prefix_cache: tuple[float, float] | None = None  # (hits, queries) tokens; None: no APC
    counters: dict[str, float] = field(default_factory=dict)  # SERVICE_COUNTERS found
    lora: LoraState | None = None  # vLLM's LoRA gauge (None: LoRA off, or an old server)

    @property
    def service(self) -> tuple[float, float] | None:
        """(prompt tokens computed + generation tokens, requests finished), cumulative;
        None when the server does not count them."""
        c = self.counters
        if GENERATION_TOKENS not in c or REQUEST_SUCCESS not in c:
            return None
        computed = max(0.0, c.get(PROMPT_TOKENS, 0.0) - c.get(PROMPT_CACHED, 0.0))
        return computed + c[GENERATION_TOKENS], c[REQUEST_SUCCESS]

    @property
    def output(self) -> tuple[float, float] | None:
        """(generation tokens, requests finished), cumulative; None: not counted."""
        c = self.counters
        if GENERATION_TOKENS not in c or REQUEST_SUCCESS not in c:
            return None
        return c[GENERATION_TOKENS], c[REQUEST_SUCCESS]


class MetricsFormatError(ValueError):
    """The text is not Prometheus exposition or lacks vLLM's queue gauges."""


SERVICE_COUNTERS = (PROMPT_TOKENS, PROMPT_CACHED, GENERATION_TOKENS, REQUEST_SUCCESS)
WANTED = frozenset({RUNNING, WAITING, *KV_USAGE, *PREFIX_QUERIES, *PREFIX_HITS,
                    *SERVICE_COUNTERS, LORA_INFO}
                   | {h + "_sum" for h in HISTOGRAMS} | {h + "_count" for h in HISTOGRAMS})
# a sample line starts with its name, then labels or a space: the lines wanted are found
# by one scan of the text in C (every process's scrapes: ten a second per busy backend),
# not by a test of each of its ~600 lines in Python
_WANTED_LINE = re.compile(
    "^(?:" + "|".join(re.escape(name) for name in sorted(WANTED, key=len, reverse=True))
    + ")[{ ][^\n]*", re.MULTILINE)


def parse_metrics(text: str) -> RawMetrics:
    totals: dict[str, float] = {}
    lora: tuple[float, LoraState] | None = None
    for line in _WANTED_LINE.findall(text):
        line = line.rstrip()  # a "\r\n" line end
        if line.startswith(LORA_INFO):
            found = lora_state(line)
            if found is not None and (lora is None or found[0] >= lora[0]):
                lora = found
            continue
        labels_end = line.rfind("}")
        name_end = line.find("{") if labels_end > 0 else line.find(" ")
        name = line[:name_end]
        try:  # the value, then an optional timestamp
            value = float(line[max(labels_end + 1, name_end):].split()[0])
        except (ValueError, IndexError) as exc:
            raise MetricsFormatError(f"unparsable /metrics line: {line[:200]!r}") from exc
        totals[name] = totals.get(name, 0.0) + value
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
    counters = {name: totals[name] for name in SERVICE_COUNTERS if name in totals}
    return RawMetrics(totals[WAITING], totals[RUNNING], kv, sums, prefix, counters,
                      None if lora is None else lora[1])


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

    def rates(self, name: str) -> tuple[float, float] | None:
        """The per-second change of pair ``name`` (both of its numbers) between the
        window's oldest and newest samples; None with fewer than two, or no time between."""
        if len(self._points) < 2:
            return None
        (t0, first), (t1, last) = self._points[0], self._points[-1]
        if t1 <= t0 or name not in first or name not in last:
            return None
        return (max(0.0, last[name][0] - first[name][0]) / (t1 - t0),
                max(0.0, last[name][1] - first[name][1]) / (t1 - t0))
