"""``utilization``: many closed-loop users saturating the backend; does pacing starve it?

Output tokens/s through fairgate ÷ direct, at the default ``max_waiting`` 3 (adaptive
pacing, the default, and ``pacing: fixed``) and swept over ``max_waiting`` 1..8 (TTFT vs
throughput trade-off). The default run samples the gateway's pacing allowance and the
backend's TPOT for a timeline plot. Throughput counts tokens
received inside the measured window (after a warm-up), so the cut-off at the end of a
bounded run does not bias it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench import report
from loadtest.bench.client import Result, Spec, Target, new_session
from loadtest.bench.env import Bench, Options, gateway_target
from loadtest.bench.loadgen import LoopUser, closed_loop, progress
from loadtest.bench.procs import SimSpec
from loadtest.bench.stats import ratio, summarize
from policies.classes import SPECS

SIM = SimSpec(max_num_seqs=256, max_num_batched_tokens=2048)
DEFAULT_MAX_WAITING = SPECS["interactive"].max_waiting
# The waiting gate admits at most max_waiting dispatches per /metrics snapshot, so the
# dispatch rate is bounded by max_waiting / scrape_interval_s: one extra run at the
# default max_waiting with a 4× faster scrape tests that diagnosis.
FAST_SCRAPE_S = 0.025


def params(opts: Options) -> dict[str, Any]:
    return {
        "users": opts.size or opts.pick(32, 4), "concurrency_per_user": opts.pick(8, 2),
        # a quick run's window is 3 s: answers short enough to finish inside it on a
        # loaded machine too
        "prompt_tokens": 512, "max_tokens": opts.pick(256, 64),
        "duration_s": opts.duration_s or opts.pick(15.0, 3.0),
        "warmup_s": opts.pick(4.0, 1.0),
        "sweep_max_waiting": opts.pick(list(range(1, 9)), [1, DEFAULT_MAX_WAITING]),
        "sim": SIM.__dict__,
        "gateway": "defaults except classes.interactive.max_waiting (swept)",
        "fast_scrape_s": FAST_SCRAPE_S,
    }


PACING_SAMPLE_S = 0.25


async def _sample_pacing(url: str, into: list[dict[str, float]]) -> None:
    """Every ``PACING_SAMPLE_S``: the interactive allowance, its free slots and the
    backend's TPOT as the gateway's /metrics show them (until cancelled)."""
    start = time.perf_counter()
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url + "/metrics") as resp:
                    text = await resp.text()
                point = {"t_s": time.perf_counter() - start}
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        interactive = sample.labels.get("priority_class") == "interactive"
                        if sample.name == "fairgate_pacing_allowance" and interactive:
                            point["allowance"] = sample.value
                        elif sample.name == "fairgate_pacing_free_slots" and interactive:
                            point["free_slots"] = sample.value
                        elif sample.name == "fairgate_backend_tpot_seconds":
                            point["tpot_ms"] = sample.value * 1000
                into.append(point)
            await asyncio.sleep(PACING_SAMPLE_S)


async def _measure(opts: Options, p: dict[str, Any], target: Target,
                   pacing: list[dict[str, float]] | None = None) -> dict[str, Any]:
    users = [LoopUser(Spec(f"u{i:02d}", "loop", p["prompt_tokens"], p["max_tokens"]),
                      p["concurrency_per_user"]) for i in range(p["users"])]
    bar = progress(None, f"utilization {target.name}", opts.progress)
    results: list[Result] = []
    sampler = None if pacing is None else asyncio.create_task(_sample_pacing(target.url, pacing))
    try:
        async with new_session() as session:
            start = time.perf_counter()
            await closed_loop(session, target, users, p["duration_s"], bar, sink=results)
    finally:
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
    bar.close()
    window = (start + p["warmup_s"], start + p["duration_s"])
    return summarize(results, window)


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    users = [(f"u{i:02d}", "interactive") for i in range(p["users"])]
    runs: dict[str, Any] = {}
    async with Bench(opts) as bench:
        async with bench.backend(SIM, "sim-direct") as be:
            runs["direct"] = await _measure(opts, p, be.target())
        pacing: list[dict[str, float]] = []
        for k in p["sweep_max_waiting"]:
            classes = {"interactive": {"max_waiting": k}}
            async with bench.served(SIM, f"sim-mw{k}", users, f"gateway-mw{k}",
                                    classes=classes) as (be, gw):
                runs[f"gateway_mw{k}"] = await _measure(
                    opts, p, gateway_target(gw, be, f"gateway mw={k}"),
                    pacing if k == DEFAULT_MAX_WAITING else None)
        runs[f"gateway_mw{DEFAULT_MAX_WAITING}"]["pacing_timeline"] = pacing
        classes = {"interactive": {"max_waiting": DEFAULT_MAX_WAITING}}
        async with bench.served(SIM, "sim-fixed", users, "gateway-fixed", classes=classes,
                                pacing="fixed") as (be, gw):
            runs["gateway_fixed"] = await _measure(opts, p, gateway_target(gw, be, "gateway fixed"))
        classes = {"interactive": {"max_waiting": DEFAULT_MAX_WAITING}}
        async with bench.served(SIM, "sim-fast-scrape", users, "gateway-fast-scrape",
                                classes=classes, scrape_interval_s=FAST_SCRAPE_S) as (be, gw):
            runs["gateway_fast_scrape"] = await _measure(
                opts, p, gateway_target(gw, be, "gateway fast scrape"))
    direct = runs["direct"]
    default = runs[f"gateway_mw{DEFAULT_MAX_WAITING}"]
    util = ratio(default["output_tok_s"], direct["output_tok_s"])
    headline = [
        report.Headline(f"output tok/s, max_waiting {DEFAULT_MAX_WAITING}, adaptive pacing "
                        "(gateway ÷ direct)", direct["output_tok_s"], default["output_tok_s"],
                        util, "≥ 0.99", None if util is None else util >= 0.99),
        report.Headline("TTFT p50 (ms), max_waiting 3", direct["ttft_ms"]["p50"],
                        default["ttft_ms"]["p50"],
                        ratio(default["ttft_ms"]["p50"], direct["ttft_ms"]["p50"]), "–", None),
        report.Headline("TPOT p50 (ms), max_waiting 3", direct["tpot_ms"]["p50"],
                        default["tpot_ms"]["p50"],
                        ratio(default["tpot_ms"]["p50"], direct["tpot_ms"]["p50"]), "–", None),
    ]
    fixed = runs["gateway_fixed"]
    r_fixed = ratio(fixed["output_tok_s"], direct["output_tok_s"])
    headline.append(report.Headline(
        f"output tok/s, max_waiting 3, pacing fixed (TTFT p50 {fixed['ttft_ms']['p50']} ms)",
        direct["output_tok_s"], fixed["output_tok_s"], r_fixed, "–", None))
    fast = runs["gateway_fast_scrape"]
    r_fast = ratio(fast["output_tok_s"], direct["output_tok_s"])
    headline.append(report.Headline(
        f"output tok/s, max_waiting 3, scrape_interval_s {FAST_SCRAPE_S} "
        f"(TTFT p50 {fast['ttft_ms']['p50']} ms)", direct["output_tok_s"],
        fast["output_tok_s"], r_fast, "≥ 0.97", None if r_fast is None else r_fast >= 0.97))
    for k in p["sweep_max_waiting"]:
        if k == DEFAULT_MAX_WAITING:
            continue
        run_k = runs[f"gateway_mw{k}"]
        r = ratio(run_k["output_tok_s"], direct["output_tok_s"])
        headline.append(report.Headline(
            f"output tok/s, max_waiting {k} (TTFT p50 {run_k['ttft_ms']['p50']} ms)",
            direct["output_tok_s"], run_k["output_tok_s"], r, "≥ 0.97 (sweep)",
            None if r is None else r >= 0.97))
    fig, ax = report.figure("TTFT vs throughput, sweeping max_waiting", "output tokens/s",
                            "TTFT (ms)")
    xs = [runs[f"gateway_mw{k}"]["output_tok_s"] for k in p["sweep_max_waiting"]]
    for q, style in (("p50", "-o"), ("p99", "--s")):
        ys = [runs[f"gateway_mw{k}"]["ttft_ms"][q] or 0.0 for k in p["sweep_max_waiting"]]
        ax.plot(xs, ys, style, label=f"gateway TTFT {q}")
        ax.plot([direct["output_tok_s"]], [direct["ttft_ms"][q] or 0.0], "*", markersize=12,
                label=f"direct TTFT {q}")
        fast_y = fast["ttft_ms"][q] or 0.0
        ax.plot([fast["output_tok_s"]], [fast_y], "^", markersize=9,
                label=f"mw=3, scrape {FAST_SCRAPE_S}s, TTFT {q}")
        if q == "p50":
            for k, x, y in zip(p["sweep_max_waiting"], xs, ys, strict=True):
                ax.annotate(f"mw={k}", (x, y), textcoords="offset points", xytext=(4, 4))
    ax.set_yscale("log")
    ax.legend()
    return report.write(opts, "utilization", p, runs, headline,
                        {"utilization_sweep.png": fig, "pacing_timeline.png": _timeline(pacing)})


def _timeline(pacing: list[dict[str, float]]) -> Any:
    """The adaptive allowance over the default run against the backend's TPOT."""
    fig, ax = report.figure("Adaptive pacing, max_waiting 3 (interactive, backend b0)",
                            "seconds into the run", "allowance (requests)")
    xs = [pt["t_s"] for pt in pacing if "allowance" in pt]
    ax.step(xs, [pt["allowance"] for pt in pacing if "allowance" in pt], where="post",
            label="allowance (may wait at vLLM)")
    ax.step(xs, [pt.get("free_slots", 0) for pt in pacing if "allowance" in pt], where="post",
            label="free batch slots (start at once)", linestyle="--")
    ax.set_ylim(0, 2 * DEFAULT_MAX_WAITING + 0.5)
    tpot = ax.twinx()
    tpot.plot([pt["t_s"] for pt in pacing if "tpot_ms" in pt],
              [pt["tpot_ms"] for pt in pacing if "tpot_ms" in pt], "r-", alpha=0.6,
              label="backend TPOT (ms)")
    tpot.set_ylabel("TPOT (ms)")
    fig.legend(loc="lower right")
    return fig
