"""``fairness``: 20 closed-loop users with skewed demand, direct vs ``round_robin`` vs ``vtc``;
``tenants`` (below, :func:`run_tenants`): the same measure at two levels, tenants and users.

One heavy user (many concurrent requests), light users with long prompts and light users
with short prompts. Weighted token service per user (prompt × 1 when its first token
arrives, output × 2 per streamed token: VTC's default weights) is measured over sliding
windows; Jain's index is taken over the users that were backlogged (had a request
outstanding) for the whole window, and, through the gateway, also over those that had a
request waiting in its queue for the whole window (VTC's backlogged: a user whose every
request runs already is served to the limit of its own demand). The backend is kept
saturated (``max_num_seqs`` 64 < total demand) so that someone must wait and the order
matters.
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
    queued,
    service_by_user,
    sliding_windows,
    summarize,
)

SIM = SimSpec(max_num_seqs=64, max_num_batched_tokens=2048)
# A quick run's length: at load 10 on 2 cores a 4 s run of the tenants phase completed
# nothing (24 requests, all still running at its end)
QUICK_DURATION_S = 8.0
W_IN, W_OUT = 1.0, 2.0
POLICIES = ("round_robin", "vtc")


def params(opts: Options) -> dict[str, Any]:
    return {
        "users": 20, "heavy_concurrency": opts.size or opts.pick(24, 6),
        "light_concurrency": opts.pick(4, 1), "long_prompt_users": 5,
        "long_prompt_tokens": 2000, "short_prompt_tokens": 200,
        "max_tokens": opts.pick(128, 32),  # quick: answers that end inside its window
        "duration_s": opts.duration_s or opts.pick(30.0, QUICK_DURATION_S),
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
    waiting: list[float] = []  # among the users waiting in the gateway's queue throughout
    waited: dict[str, int] = {}  # user → windows it waited in the queue throughout
    heavy_share: list[float] = []
    for a, b in windows:
        served = service_by_user(results, a, b, W_IN, W_OUT)
        index = jain([served.get(u, 0.0) for u in sorted(backlogged(results, a, b))])
        if index is not None:
            indices.append(index)
        users = queued(results, a, b)
        for user in users:
            waited[user] = waited.get(user, 0) + 1
        if len(users) >= 2:  # one user alone is not a comparison
            waiting.append(jain([served.get(u, 0.0) for u in sorted(users)]) or 0.0)
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
        # VTC's own measure: only users with a request in the gateway's queue for the whole
        # window (not direct: no queue there)
        "jain_queued_mean": round(sum(waiting) / len(waiting), 4) if waiting else None,
        "jain_queued_windows": len(waiting),
        "queued_windows_by_user": dict(sorted(waited.items())),
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
            async with bench.served(SIM, f"sim-{policy}", users, f"gateway-{policy}",
                                    fairness=policy) as (be, gw):
                runs[policy] = await _measure(opts, p, gateway_target(gw, be, policy))
    d = runs["direct"]
    headline = []
    for policy in POLICIES:
        g = runs[policy]
        target = "≥ 0.95" if policy == "vtc" else "–"
        met = None if policy != "vtc" or g["jain_mean"] is None else g["jain_mean"] >= 0.95
        headline.append(report.Headline(f"Jain's index, mean over windows ({policy})",
                                        d["jain_mean"], g["jain_mean"], None, target, met))
        headline.append(report.Headline(
            f"Jain's index among users waiting in the gateway's queue all window ({policy}; "
            f"{g['jain_queued_windows']} windows)", None, g["jain_queued_mean"], None, "–",
            None))
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


# --- tenants: hierarchical fair share ---------------------------------------------------
# ``fairgate bench tenants`` (loadtest/bench/tenants.py): three tenants of different sizes
# and weights, every user flooding (closed loop). Jain's index at both levels per window:
# over the backlogged tenants of their service ÷ tenant weight, and within each tenant over
# its backlogged users (the mean over tenants with two or more). Direct to the backend, the
# gateway without tenants (every user its own tenant) and with them.

TENANTS = {"research": 2.0, "product": 1.0, "ops": 1.0}
# user -> (tenant, prompt tokens)
TENANT_USERS = {"r1": ("research", 200), "r2": ("research", 1000), "r3": ("research", 200),
                "r4": ("research", 200), "p1": ("product", 200),
                "o1": ("ops", 200), "o2": ("ops", 1000), "o3": ("ops", 200)}
TENANT_PHASES = ("direct", "flat", "tenants")
# a smaller batch than fairness's, so that every tenant's demand (concurrency × users)
# exceeds its share of the batch and the dispatch order decides the shares
TENANT_SIM = SimSpec(max_num_seqs=32, max_num_batched_tokens=2048)


def tenant_params(opts: Options) -> dict[str, Any]:
    return {
        "tenants": TENANTS, "users": {u: t for u, (t, _) in TENANT_USERS.items()},
        "prompts": {u: p for u, (_, p) in TENANT_USERS.items()},
        # a quick run: answers short enough to end inside its window on a loaded machine
        "concurrency": opts.size or opts.pick(12, 3), "max_tokens": opts.pick(128, 32),
        "duration_s": opts.duration_s or opts.pick(30.0, QUICK_DURATION_S),
        "warmup_s": opts.pick(5.0, 1.0), "window_s": opts.pick(10.0, 2.0),
        "step_s": opts.pick(1.0, 0.5), "weights": {"input": W_IN, "output": W_OUT},
        "sim": TENANT_SIM.__dict__,
        "gateway": "fairness vtc; flat: keys without tenants; tenants: keys naming them",
    }


def tenant_loop_users(p: dict[str, Any]) -> list[LoopUser]:
    return [LoopUser(Spec(u, p["users"][u], p["prompts"][u], p["max_tokens"]),
                     p["concurrency"]) for u in p["users"]]


def tenant_keys(p: dict[str, Any], tenants: bool) -> list[dict[str, Any]]:
    return [{"key": f"sk-{u}", "user": u, "priority_class": "interactive",
             **({"tenant": t} if tenants else {})} for u, t in p["users"].items()]


def level_indices(served: dict[str, float], users: set[str], p: dict[str, Any]
                  ) -> tuple[float | None, float | None, dict[str, float]]:
    """(Jain's index over the backlogged tenants' service ÷ weight, the mean Jain's index
    among the backlogged users of each tenant with two or more, each tenant's share)."""
    by_tenant: dict[str, list[float]] = {}
    for user in sorted(users):
        by_tenant.setdefault(p["users"][user], []).append(served.get(user, 0.0))
    tenant_index = jain([sum(v) / p["tenants"][t] for t, v in sorted(by_tenant.items())])
    inner = [i for v in by_tenant.values() if len(v) > 1 and (i := jain(v)) is not None]
    total = sum(served.values())
    shares = {t: sum(s for u, s in served.items() if p["users"][u] == t) / total
              for t in p["tenants"]} if total else {}
    return tenant_index, (sum(inner) / len(inner) if inner else None), shares


def analyse_tenants(results: list[Result], start: float, p: dict[str, Any]) -> dict[str, Any]:
    windows = sliding_windows(start + p["warmup_s"], start + p["duration_s"], p["window_s"],
                              p["step_s"])
    tenant_series: list[float] = []
    user_series: list[float] = []
    shares: dict[str, list[float]] = {t: [] for t in p["tenants"]}
    for a, b in windows:
        t_index, u_index, share = level_indices(service_by_user(results, a, b, W_IN, W_OUT),
                                                backlogged(results, a, b), p)
        if t_index is not None:
            tenant_series.append(t_index)
        if u_index is not None:
            user_series.append(u_index)
        for t, s in share.items():
            shares[t].append(s)
    measured = (start + p["warmup_s"], start + p["duration_s"])

    def mean(xs: list[float]) -> float | None:
        return round(sum(xs) / len(xs), 4) if xs else None

    return {
        "windows": len(windows),
        "tenant_jain_mean": mean(tenant_series),
        "tenant_jain_min": round(min(tenant_series), 4) if tenant_series else None,
        "user_jain_mean": mean(user_series),
        "user_jain_min": round(min(user_series), 4) if user_series else None,
        "tenant_jain_series": [round(x, 4) for x in tenant_series],
        "user_jain_series": [round(x, 4) for x in user_series],
        "tenant_share_mean": {t: mean(s) for t, s in shares.items()},
        "service_by_user": {u: round(v) for u, v in sorted(
            service_by_user(results, *measured, W_IN, W_OUT).items())},
        "summary": summarize(results, measured),
    }


async def _measure_tenants(opts: Options, p: dict[str, Any], target: Target
                           ) -> dict[str, Any]:
    bar = progress(None, f"tenants {target.name}", opts.progress)
    results: list[Result] = []
    async with new_session() as session:
        start = time.perf_counter()
        await closed_loop(session, target, tenant_loop_users(p), p["duration_s"], bar,
                          sink=results)
    bar.close()
    return analyse_tenants(results, start, p)


async def run_tenants(opts: Options) -> dict[str, Any]:
    p = tenant_params(opts)
    users = [(u, "interactive") for u in p["users"]]
    tenants_cfg = {t: {"weight": w} for t, w in p["tenants"].items()}
    runs: dict[str, Any] = {}
    async with Bench(opts) as bench:
        async with bench.backend(TENANT_SIM, "sim-direct") as be:
            runs["direct"] = await _measure_tenants(opts, p, be.target())
        for phase in ("flat", "tenants"):
            async with bench.served(TENANT_SIM, f"sim-{phase}", users, f"gateway-{phase}",
                                    fairness="vtc", api_keys=tenant_keys(p, phase == "tenants"),
                                    tenants=tenants_cfg) as (be, gw):
                runs[phase] = await _measure_tenants(opts, p, gateway_target(gw, be, phase))
    d, f, g = runs["direct"], runs["flat"], runs["tenants"]
    weight_sum = sum(p["tenants"].values())
    headline = [
        report.Headline("Jain's index over tenants (service ÷ tenant weight), mean; "
                        "direct vs tenants", d["tenant_jain_mean"], g["tenant_jain_mean"],
                        None, "≥ 0.95", g["tenant_jain_mean"] is not None
                        and g["tenant_jain_mean"] >= 0.95),
        report.Headline("the same, gateway without tenants vs with", f["tenant_jain_mean"],
                        g["tenant_jain_mean"], None, "–", None),
        report.Headline("Jain's index over tenants, worst window; without vs with tenants",
                        f["tenant_jain_min"], g["tenant_jain_min"], None, "–", None),
        report.Headline("Jain's index among a tenant's users, mean; direct vs tenants",
                        d["user_jain_mean"], g["user_jain_mean"], None, "≥ 0.95",
                        g["user_jain_mean"] is not None and g["user_jain_mean"] >= 0.95),
    ]
    for t, w in p["tenants"].items():
        headline.append(report.Headline(
            f"{t}'s share of service (weight {w:g}, {sum(1 for x in p['users'].values() if x == t)}"
            " users); without vs with tenants", f["tenant_share_mean"].get(t),
            g["tenant_share_mean"].get(t), None, f"{w / weight_sum:.2f}", None))
    headline.append(report.Headline(
        "output tok/s; direct vs tenants (ratio = gateway ÷ direct)",
        d["summary"]["output_tok_s"], g["summary"]["output_tok_s"],
        round(g["summary"]["output_tok_s"] / d["summary"]["output_tok_s"], 3)
        if d["summary"]["output_tok_s"] else None, "–", None))
    fig, ax = report.figure("Jain's index over tenants (service ÷ weight), sliding windows",
                            "window", "Jain's index")
    for name in TENANT_PHASES:
        ax.plot(runs[name]["tenant_jain_series"], label=name)
    ax.axhline(0.95, color="red", linestyle=":", label="target 0.95")
    ax.set_ylim(0, 1.02)
    ax.legend()
    notes = ["Columns: 'direct' is the first phase named in the metric, 'gateway' the second."]
    return report.write(opts, "tenants", p, runs, headline,
                        {"tenants_jain.png": fig}, notes)
