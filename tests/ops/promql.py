"""Metric names a PromQL expression reads, and the names fairgate and vLLM export."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway.core.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
VLLM_SAMPLE = ROOT / "tests" / "data" / "vllm-0.32-cpu-metrics-under-load.txt"

FUNCTIONS = {
    "sum", "min", "max", "avg", "count", "topk", "bottomk", "quantile", "stddev", "group",
    "rate", "irate", "increase", "delta", "deriv", "histogram_quantile", "vector", "scalar",
    "abs", "clamp_min", "clamp_max", "absent", "absent_over_time", "avg_over_time",
    "max_over_time", "min_over_time", "sum_over_time", "label_replace", "label_values",
    "time", "round", "changes", "resets",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset",
}


def referenced_metrics(expr: str) -> set[str]:
    """Identifiers in ``expr`` that are metric names (label matchers, grouping label lists,
    ranges, strings and template variables removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"label_values\(([^,()]+),[^)]*\)", r"\1", text)  # Grafana: (metric, label)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text))
    return {n for n in names if n not in FUNCTIONS and not re.fullmatch(r"e\d*|Inf|NaN", n)}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name a registry can export, including families with no samples yet."""
    suffixes: dict[str, Iterable[str]] = {
        "counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",),
    }
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def fairgate_names() -> set[str]:
    return exported_names(GatewayMetrics().registry)


def vllm_names() -> set[str]:
    names: set[str] = set()
    for family in text_string_to_metric_families(VLLM_SAMPLE.read_text()):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names
