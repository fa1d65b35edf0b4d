"""``overhead``: what the gateway itself costs, on the zero-cost ``instant`` profile.

Processes: the simulator in one process, ``fairgate serve`` in another, the load
generator in this one (plus Valkey), so the client never shares a GIL with the gateway.
Open-loop (evenly spaced) runs at fixed rates give the added latency; closed-loop runs
give the maximum sustainable req/s, with default gates and with the waiting gate opened
wide (``max_waiting`` 100000) to separate the process's capacity from pacing.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from loadtest.bench import report
from loadtest.bench.client import Result, Spec, Target, new_session
from loadtest.bench.env import Bench, Options, gateway_target
from loadtest.bench.loadgen import LoopUser, closed_loop, open_loop, progress
from loadtest.bench.procs import Proc, SimSpec
from loadtest.bench.stats import ratio, summarize

SIM = SimSpec(profile="instant", max_num_seqs=1024, max_num_batched_tokens=8192)
LITELLM_NOTE = ("LiteLLM publishes 12 ms median added latency at ~1,000 RPS (proxy on two "
                "4-CPU instances, its own benchmark with a mock backend).")


def params(opts: Options) -> dict[str, Any]:
    return {
        "rates": opts.pick([100, 500], [20, 50]),
        "duration_s": opts.duration_s or opts.pick(6.0, 1.0),
        "max_concurrency": opts.size or opts.pick(64, 8),
        "prompt_tokens": 16, "max_tokens": 8, "users": 64, "sim": SIM.__dict__,
        "processes": "sim, gateway, load generator: three processes (+ Valkey) on this machine",
    }


async def _measured(proc: Proc | None, work: Callable[[], Awaitable[list[Result]]]
                    ) -> tuple[list[Result], dict[str, float]]:
    cpu0 = proc.cpu_seconds() if proc else 0.0
    own0, wall0 = time.process_time(), time.perf_counter()
    results = await work()
    wall = time.perf_counter() - wall0
    cpu = {"wall_s": round(wall, 3),
           "loadgen_cores": round((time.process_time() - own0) / wall, 3)}
    if proc is not None:
        cpu["process_cores"] = round((proc.cpu_seconds() - cpu0) / wall, 3)
    return results, cpu


async def _suite(opts: Options, p: dict[str, Any], target: Target, proc: Proc | None,
                 rates: list[int]) -> dict[str, Any]:
    specs = [Spec(f"u{i:02d}", "probe", p["prompt_tokens"], p["max_tokens"])
             for i in range(p["users"])]
    spec = specs[0]
    out: dict[str, Any] = {}
    async with new_session() as session:
        # warm the connection pool and the gateway's code paths
        await closed_loop(session, target, [LoopUser(spec, 4)], 0.5,
                          progress(None, "warmup", False))
        for rate in rates:
            total = int(rate * p["duration_s"])
            bar = progress(total, f"overhead {target.name} {rate}/s", opts.progress)

            def make(i: int) -> Spec:
                return specs[i % len(specs)]

            def open_run(rate: int = rate, bar: Any = bar) -> Awaitable[list[Result]]:
                return open_loop(session, target, make, rate, p["duration_s"], bar,
                                 poisson=False)

            results, cpu = await _measured(proc, open_run)
            bar.close()
            out[f"rate_{rate}"] = {**summarize(results), "cpu": cpu}
        bar = progress(None, f"overhead {target.name} max", opts.progress)

        def closed_run() -> Awaitable[list[Result]]:
            per_user = max(1, p["max_concurrency"] // len(specs))
            users = [LoopUser(s, per_user) for s in specs[: p["max_concurrency"]]]
            return closed_loop(session, target, users, p["duration_s"], bar)

        results, cpu = await _measured(proc, closed_run)
        bar.close()
        out["max"] = {**summarize(results), "cpu": cpu}
    return out


def _headline(p: dict[str, Any], runs: dict[str, Any]) -> list[report.Headline]:
    d, g, w = runs["direct"], runs["gateway"], runs["gateway_wide"]
    rows = []
    for rate in p["rates"]:
        key = f"rate_{rate}"
        for q in ("p50", "p99"):
            dv, gv = d[key]["e2e_ms"][q], g[key]["e2e_ms"][q]
            added = None if dv is None or gv is None else round(gv - dv, 3)
            met = None
            if q == "p50" and rate == 500 and added is not None:
                met = added <= 2.0
            rows.append(report.Headline(
                f"E2E {q} at {rate} req/s (ms); ratio column = added ms", dv, gv, added,
                "added p50 ≤ 2 ms at 500 req/s" if q == "p50" and rate == 500 else "–", met))
        rows.append(report.Headline(f"achieved req/s at {rate} req/s offered", d[key]["req_s"],
                                    g[key]["req_s"], ratio(g[key]["req_s"], d[key]["req_s"]),
                                    "–", None))
    best = max(g["max"]["req_s"], w["max"]["req_s"])
    rows.append(report.Headline("max req/s, closed loop (default gates)", d["max"]["req_s"],
                                g["max"]["req_s"], ratio(g["max"]["req_s"], d["max"]["req_s"]),
                                "≥ 1,000 req/s per process", g["max"]["req_s"] >= 1000))
    rows.append(report.Headline("max req/s, closed loop (waiting gate wide open)",
                                d["max"]["req_s"], w["max"]["req_s"],
                                ratio(w["max"]["req_s"], d["max"]["req_s"]),
                                "≥ 1,000 req/s per process", best >= 1000))
    cores = w["max"]["cpu"].get("process_cores") or 0.0
    per_core = round(w["max"]["req_s"] / cores, 1) if cores else None
    rows.append(report.Headline("gateway req/s per busy core (wide-open run)", None, per_core,
                                None, "–", None))
    return rows


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    runs: dict[str, Any] = {}
    async with Bench(opts) as bench, bench.backend(SIM, "sim") as be:
        runs["direct"] = await _suite(opts, p, be.target(), be.proc, p["rates"])
        users = [(f"u{i:02d}", "interactive") for i in range(p["users"])]
        async with bench.gateway(be, users, "gateway") as gw:
            runs["gateway"] = await _suite(opts, p, gateway_target(gw, be), gw, p["rates"])
        wide = {"classes": {"interactive": {"max_waiting": 100_000}}}
        async with bench.gateway(be, users, "gateway-wide", **wide) as gw:
            runs["gateway_wide"] = await _suite(opts, p, gateway_target(gw, be, "wide"), gw,
                                                [])
    fig, ax = report.figure("Gateway overhead (instant backend)", "offered req/s",
                            "E2E latency (ms)")
    for name in ("direct", "gateway"):
        for q, style in (("p50", "-o"), ("p99", "--s")):
            ys = [runs[name][f"rate_{r}"]["e2e_ms"][q] for r in p["rates"]]
            ax.plot(p["rates"], ys, style, label=f"{name} {q}")
    ax.legend()
    return report.write(opts, "overhead", p, runs, _headline(p, runs),
                        {"overhead_latency.png": fig}, notes=[LITELLM_NOTE])
