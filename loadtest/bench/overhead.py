"""``overhead``: what the gateway itself costs, on the zero-cost ``instant`` profile.

Processes: the simulator in one process, ``fairgate serve`` in another, the load
generator in this one (plus Valkey), so the client never shares a GIL with the gateway.
Open-loop (evenly spaced) runs at fixed rates give the added latency; closed-loop runs
give the maximum sustainable req/s, with default gates and with the waiting gate opened
wide (``max_waiting`` 100000) to separate the process's capacity from pacing.

Each run also records the gateway's CPU per request (CPU seconds of the gateway's
processes ÷ requests sent), how that CPU splits over its processes, and the Redis
commands and round trips per request (from its ``/metrics``, background loops included).
The gateway phases run one worker (``fairgate serve --workers 1``); with ``--workers N``
(N > 1) a last phase runs N workers with the gate wide open, for the max req/s of a host.

The floor under those numbers is measured in the same run: the backend's own CPU per
request (direct), and a bare aiohttp reverse proxy (:mod:`loadtest.bench.bare_proxy`: the
client's request relayed to the backend and its stream back, nothing else) at the same
rates and wide open. fairgate's own cost is what it costs above the bare proxy.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench import report
from loadtest.bench.client import Result, Spec, Target, new_session
from loadtest.bench.env import Bench, Options, gateway_target
from loadtest.bench.loadgen import LoopUser, closed_loop, open_loop, progress
from loadtest.bench.procs import Proc, SimSpec, start_bare_proxy
from loadtest.bench.stats import ratio, summarize

SIM = SimSpec(profile="instant", max_num_seqs=1024, max_num_batched_tokens=8192)
CPU_MS_PER_REQ_TARGET = 0.7  # issue 24, at 100 req/s; background loops included
LITELLM_NOTE = ("LiteLLM publishes 12 ms median added latency at ~1,000 RPS (proxy on two "
                "4-CPU instances, its own benchmark with a mock backend).")


def params(opts: Options) -> dict[str, Any]:
    return {
        "rates": opts.pick([100, 500], [20, 50]),
        "duration_s": opts.duration_s or opts.pick(6.0, 1.0),
        "max_concurrency": opts.size or opts.pick(64, 8),
        "prompt_tokens": 16, "max_tokens": 8, "users": 64, "sim": SIM.__dict__,
        "processes": "sim, gateway, load generator: three processes (+ Valkey) on this machine",
        "workers": opts.workers,
    }


async def _gateway_counts(url: str) -> dict[str, float]:
    """Redis commands and round trips the gateway sent so far (every worker's)."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    counts = {"commands": 0.0, "round_trips": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "fairgate_redis_commands_total":
                counts["commands"] += sample.value
            elif sample.name == "fairgate_redis_command_duration_seconds_count":
                counts["round_trips"] += sample.value
    return counts


async def _measured(proc: Proc | None, work: Callable[[], Awaitable[list[Result]]],
                    backend: Proc | None = None, gateway_url: str | None = None
                    ) -> tuple[list[Result], dict[str, Any]]:
    cpu0 = proc.cpu_split() if proc else {}
    sim0 = backend.cpu_seconds() if backend else 0.0
    counts0 = await _gateway_counts(gateway_url) if gateway_url else {}
    own0, wall0 = time.process_time(), time.perf_counter()
    results = await work()
    wall = time.perf_counter() - wall0
    cpu: dict[str, Any] = {"wall_s": round(wall, 3),
                           "loadgen_cores": round((time.process_time() - own0) / wall, 3)}
    if backend is not None:
        cpu["backend_cores"] = round((backend.cpu_seconds() - sim0) / wall, 3)
    if proc is not None:
        cpu1 = proc.cpu_split()
        used = {pid: cpu1[pid] - cpu0.get(pid, 0.0) for pid in cpu1}
        cpu["process_cores"] = round(sum(used.values()) / wall, 3)
        cpu["process_cpu_ms_per_req"] = round(sum(used.values()) * 1000 / max(1, len(results)),
                                              4)
        if len(used) > 1:  # supervisor first, then each worker
            cpu["process_split_cores"] = [round(used[pid] / wall, 3) for pid in sorted(used)]
    if gateway_url:
        counts1 = await _gateway_counts(gateway_url)
        for name in ("commands", "round_trips"):
            cpu[f"redis_{name}_per_req"] = round(
                (counts1[name] - counts0[name]) / max(1, len(results)), 2)
    return results, cpu


async def _suite(opts: Options, p: dict[str, Any], target: Target, proc: Proc | None,
                 rates: list[int], backend: Proc | None = None) -> dict[str, Any]:
    specs = [Spec(f"u{i:02d}", "probe", p["prompt_tokens"], p["max_tokens"])
             for i in range(p["users"])]
    spec = specs[0]
    gateway_url = target.url if target.via_gateway else None
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

            results, cpu = await _measured(proc, open_run, backend, gateway_url)
            bar.close()
            out[f"rate_{rate}"] = {**summarize(results), "cpu": cpu}
        bar = progress(None, f"overhead {target.name} max", opts.progress)

        def closed_run() -> Awaitable[list[Result]]:
            per_user = max(1, p["max_concurrency"] // len(specs))
            users = [LoopUser(s, per_user) for s in specs[: p["max_concurrency"]]]
            return closed_loop(session, target, users, p["duration_s"], bar)

        results, cpu = await _measured(proc, closed_run, backend, gateway_url)
        bar.close()
        out["max"] = {**summarize(results), "cpu": cpu}
    return out


def _headline(p: dict[str, Any], runs: dict[str, Any]) -> list[report.Headline]:
    d, g, w = runs["direct"], runs["gateway"], runs["gateway_wide"]
    rows = []
    for rate in p["rates"]:
        key = f"rate_{rate}"
        for q, bound in (("p50", 1.0), ("p99", 10.0)):
            dv, gv = d[key]["e2e_ms"][q], g[key]["e2e_ms"][q]
            added = None if dv is None or gv is None else round(gv - dv, 3)
            at_500 = rate == 500
            rows.append(report.Headline(
                f"E2E {q} at {rate} req/s (ms); ratio column = added ms", dv, gv, added,
                f"added ≤ {bound:g} ms" if at_500 else "–",
                (added <= bound) if at_500 and added is not None else None))
        rows.append(report.Headline(f"achieved req/s at {rate} req/s offered", d[key]["req_s"],
                                    g[key]["req_s"], ratio(g[key]["req_s"], d[key]["req_s"]),
                                    "–", None))
        cpu_ms = g[key]["cpu"].get("process_cpu_ms_per_req")
        rows.append(report.Headline(
            f"gateway CPU per request at {rate} req/s (ms)", None, cpu_ms, None,
            f"≤ {CPU_MS_PER_REQ_TARGET:g} ms",
            None if cpu_ms is None else cpu_ms <= CPU_MS_PER_REQ_TARGET))
        rows.append(report.Headline(
            f"Redis commands / round trips per request at {rate} req/s", None,
            g[key]["cpu"].get("redis_commands_per_req"),
            g[key]["cpu"].get("redis_round_trips_per_req"), "– (ratio column: round trips)",
            None))
    best = max(g["max"]["req_s"], w["max"]["req_s"])
    rows.append(report.Headline("max req/s, closed loop, one worker (default gates)",
                                d["max"]["req_s"], g["max"]["req_s"],
                                ratio(g["max"]["req_s"], d["max"]["req_s"]),
                                "≥ 0.5 of direct", g["max"]["req_s"] >= 0.5 * d["max"]["req_s"]))
    rows.append(report.Headline("max req/s, closed loop, one worker (waiting gate wide open)",
                                d["max"]["req_s"], w["max"]["req_s"],
                                ratio(w["max"]["req_s"], d["max"]["req_s"]),
                                "≥ 0.5 of direct", best >= 0.5 * d["max"]["req_s"]))
    rows += _floor_rows(p, runs)
    cores = w["max"]["cpu"].get("process_cores") or 0.0
    per_core = round(w["max"]["req_s"] / cores, 1) if cores else None
    rows.append(report.Headline("gateway req/s per busy core (wide-open run)", None, per_core,
                                None, "–", None))
    many = runs.get("gateway_workers")
    if many is not None:
        n = p["workers"]
        cpu = many["max"]["cpu"]
        rows.append(report.Headline(
            f"max req/s, closed loop, --workers {n} (wide open); CPU split: workers "
            f"{' + '.join(str(c) for c in cpu.get('process_split_cores', [])[1:])} cores, "
            f"backend {cpu.get('backend_cores')}, load generator {cpu.get('loadgen_cores')}",
            d["max"]["req_s"], many["max"]["req_s"],
            ratio(many["max"]["req_s"], d["max"]["req_s"]), "≥ one worker (wide open)",
            many["max"]["req_s"] >= w["max"]["req_s"]))
        for rate in p["rates"]:
            key = f"rate_{rate}"
            dv, gv = d[key]["e2e_ms"]["p50"], many[key]["e2e_ms"]["p50"]
            rows.append(report.Headline(
                f"--workers {n}: E2E p50 at {rate} req/s (ms); ratio column = added ms", dv, gv,
                None if dv is None or gv is None else round(gv - dv, 3), "–", None))
    return rows


def _floor_rows(p: dict[str, Any], runs: dict[str, Any]) -> list[report.Headline]:
    """The floor under the targets: what the backend itself and a bare aiohttp proxy
    (:mod:`loadtest.bench.bare_proxy`) cost on this machine in the same run."""
    d, b, w = runs["direct"], runs.get("bare_proxy"), runs["gateway_wide"]
    if b is None:
        return []
    rows = []
    for rate in p["rates"]:
        key = f"rate_{rate}"
        sim_ms = d[key]["cpu"].get("process_cpu_ms_per_req")
        bare_ms = b[key]["cpu"].get("process_cpu_ms_per_req")
        gw_ms = runs["gateway"][key]["cpu"].get("process_cpu_ms_per_req")
        rows.append(report.Headline(
            f"floor: CPU per request at {rate} req/s (ms), backend alone (direct column) / bare "
            "aiohttp proxy (fairgate column); ratio column = fairgate ÷ bare proxy",
            sim_ms, bare_ms, ratio(gw_ms, bare_ms), "–", None))
    rows.append(report.Headline(
        "floor: max req/s, closed loop, bare aiohttp proxy; ratio column = fairgate one "
        "worker (wide open) ÷ bare proxy", d["max"]["req_s"], b["max"]["req_s"],
        ratio(w["max"]["req_s"], b["max"]["req_s"]), "–", None))
    return rows


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    runs: dict[str, Any] = {}
    async with Bench(opts) as bench, bench.backend(SIM, "sim") as be:
        runs["direct"] = await _suite(opts, p, be.target(), be.proc, p["rates"])  # sim's CPU
        bare = await start_bare_proxy(be.url, bench.log_dir, "bare-proxy")
        try:
            runs["bare_proxy"] = await _suite(
                opts, p, Target("bare proxy", bare.url, be.model, via_gateway=False), bare,
                p["rates"], be.proc)
        finally:
            bare.stop()
        users = [(f"u{i:02d}", "interactive") for i in range(p["users"])]
        async with bench.gateway(be, users, "gateway", 1) as gw:
            runs["gateway"] = await _suite(opts, p, gateway_target(gw, be), gw, p["rates"],
                                           be.proc)
        wide = {"classes": {"interactive": {"max_waiting": 100_000}}}
        async with bench.gateway(be, users, "gateway-wide", 1, **wide) as gw:
            runs["gateway_wide"] = await _suite(opts, p, gateway_target(gw, be, "wide"), gw,
                                                [], be.proc)
        if p["workers"] > 1:
            async with bench.gateway(be, users, "gateway-workers", p["workers"], **wide) as gw:
                runs["gateway_workers"] = await _suite(
                    opts, p, gateway_target(gw, be, f"workers{p['workers']}"), gw, p["rates"],
                    be.proc)
    fig, ax = report.figure("Gateway overhead (instant backend)", "offered req/s",
                            "E2E latency (ms)")
    for name in ("direct", "gateway"):
        for q, style in (("p50", "-o"), ("p99", "--s")):
            ys = [runs[name][f"rate_{r}"]["e2e_ms"][q] for r in p["rates"]]
            ax.plot(p["rates"], ys, style, label=f"{name} {q}")
    ax.legend()
    return report.write(opts, "overhead", p, runs, _headline(p, runs),
                        {"overhead_latency.png": fig}, notes=[LITELLM_NOTE])
