"""``fairgate bench adapters`` at ``--quick`` size: the three placements ran, the report has
every metric and the metrics are sane. No timing or target is asserted (benchmarks are
not tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.bench.adapters import COMPARED, RUNS
from tests.bench.test_smoke import _run


@pytest.mark.timeout(240)
def test_adapters(tmp_path: Path, redis_url: str) -> None:
    # 6 s, not a quick run's 10: after its 2 s warm-up a 4 s window, which holds three of
    # its 3 s Jain windows (0.5 s apart); the loads counted include the warm-up's
    report = _run("adapters", tmp_path, redis_url, duration_s=6.0)
    p, runs = report["params"], report["runs"]
    assert set(runs) == {*RUNS, "fleet_scope"}
    for scope in ("fleet", "model"):  # the fleet-scope phase ran, a share per tenant
        shares = runs["fleet_scope"][scope]["shares"]
        assert set(shares) == {"a", "b"} and abs(sum(shares.values()) - 1) < 1e-3, (
            scope, runs["fleet_scope"])
    for name in RUNS:
        run = runs[name]
        assert {key for _, key in COMPARED} <= set(run), (name, run.keys())
        assert run["failed"] == 0, (name, run["error_sample"])
        assert 0 < run["completed"] <= run["sent"], (name, run)
        # every run starts with no adapter loaded, and there are more adapters than slots
        assert run["loads_total"] >= p["backends"] * p["slots"] // 2, (name, run)
        assert run["loads_per_min"] >= 0 and run["unloads_per_min"] >= 0, (name, run)
        assert 0 < run["ttft_p50_ms"] <= run["ttft_p99_ms"], (name, run)
        assert run["cold_sent"] > 0 and len(run["cold_adapters"]) == p["cold"], (name, run)
        cold = (run["cold_ttft_p50_ms"], run["cold_ttft_p99_ms"])
        assert 0 < cold[0] <= cold[1], (name, cold)
        assert run["output_tok_s"] > 0, (name, run)
        assert run["jain_windows"] == 0 or 0 < run["jain_mean"] <= 1, (name, run)
        assert sum(a["sent"] for a in run["by_adapter"].values()) == run["sent"], name
    assert set(runs["round_robin"]) - set(runs["fairgate"]) == {"placed_again"}
    rows = [row["metric"] for row in report["headline"]]
    assert all(any(row.startswith(label.replace("the coldest", f"the {p['cold']} coldest"))
                   for row in rows) for label, _ in COMPARED), rows
    assert {"adapters_ttft_by_rank.png", "adapters_loads.png"} <= set(report["plots"])
