"""``/metrics`` speaks vLLM's names, types and labels (checked against a real server)."""

from __future__ import annotations

import pathlib

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.sim.server import SimServer
from tests.sim.conftest import MODEL

REFERENCE = pathlib.Path("/work/shared/reference/vllm-0.32-cpu-metrics-under-load.txt")
REQUIRED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:request_success": "counter",
}


def shape(text: str) -> dict[str, tuple[str, frozenset[str], frozenset[str]]]:
    """family -> (type, label names, sample names)."""
    out = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        labels = frozenset(k for s in family.samples for k in s.labels)
        names = frozenset(s.name for s in family.samples)
        out[family.name] = (family.type, labels, names)
    return out


@pytest.fixture(scope="module")
def reference_text() -> str:
    if not REFERENCE.exists():
        pytest.skip("reference metrics file missing")
    return REFERENCE.read_text()


async def scrape(server: SimServer) -> str:
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        async with http.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
        async with http.get(server.url + "/metrics") as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
            return await resp.text()


async def test_metrics_are_a_subset_of_real_vllm(server: SimServer, reference_text: str) -> None:
    ours = shape(await scrape(server))
    reference = shape(reference_text)
    for name, kind in REQUIRED.items():
        assert ours[name][0] == kind, name
    for name, (kind, labels, samples) in ours.items():
        assert name in reference, name
        ref_kind, ref_labels, ref_samples = reference[name]
        assert kind == ref_kind, name
        assert labels <= ref_labels, name
        assert samples <= ref_samples, name


async def test_metric_values_follow_requests(server: SimServer) -> None:
    text = await scrape(server)
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    base = (("engine", "0"), ("model_name", MODEL))
    assert values[("vllm:generation_tokens_total", base)] == 4
    assert values[("vllm:prompt_tokens_total", base)] == 2
    assert values[("vllm:time_to_first_token_seconds_count", base)] == 1
    assert values[("vllm:inter_token_latency_seconds_count", base)] == 3
    success = (("engine", "0"), ("finished_reason", "length"), ("model_name", MODEL))
    assert values[("vllm:request_success_total", success)] == 1
    assert values[("vllm:num_requests_running", base)] == 0


async def test_bucket_boundaries_match_reference(server: SimServer, reference_text: str) -> None:
    def buckets(text: str, family: str) -> list[str]:
        return [
            s.labels["le"]
            for f in text_string_to_metric_families(text)
            if f.name == family
            for s in f.samples
            if s.name.endswith("_bucket")
        ]

    ours = await scrape(server)
    reference = reference_text
    for family in [n for n, kind in REQUIRED.items() if kind == "histogram"]:
        assert buckets(ours, family) == buckets(reference, family), family
