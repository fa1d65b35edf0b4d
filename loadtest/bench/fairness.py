"""``fairness``: 20 closed-loop users with skewed demand, direct vs ``round_robin`` vs ``vtc``.

One heavy user (many concurrent requests), light users with long prompts and light users
with short prompts. Weighted token service per user (prompt × 1 when its first token
arrives, output × 2 per streamed token: VTC's default weights) is measured over sliding
windows; Jain's index is taken over the users that were backlogged (had a request
outstanding) for the whole window. The backend is kept saturated (``max_num_seqs`` 64 <
total demand) so that someone must wait and the order matters.
"""

from __future__ import annotations

import time
from typing import Any

from loadtest.bench import report
from loadtest.bench.client import Result, Spec, Target, new_session
from loadtest.bench.env import Bench, Options, gateway_target
from loadtest.bench.loadgen import LoopUser, closed_loop, progress
from loadtest.bench.procs import SimSpec
from loadtest.bench.stats import (
    backlogged,
    jain,
    percentile,
    service_by_user,
    sliding_windows,
    summarize,
)

SIM = SimSpec(max_num_seqs=64, max_num_batched_tokens=2048)
W_IN, W_OUT = 1.0, 2.0
POLICIES = ("round_robin", "vtc")


def params(opts: Options) -> dict[str, Any]:
    return {
        "users": 20, "heavy_concurrency": opts.size or opts.pick(24, 6),
        "light_concurrency": opts.pick(4, 1), "long_prompt_users": 5,
        "long_prompt_tokens": 2000, "short_prompt_tokens": 200, "max_tokens": 128,
        "duration_s": opts.duration_s or opts.pick(30.0, 4.0),
        "warmup_s": opts.pick(5.0, 1.0), "window_s": opts.pick(10.0, 2.0),
        "step_s": opts.pick(1.0, 0.5), "weights": {"input": W_IN, "output": W_OUT},
        "sim": SIM.__dict__, "gateway": "defaults; fairness = round_robin | vtc",
    }


def loop_users(p: dict[str, Any]) -> list[LoopUser]:
    users = [LoopUser(Spec("u00", "heavy", p["short_prompt_tokens"], p["max_tokens"]),
                      p["heavy_concurrency"])]
    for i in range(1, p["users"]):
        long = i <= p["long_prompt_users"]
        prompt = p["long_prompt_tokens"] if long else p["short_prompt_tokens"]
        users.append(LoopUser(Spec(f"u{i:02d}", "long" if long else "short", prompt,
                                   p["max_tokens"]), p["light_concurrency"]))
    return users


def analyse(results: list[Result], start: float, p: dict[str, Any]) -> dict[str, Any]:
    windows = sliding_windows(start + p["warmup_s"], start + p["duration_s"], p["window_s"],
                              p["step_s"])
    indices: list[float] = []
    heavy_share: list[float] = []
    for a, b in windows:
        users = backlogged(results, a, b)
        served = service_by_user(results, a, b, W_IN, W_OUT)
        values = [served.get(u, 0.0) for u in sorted(users)]
        index = jain(values)
        if index is not None:
            indices.append(index)
        total = sum(served.values())
        if total:
            heavy_share.append(served.get("u00", 0.0) / total)
    measured = (start + p["warmup_s"], start + p["duration_s"])
    totals = service_by_user(results, *measured, W_IN, W_OUT)
    return {
        "windows": len(windows),
        "jain_mean": round(sum(indices) / len(indices), 4) if indices else None,
        "jain_min": round(min(indices), 4) if indices else None,
        "jain_p10": round(percentile(indices, 10) or 0.0, 4) if indices else None,
        "jain_series": [round(x, 4) for x in indices],
        "heavy_share_mean": round(sum(heavy_share) / len(heavy_share), 4)
        if heavy_share else None,
        "service_by_user": {u: round(v) for u, v in sorted(totals.items())},
        "summary": summarize(results, measured),
    }


async def _measure(opts: Options, p: dict[str, Any], target: Target) -> dict[str, Any]:
    bar = progress(None, f"fairness {target.name}", opts.progress)
    results: list[Result] = []
    async with new_session() as session:
        start = time.perf_counter()
        await closed_loop(session, target, loop_users(p), p["duration_s"], bar, sink=results)
    bar.close()
    return analyse(results, start, p)


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    users = [(u.spec.user, "interactive") for u in loop_users(p)]
    runs: dict[str, Any] = {}
    async with Bench(opts) as bench:
        async with bench.backend(SIM, "sim-direct") as be:
            runs["direct"] = await _measure(opts, p, be.target())
        for policy in POLICIES:
            async with bench.backend(SIM, f"sim-{policy}") as be, \
                    bench.gateway(be, users, f"gateway-{policy}", fairness=policy) as gw:
                runs[policy] = await _measure(opts, p, gateway_target(gw, be, policy))
    d = runs["direct"]
    headline = []
    for policy in POLICIES:
        g = runs[policy]
        target = "≥ 0.95" if policy == "vtc" else "–"
        met = None if policy != "vtc" or g["jain_mean"] is None else g["jain_mean"] >= 0.95
        headline.append(report.Headline(f"Jain's index, mean over windows ({policy})",
                                        d["jain_mean"], g["jain_mean"], None, target, met))
        headline.append(report.Headline(f"Jain's index, worst window ({policy})",
                                        d["jain_min"], g["jain_min"], None, "–", None))
        headline.append(report.Headline(f"heavy user's share of service ({policy})",
                                        d["heavy_share_mean"], g["heavy_share_mean"], None,
                                        f"fair: {1 / p['users']:.2f}", None))
        headline.append(report.Headline(
            f"output tok/s ({policy}); ratio = gateway ÷ direct",
            d["summary"]["output_tok_s"], g["summary"]["output_tok_s"],
            round(g["summary"]["output_tok_s"] / d["summary"]["output_tok_s"], 3)
            if d["summary"]["output_tok_s"] else None, "–", None))
    fig, ax = report.figure("Jain's index of weighted token service (sliding windows)",
                            "window", "Jain's index")
    for name in ("direct", *POLICIES):
        ax.plot(runs[name]["jain_series"], label=name)
    ax.axhline(0.95, color="red", linestyle=":", label="target 0.95")
    ax.set_ylim(0, 1.02)
    ax.legend()
    fig2, ax2 = report.figure("Weighted token service per user (measured period)", "user",
                              "tokens × weight")
    names = [u.spec.user for u in loop_users(p)]
    for offset, name in ((-0.27, "direct"), (0.0, "round_robin"), (0.27, "vtc")):
        service = runs[name]["service_by_user"]
        ax2.bar([i + offset for i in range(len(names))], [service.get(n, 0) for n in names],
                width=0.27, label=name)
    ax2.set_xticks(range(len(names)), names, rotation=90)
    ax2.legend()
    return report.write(opts, "fairness", p, runs, headline,
                        {"fairness_jain.png": fig, "fairness_service.png": fig2})
