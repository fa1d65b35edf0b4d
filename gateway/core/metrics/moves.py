"""Answers moved between backends: preemption for fairness (``gateway/scheduling/
preemption.py``: streams this replica moved off a full backend for a waiting request of
a higher class, by the victim's class) and continued answers
(``gateway/proxy/continuation.py``): why, and what they cost."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.core.metrics.base import TTFT_BUCKETS, Children, MetricGroup


class MoveMetrics(MetricGroup):
    def __init__(self, r: CollectorRegistry, child: Children) -> None:
        super().__init__(child)
        self.preemptions = Counter(
            "fairgate_preemptions_total",
            "Running requests preempted (their slot given to a waiting request of a higher "
            "class, or of a user of its class below its fair share; they continue later, "
            "fairgate_continuations_total{reason=\"preempt\"}), by the victim's class",
            ["model", "priority_class"], registry=r)
        self.preempted_tokens = Counter(
            "fairgate_preemption_recomputed_tokens_total",
            "Tokens the preempted answers' continuations send again (prompt plus generated "
            "at the preemption: the most the backends recompute), by the victim's class",
            ["model", "priority_class"], registry=r)
        self.recompute_allowance = Gauge(
            "fairgate_preemption_recompute_allowance_tokens",
            "Tokens a preemption this replica orders may still recompute: "
            "preempt_recompute_ratio of the tokens its streams served, plus the burst, "
            "less what its preemptions sent again", ["model"], registry=r,
            multiprocess_mode="livesum")
        self.continuations = Counter(
            "fairgate_continuations_total",
            "Answers continued on another backend, by reason (failover; retry: a whole "
            "answer sent again once after a 5xx answer; drain, preempt: moved on purpose) "
            "and outcome "
            "(continued: a backend took the rest; failed: none could, the stream ended with "
            "an error)", ["reason", "outcome"], registry=r)
        self.recomputed_tokens = Counter(
            "fairgate_continuation_recomputed_tokens_total",
            "Prompt plus already generated tokens a continuation sent again (the backend "
            "recomputes what its prefix cache lacks); charged to nobody", ["reason"],
            registry=r)
        self.pause = Histogram(
            "fairgate_continuation_pause_seconds",
            "From a stream's failure to its continuation's first frame", ["reason"],
            buckets=TTFT_BUCKETS, registry=r)

    def view(self) -> dict[str, Any]:
        """This replica's continued answers by reason (continued, failed, tokens sent
        again) and its preemptions by model and class: the dashboard's reliability panel."""
        reasons: dict[str, dict[str, float]] = {}
        for sample in _totals(self.continuations):
            row = reasons.setdefault(sample.labels["reason"], {})
            row[sample.labels["outcome"]] = sample.value
        for sample in _totals(self.recomputed_tokens):
            reasons.setdefault(sample.labels["reason"], {})["recomputed_tokens"] = sample.value
        preempted = {f"{s.labels['model']} · {s.labels['priority_class']}": s.value
                     for s in _totals(self.preemptions)}
        recomputed = {f"{s.labels['model']} · {s.labels['priority_class']}": s.value
                      for s in _totals(self.preempted_tokens)}
        return {"continuations": reasons, "preempted": preempted,
                "preempted_tokens": recomputed}


def _totals(counter: Counter) -> list[Any]:
    """A labelled counter's ``_total`` samples (one per label set seen)."""
    return [sample for family in counter.collect() for sample in family.samples
            if sample.name.endswith("_total")]
