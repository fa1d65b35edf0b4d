"""``fairgate bench autoscale`` at ``--quick`` size: both policies ran their load against
the autoscaled pool, every backend the harness started was stopped again, and no request
was lost while a backend was removed. No timing or target is asserted (benchmarks are not
tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.bench.autoscale import POLICIES, ThresholdRule, ThresholdState, threshold_step
from tests.bench.test_smoke import _run


@pytest.mark.timeout(300)
def test_autoscale(tmp_path: Path, redis_url: str) -> None:
    report = _run("autoscale", tmp_path, redis_url)
    p, runs = report["params"], report["runs"]
    assert set(runs) == set(POLICIES), runs.keys()
    sent = int(sum(f * p["rate_1x"] * d
                   for f, d in zip((1, p["step_factor"], 1), p["phases_s"], strict=True)))
    for name in POLICIES:
        run = runs[name]
        assert run["interactive"]["sent"] >= sent - 3, (name, run["interactive"]["sent"], sent)
        assert run["interactive"]["slo_met"] > 0, (name, run["interactive"])
        assert run["batch"]["completed"] > 0, (name, run["batch"])
        assert run["lost_scaling_down"] == 0, (name, run["lost_scaling_down"],
                                               run["error_sample"], run["replicas"])
        polls = [t for t in run["timeline"] if "desired" in t]
        assert polls, (name, run["timeline"])
        assert all(p["min_replicas"] <= t["desired"] <= p["max_replicas"] for t in polls), polls
        assert run["backend_seconds"] >= run["load_s"] * 0.9, (name, run["backend_seconds"])
        for life in run["replicas"]:
            assert life["stopped_s"] is not None, (name, life)
            if life["leaving_s"] is not None and life["added_s"] is not None:
                assert life["removal"].startswith("removed"), (name, life)


def test_threshold_rule() -> None:
    rule = ThresholdRule(threshold=3, cooldown_s=10, min_replicas=1, max_replicas=3)
    state = ThresholdState(1)
    state = threshold_step(rule, state, 5, now_s=0)
    assert state.replicas == 2, state
    state = threshold_step(rule, state, 9, now_s=2)
    state = threshold_step(rule, state, 9, now_s=4)
    assert state.replicas == 3, state  # bounded by max_replicas
    state = threshold_step(rule, state, 0, now_s=8)
    assert state.replicas == 3, state  # below, but inside the cool-down
    state = threshold_step(rule, state, 3, now_s=9)  # at the threshold: holds, resets
    state = threshold_step(rule, state, 0, now_s=18)
    assert state.replicas == 3, state
    state = threshold_step(rule, state, 0, now_s=19)
    assert state.replicas == 2, state
    state = threshold_step(rule, state, 0, now_s=20)
    assert state.replicas == 2, state  # a cool-down after the last change
    state = threshold_step(rule, state, 0, now_s=29)
    assert state.replicas == 1, state
    state = threshold_step(rule, state, 0, now_s=60)
    assert state.replicas == 1, state  # bounded by min_replicas
