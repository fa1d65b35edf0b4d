"""``fairgate bench locality`` at ``--quick`` size: the report has its runs and counts.

A benchmark, not a test of speed: nothing here asserts a timing or a target being met.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.test_smoke import _run


@pytest.mark.timeout(180)
def test_locality(tmp_path: Path, redis_url: str) -> None:
    report = _run("locality", tmp_path, redis_url)
    runs = report["runs"]
    assert set(runs) == {"direct_round_robin", "least_loaded", "locality",
                         "locality_no_prefill_gate", "locality_pools",
                         "least_loaded_waiting_1", "locality_waiting_1"}
    p = report["params"]
    for stats in runs.values():
        assert stats["errors"] == 0, stats["error_sample"]
        assert stats["completed"] == p["sessions"] * p["turns"]
        assert 0 < stats["prefix_hits"] < stats["prefix_queries"]
        assert stats["prompt_tokens_computed"] == stats["prefix_queries"] - stats["prefix_hits"]
        # RAG users' long prompts ran beside the chats, measured apart
        assert stats["rag_requests"] >= p["rag_users"] and stats["rag_errors"] == 0
        assert stats["streams_during_rag_prefill"] > 0
        assert stats["tpot_p99_during_rag_prefill_ms"] is not None
        # vLLM's own split of the wait for a first token, from the backends' histograms
        assert stats["vllm_queue_time_mean_ms"] is not None, stats
        assert stats["vllm_prefill_time_mean_ms"] > 0, stats
        # quick runs may be shorter than one window: then no index
        assert stats["jain_windows"] == 0 or 0 < stats["jain_mean"] <= 1
        assert stats["jain_queued_windows"] == 0 or 0 < stats["jain_queued_mean"] <= 1
    # each answer through the gateway said how long it queued there; direct: no queue
    assert runs["direct_round_robin"]["queue_wait_p50_ms"] is None
    assert runs["direct_round_robin"]["jain_queued_windows"] == 0
    for name in ("least_loaded", "locality"):
        assert runs[name]["queue_wait_p50_ms"] is not None, runs[name]
