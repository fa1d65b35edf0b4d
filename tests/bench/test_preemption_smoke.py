"""``fairgate bench preemption`` at ``--quick`` size: the report has its runs and counts.

A benchmark, not a test of speed: nothing here asserts a timing or a target being met.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.test_smoke import _run


@pytest.mark.timeout(240)
def test_preemption(tmp_path: Path, redis_url: str) -> None:
    report = _run("preemption", tmp_path, redis_url)
    runs, p = report["runs"], report["params"]
    for name in ("direct", "off", "on"):
        stats = runs[name]
        assert stats["newcomer"]["completed"] == p["newcomers"], stats["newcomer"]
        assert len(stats["newcomer_ttft_ms"]) == p["newcomers"]
        assert stats["batch"]["completed"] > 0, stats["batch"]
    assert "fairgate_preemptions_total" in runs["on"]["gateway_metrics"], runs["on"]
    for kind in ("failover", "drain"):
        fault = runs["faults"][kind]
        assert fault["streams"] == p["fault_streams"], fault
        # every stream of the killed or drained backend continues elsewhere (a locality
        # bug once left 2 of 8 waiting for the dead backend until the bench's bound)
        assert fault["completed"] == fault["streams"] and fault["errored"] == 0, fault
    assert runs["faults"]["failover"]["action"] == "SIGKILL b0"
