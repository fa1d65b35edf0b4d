"""``fairgate bench sessions`` at ``--quick`` size: the report has both runs and counts.

A benchmark, not a test of speed: nothing here asserts a timing or a target being met.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.test_smoke import _run


@pytest.mark.timeout(180)
def test_sessions(tmp_path: Path, redis_url: str) -> None:
    report = _run("sessions", tmp_path, redis_url)
    p = report["params"]
    assert set(report["runs"]) == {"sessions_off", "sessions_on"}
    for stats in report["runs"].values():
        assert stats["chat"]["errors"] == 0, stats["chat"]["error_sample"]
        assert stats["chat"]["completed"] == p["chat_turns"], stats["chat"]
        assert len(stats["chat_ttft_ms"]) == p["chat_turns"]
        assert stats["agent"]["completed"] > 0, stats["agent"]
