"""Each benchmark scenario at ``--quick`` size: the report has its keys and sane counts.

Benchmarks are not tests: nothing here asserts a timing or a target being met.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from loadtest.bench import cli, newcomer, peers
from loadtest.bench.cli import run_scenario
from loadtest.bench.client import ENDPOINTS, Result, Target
from loadtest.bench.env import MODEL, Backend, Options
from loadtest.bench.procs import SimSpec

HEADLINE_KEYS = {"metric", "direct", "gateway", "ratio", "target", "met"}


def _run(name: str, tmp_path: Path, redis_url: str, **options: Any) -> dict[str, Any]:
    opts = Options(out=tmp_path / name, quick=True, progress=False, redis_url=redis_url,
                   command=f"fairgate bench {name} --quick", **options)
    report = run_scenario(name, opts)
    on_disk = json.loads((tmp_path / name / "report.json").read_text())
    assert on_disk["scenario"] == name
    assert {"command", "date", "machine", "params", "headline", "runs", "plots"} <= set(on_disk)
    assert on_disk["headline"] and all(set(r) == HEADLINE_KEYS for r in on_disk["headline"])
    verdicts = [r["met"] for r in on_disk["headline"]]
    assert verdicts == [None] * len(verdicts), verdicts  # a quick run is not judged
    assert "| metric | direct | gateway |" in (tmp_path / name / "report.md").read_text()
    for plot in on_disk["plots"]:
        assert (tmp_path / name / plot).read_bytes()[:4] == b"\x89PNG"
    return report


@pytest.mark.timeout(120)
def test_newcomer(tmp_path: Path, redis_url: str) -> None:
    report = _run("newcomer", tmp_path, redis_url)
    assert set(report["runs"]) == set(ENDPOINTS)  # chat and completions by default
    for endpoint in ENDPOINTS:
        for run in ("direct", "gateway"):
            stats = report["runs"][endpoint][run]
            assert stats["newcomer"]["completed"] == report["params"]["newcomers"]
            assert len(stats["newcomer_ttft_ms"]) == report["params"]["newcomers"]
            assert stats["backend_waiting"]["samples"] > 0
    assert {row["metric"].split(":")[0] for row in report["headline"]} == set(ENDPOINTS)


class StubBench:
    """What ``newcomer.run`` asks of a :class:`~loadtest.bench.env.Bench`, with no process
    behind it: a backend and a gateway that are URLs only."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts

    async def __aenter__(self) -> StubBench:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    @contextlib.asynccontextmanager
    async def backend(self, spec: SimSpec, label: str) -> AsyncIterator[Backend]:
        yield Backend("http://direct.invalid", MODEL, None)

    @contextlib.asynccontextmanager
    async def served(self, spec: SimSpec, sim_label: str, users: Any, label: str,
                     **settings: Any) -> AsyncIterator[tuple[Backend, Any]]:
        yield (Backend("http://sim.invalid", MODEL, None),
               SimpleNamespace(url="http://gateway.invalid"))


def test_newcomer_one_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fairgate bench newcomer --endpoint chat`` reaches the scenario: its params name
    chat alone and only chat phases run (direct, then through the gateway), each sending
    chat requests. The phases are stubbed, no process starts: test_newcomer runs the real
    ones, on both endpoints."""
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "newcomer", "--quick", "--endpoint", "chat",
                              "--no-progress", "--out", str(tmp_path / "newcomer")])
    opts = cli.options(args, "newcomer")
    assert opts.endpoints == ("chat",), opts
    phases: list[tuple[str, bool]] = []

    async def phase(opts: Options, p: dict[str, Any], target: Target, backend_url: str,
                    chat: bool) -> tuple[list[Result], dict[str, Any]]:
        phases.append((target.name, chat))
        now = time.perf_counter()
        return [Result(f"new{i}", "newcomer", p["newcomer_prompt_tokens"], now, end_s=now + 0.2,
                       status=200, first_token_s=now + 0.1, token_times=[now + 0.1],
                       output_tokens=1) for i in range(p["newcomers"])], {"samples": 1, "max": 0}

    monkeypatch.setattr(newcomer, "_phase", phase)
    monkeypatch.setattr(newcomer, "Bench", StubBench)
    report = cli.run_scenario("newcomer", opts)
    assert report["params"]["endpoints"] == ["chat"]
    assert phases == [("direct", True), ("gateway", True)], phases
    assert set(report["runs"]) == {"chat"}, report["runs"].keys()
    assert {row["metric"].split(":")[0] for row in report["headline"]} == {"chat"}


@pytest.mark.timeout(90)
def test_overhead(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One run with ``--workers 2``, streamed and not: direct, the bare proxy, a peer that
    is not installed (reported skipped, the run goes on), gateway, gateway_wide and the
    two-worker phase."""
    monkeypatch.setattr(peers, "installed", lambda peer: False)
    report = _run("overhead", tmp_path, redis_url, workers=2, peers=("envoy",))
    runs, p = report["runs"], report["params"]
    assert set(runs) == {"direct", "bare_proxy", "envoy", "gateway", "gateway_wide",
                         "gateway_workers"}, runs.keys()
    skipped = runs["envoy"]["skipped"]
    assert skipped.startswith("not installed") and "fairgate[peers]" in skipped, skipped
    assert f"skipped: {skipped}" in (tmp_path / "overhead" / "report.md").read_text()
    for mode in ("streamed", "non_streamed"):
        for run in ("direct", "bare_proxy", "gateway", "gateway_workers"):
            for rate in p["rates"]:
                stats = runs[run][mode][f"rate_{rate}"]
                assert stats["errors"] == 0, (run, mode, stats["error_sample"])
                assert stats["completed"] == int(rate * p["duration_s"]), (run, mode, stats)
            assert runs[run][mode]["max"]["completed"] > 0, (run, mode)
        assert runs["gateway_wide"][mode]["max"]["completed"] > 0
        assert set(runs["gateway_wide"][mode]) == {"max"}, runs["gateway_wide"][mode].keys()
        # the floor is measured on the bare proxy's own process and shown beside fairgate's
        first = f"rate_{p['rates'][0]}"
        assert runs["bare_proxy"][mode][first]["cpu"]["process_cpu_ms_per_req"] > 0
        cpu = runs["gateway"][mode][first]["cpu"]
        assert cpu["process_cpu_ms_per_req"] > 0
        assert cpu["redis_commands_per_req"] >= 2  # enqueue (with its dispatch) and settle
        # the gateway phase stays one process in a --workers 2 run
        assert "process_split_cores" not in runs["gateway"][mode]["max"]["cpu"]
        cpu = runs["gateway_workers"][mode]["max"]["cpu"]
        assert len(cpu["process_split_cores"]) == 3  # the supervisor and two workers
        # at full load a tick's enqueues share one call and a first token rides on the
        # settle while nothing is queued: the settle, each request's own, is the floor
        assert cpu["redis_commands_per_req"] >= 1
    # a non-streamed answer arrives whole: one token time, no gaps between frames
    plain = runs["gateway"]["non_streamed"][f"rate_{p['rates'][0]}"]
    assert plain["itl_ms"]["p50"] is None and plain["output_tokens"] > 0, plain
    streamed = runs["gateway"]["streamed"][f"rate_{p['rates'][0]}"]
    assert streamed["itl_ms"]["p50"] is not None, streamed
    metrics = [row["metric"] for row in report["headline"]]
    for mode in ("streamed", "non-streamed"):
        assert sum(m.startswith(f"{mode}: CPU per request") for m in metrics) == len(
            p["rates"]) + 2, metrics  # each rate, and at saturation (1 and 2 workers)
        assert any(m.startswith(f"{mode}: max req/s, closed loop, --workers 2") for m in metrics)


@pytest.mark.timeout(90)
def test_utilization(tmp_path: Path, redis_url: str) -> None:
    # 2 s (a quick run's 3 s less one): after its 1 s warm-up a 1 s window, and a 64-token
    # answer takes about 0.4 s on the simulator
    report = _run("utilization", tmp_path, redis_url, duration_s=2.0)
    runs = report["runs"]
    assert set(runs) == {"direct", "gateway_fast_scrape", "gateway_fixed"} | {
        f"gateway_mw{k}" for k in report["params"]["sweep_max_waiting"]}
    for name, stats in runs.items():
        assert stats["completed"] > 0 and stats["output_tok_s"] > 0, (
            f"{name}: {stats['completed']} completed, {stats['output_tok_s']} tok/s")
    # the default (adaptive) run sampled the allowance (what may wait at vLLM), within
    # 1..max_waiting whatever the batch's free slots (a gauge of their own, 0..max_waiting)
    timeline = runs["gateway_mw3"]["pacing_timeline"]
    allowances = [pt["allowance"] for pt in timeline if "allowance" in pt]
    assert allowances, f"no allowance sampled: {timeline[:5]}"
    outside = [a for a in allowances if not 1 <= a <= 3]
    assert not outside, f"allowance outside 1..3: {outside[:10]} of {len(allowances)} samples"
    free = [pt["free_slots"] for pt in timeline if "free_slots" in pt]
    assert free and all(0 <= f <= 3 for f in free), f"free slots: {sorted(free)[-10:]}"


@pytest.mark.timeout(120)
def test_deadlines(tmp_path: Path, redis_url: str) -> None:
    report = _run("deadlines", tmp_path, redis_url)
    runs = report["runs"]
    assert set(runs) == {"direct", "gateway_no_deadline", "gateway_deadline"}
    assert report["params"]["rate_req_s"] > report["params"]["capacity_req_s"] > 0
    for stats in runs.values():
        assert stats["requests"] > 0
        assert sum(stats["outcomes"].values()) == stats["requests"]
        assert stats["outcomes"]["error"] == 0, stats["error_sample"]


@pytest.mark.timeout(120)
def test_mixed(tmp_path: Path, redis_url: str) -> None:
    # chat only: test_newcomer runs both endpoints through the gateway, and here the
    # endpoint is only what the requests are sent to
    report = _run("mixed", tmp_path, redis_url, endpoints=("chat",))
    assert set(report["runs"]) == {"chat"}
    assert report["params"]["endpoints"] == ["chat"]
    for run in ("direct", "gateway"):
        stats = report["runs"]["chat"][run]
        assert stats["interactive"]["requests"] > 0
        assert stats["batch_idle"]["requests"] > 0
        assert stats["backend_waiting"]["samples"] > 0


@pytest.mark.timeout(90)
def test_fairness(tmp_path: Path, redis_url: str) -> None:
    report = _run("fairness", tmp_path, redis_url)
    for run in ("direct", "round_robin", "vtc"):
        stats = report["runs"][run]
        assert stats["windows"] > 0
        assert stats["jain_mean"] is None or 0.0 < stats["jain_mean"] <= 1.0
        assert stats["jain_queued_mean"] is None or 0.0 < stats["jain_queued_mean"] <= 1.0
        assert stats["summary"]["completed"] > 0, f"{run}: {stats['summary']}"
    assert report["runs"]["direct"]["jain_queued_windows"] == 0  # no queue of the gateway's


@pytest.mark.timeout(90)
def test_tenants(tmp_path: Path, redis_url: str) -> None:
    report = _run("tenants", tmp_path, redis_url)
    for run in ("direct", "flat", "tenants"):
        stats = report["runs"][run]
        assert stats["windows"] > 0
        for level in ("tenant_jain_mean", "user_jain_mean"):
            assert stats[level] is None or 0.0 < stats[level] <= 1.0
        assert set(stats["tenant_share_mean"]) == set(report["params"]["tenants"])
        assert stats["summary"]["completed"] > 0, f"{run}: {stats['summary']}"


@pytest.mark.timeout(60)
def test_scheduler(tmp_path: Path, redis_url: str) -> None:
    report = _run("scheduler", tmp_path, redis_url)
    redis_run = report["runs"]["redis"]
    p = report["params"]
    assert redis_run["queued"] == p["queued"]
    assert redis_run["active_users"] == p["users"]
    assert redis_run["queued_after"] == p["queued"] - 3 * p["dispatches"]
    assert redis_run["bytes_per_queued_request"] > 0


@pytest.mark.timeout(120)
def test_pacing(tmp_path: Path, redis_url: str) -> None:
    report = _run("pacing", tmp_path, redis_url)
    assert set(report["runs"]) == {"direct_0", "adaptive_0", "fixed_0"}
    for name, stats in report["runs"].items():
        assert stats["completed"] == stats["requests"] > 0, (name, stats["error_sample"])
        assert stats["backend_waiting"]["samples"] > 0, (name, stats["backend_waiting"])
        assert stats["weighted_jain"] is None or 0.0 < stats["weighted_jain"] <= 1.0
    for name in ("adaptive_0", "fixed_0"):
        assert report["runs"][name]["gateway_cpu_s"] > 0, report["runs"][name]


@pytest.mark.timeout(120)
def test_replicas(tmp_path: Path, redis_url: str) -> None:
    report = _run("replicas", tmp_path, redis_url)
    run = report["runs"]["replicas"]
    for phase in ("three_replicas", "after_kill"):
        stats = run[phase]
        assert stats["service"]["heavy"] > 0 and stats["service"]["light"] > 0, stats
        assert stats["ratio"] is not None and stats["ratio"] > 0, stats
    assert run["share_ratio_samples"], "replica 1's /metrics never scraped"
    assert run["summary"]["completed"] > 0, run["summary"]
    assert report["params"]["killed_replica"] == 3


@pytest.mark.timeout(120)
def test_fleet(tmp_path: Path, redis_url: str) -> None:
    report = _run("fleet", tmp_path, redis_url)
    p = report["params"]
    assert set(report["runs"]) == {f"replicas_{n}" for n in p["replicas"]}
    for n in p["replicas"]:
        run = report["runs"][f"replicas_{n}"]
        assert len(run["idle"]["cpu_pct_per_backend_per_process"]) == n, run["idle"]
        assert run["idle"]["scrapes_per_backend_s"]["mean"] > 0, run["idle"]
        load = run["load"]
        assert load["requests"]["ok"] == load["requests"]["sent"] > 0, load["requests"]
        assert load["dispatches_per_s"] > 0 and load["snapshot_age_ms"]["p99"] is not None, load
        assert load["stale_views_per_s"] >= 0, load  # read from every replica's /metrics
        # every replica's event-loop lag over the window, from its probes (4 a second)
        assert len(load["loop_lag"]) == n and all(
            lag["mean_ms"] is not None and lag["mean_ms"] >= 0 for lag in load["loop_lag"]), load
