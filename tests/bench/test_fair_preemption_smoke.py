"""``fairgate bench fair_preemption`` at ``--quick`` size: the report has its runs, every
stream of each ended, and the gateway runs report their preemption counters.

A benchmark, not a test of speed: nothing here asserts a timing or a target being met.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.test_smoke import _run


@pytest.mark.timeout(240)
def test_fair_preemption(tmp_path: Path, redis_url: str) -> None:
    report = _run("fair_preemption", tmp_path, redis_url)
    runs, p = report["runs"], report["params"]
    for endpoint in p["endpoints"]:
        for name in ("direct", "off", "on"):
            stats = runs[endpoint][name]
            assert stats["heavy_completed"] == p["flood"] and stats["errors"] == 0, stats
            assert stats["newcomer_ttft_ms"] is not None, stats
        for name in ("off", "on"):
            assert "recomputed_pct" in runs[endpoint][name], runs[endpoint][name]
        assert runs[endpoint]["off"]["preemptions"] == 0, runs[endpoint]["off"]
