"""``adapters``: LoRA placement (issue 27). 24 adapters with Zipf popularity from 12 users
on 4 simulated H100 backends with 2 adapter slots each (``--enable-lora --max-loras 2``,
runtime loading on, a load taking ``lora_load_s``), three placements in the same run,
each on fresh backends with no adapter loaded:

- **round_robin**: each request to the next backend in turn, its adapter loaded there
  when it is not (the least recently used adapter unloaded first when both slots are
  taken);
- **least_loaded**: each request to the backend with the fewest requests in flight, its
  adapter loaded there the same way ("always load where least loaded");
- **fairgate**: ``fairgate serve`` with the 24 adapters configured ``runtime: true``:
  resident first, a load only where an adapter is resident nowhere, the waiting adapter
  with the most demand first, no unload within the minimum residency (nine times the
  measured load; ``policies/adapters.py``, ``docs/adapters.md``).

**Why the baselines are a client-side router** (``loadtest/bench/lora_router.py``)
talking straight to the simulators, not a gateway setting: they are what a router
without a shared queue does in front of vLLM, and built into fairgate they would borrow
its fair queue, gates and pacing and be neither baseline. They would also need a
request pinned to the backend chosen for it, which fairgate's dispatch (a backend takes
work from its model's queue) does not have: a second dispatch path in the product, for a
benchmark only. As a client the router has every advantage a baseline can have: it is
the only sender, so its in-flight counts are exact (no scrape lag), it adds no hop, no
Redis and no process, and it keeps the same 2 adapters per backend with the same
endpoints, load time and idle-first LRU victim as fairgate. Every difference is then
placement and queueing, measured against fairgate where it pays a cost the router does
not. Jain's index is the one metric placement alone does not set: the baselines queue
first come first served in vLLM, fairgate in its fair queue (it is reported to show
that placement keeps the fair share, not as a placement result).

Workload: a closed loop per user; user ``u`` keeps ∝ 1/(u+1) requests in flight (48 in
all: u00 15 … u11 1), so the users' demand is skewed and every user is backlogged the
whole time. Each request names an adapter drawn from one Zipf law over the 24 (weight
1/rank), whoever sends it, so the mix of adapters served is the same under every
placement whatever order the users are served in.

Measured over the run after a warm-up: adapter loads (and unloads) per minute, from the
simulators' own counters (``/debug/state``); TTFT p50/p99 over all requests and over
those of the 5 least popular adapters (2 of 6 in a quick run; a request with no first
token when the run ends counts its wait so far, a lower bound, so a starved adapter is
not left out of its own percentile); output tokens/s; Jain's index of weighted service
(prompt × 1, output × 2, VTC's weights) over sliding windows among the users backlogged
for the whole window, as ``fairgate bench fairness`` measures it; requests failed (a 503
``adapter_not_loaded`` after ``adapter_load_wait_s``, a 404 after ``ATTEMPTS``
placements).

**Fleet-scope phase** (issue 27: a tenant sending to two models against a tenant on
one, token shares by weight within 5 %): :func:`fleet_scope`, the run of
``loadtest/bench/model_shares.py`` with ``fairness_scope: fleet`` and, for contrast,
``model``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from loadtest.bench import model_shares, report
from loadtest.bench.client import Result, Spec, Target, new_session, send
from loadtest.bench.env import MODEL, Bench, Options, api_keys, save_diagnostics
from loadtest.bench.loadgen import cancel_all, progress
from loadtest.bench.lora_router import POLICIES, Router, send_routed
from loadtest.bench.procs import GatewayStart, Proc, SimSpec, sim_fleet, start_gateway
from loadtest.bench.stats import (
    backlogged,
    jain,
    percentile,
    ratio,
    service_by_user,
    sliding_windows,
    tokens_in,
)

RUNS = (*POLICIES, "fairgate")
W_IN, W_OUT = 1.0, 2.0
LOAD_WAIT_S = 60.0  # fairgate's default adapter_load_wait_s
JAIN_TARGET = 0.95  # the house's fairness target (bench fairness)

Sender = Callable[[aiohttp.ClientSession, Spec, list[Result]], Awaitable[None]]


def params(opts: Options) -> dict[str, Any]:
    return {
        "backends": opts.pick(4, 2), "slots": 2, "adapters": opts.pick(24, 6),
        "users": opts.pick(12, 4), "zipf_s": 1.0,
        "cold": opts.pick(5, 2),  # the least popular adapters whose TTFT is reported apart
        "in_flight": opts.size or opts.pick(48, 8),
        "prompt_tokens": opts.pick(512, 128), "max_tokens": opts.pick(32, 16),
        "duration_s": opts.duration_s or opts.pick(90.0, 10.0),
        "warmup_s": opts.pick(15.0, 2.0),
        "jain_window_s": opts.pick(10.0, 3.0), "jain_step_s": opts.pick(1.0, 0.5),
        "weights": {"input": W_IN, "output": W_OUT},
        "sim": SimSpec(max_num_seqs=opts.pick(8, 4), max_loras=2,
                       lora_load_s=opts.pick(0.5, 0.2)).__dict__,
        "gateway": "defaults (the minimum residency from the measured load time); the "
                   "adapters runtime: true",
        # the fleet-scope phase (loadtest/bench/model_shares.py): requests of tenant a on
        # models x and y (cost factor y_factor), of tenant b on x
        "fleet_scope": {"y_factor": 0.5, "a_on_x": opts.pick(50, 20),
                        "a_on_y": opts.pick(120, 48), "b_on_x": opts.pick(100, 40)},
    }


def adapter_names(p: dict[str, Any]) -> list[str]:
    """The adapters, most popular first."""
    return [f"ad{k:02d}" for k in range(p["adapters"])]


def popularity(p: dict[str, Any]) -> list[float]:
    """Zipf weights of :func:`adapter_names` (1/rank^s)."""
    return [1.0 / (k + 1) ** p["zipf_s"] for k in range(p["adapters"])]


def in_flight(p: dict[str, Any]) -> dict[str, int]:
    """Requests each user keeps in flight: ∝ 1/(u+1), at least one."""
    weights = [1.0 / (u + 1) for u in range(p["users"])]
    return {f"u{u:02d}": max(1, round(p["in_flight"] * w / sum(weights)))
            for u, w in enumerate(weights)}


def path(adapter: str) -> str:
    return f"/adapters/{adapter}"


async def closed_loop(http: aiohttp.ClientSession, sender: Sender, p: dict[str, Any],
                      label: str, show: bool) -> tuple[list[Result], float]:
    """Every user's workers for ``duration_s`` (then what is in flight is cancelled);
    returns the results and the start time."""
    names, weights = adapter_names(p), popularity(p)
    results: list[Result] = []
    bar = progress(None, f"adapters {label}", show)
    start = time.perf_counter()
    deadline = start + p["duration_s"]

    async def worker(user: str, seed: int) -> None:
        rng = random.Random(seed)
        while time.perf_counter() < deadline:
            adapter = rng.choices(names, weights)[0]
            await sender(http, Spec(user, adapter, p["prompt_tokens"], p["max_tokens"]),
                         results)
            bar.update(1)

    seeds = itertools.count()
    tasks = [asyncio.create_task(worker(user, next(seeds)))
             for user, n in in_flight(p).items() for _ in range(n)]
    await asyncio.wait(tasks, timeout=p["duration_s"])
    await cancel_all(tasks)
    bar.close()
    return results, start


async def lora_counters(urls: list[str]) -> dict[str, int]:
    """Runtime loads and unloads so far, summed over the simulators."""
    totals = {"lora_loads": 0, "lora_unloads": 0}
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(url + "/debug/state") as resp:
                state = await resp.json()
            for key in totals:
                totals[key] += int(state[key])
    return totals


async def measured(http: aiohttp.ClientSession, sender: Sender, urls: list[str],
                   p: dict[str, Any], label: str, show: bool) -> dict[str, Any]:
    """One run: the closed loop, the simulators' counters at the warm-up's end and at the
    run's end, then its analysis."""
    counted: dict[str, dict[str, int]] = {}

    async def count_after_warmup() -> None:
        await asyncio.sleep(p["warmup_s"])
        counted["start"] = await lora_counters(urls)

    counter = asyncio.create_task(count_after_warmup())
    results, start = await closed_loop(http, sender, p, label, show)
    await counter
    counted["end"] = await lora_counters(urls)
    return analyse(results, start, counted, p)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def waits(results: list[Result], end: float) -> list[float]:
    """TTFT of each request that got a first token; the wait until ``end`` of each that was
    still waiting for one when the run was cancelled (a lower bound)."""
    out = []
    for r in results:
        if r.ttft is not None:
            out.append(r.ttft)
        elif r.error == "cancelled":
            out.append(min(r.end_s, end) - r.sent_s)
    return out


def analyse(results: list[Result], start: float, counted: dict[str, dict[str, int]],
            p: dict[str, Any]) -> dict[str, Any]:
    a, b = start + p["warmup_s"], start + p["duration_s"]
    minutes = (b - a) / 60.0
    sent = [r for r in results if a <= r.sent_s < b]
    cold = set(adapter_names(p)[-p["cold"]:])
    cold_sent = [r for r in sent if r.tag in cold]
    failed = [r for r in sent if not r.ok and r.error != "cancelled"]
    indices = []
    for lo, hi in sliding_windows(a, b, p["jain_window_s"], p["jain_step_s"]):
        users = backlogged(results, lo, hi)
        served = service_by_user(results, lo, hi, W_IN, W_OUT)
        index = jain([served.get(u, 0.0) for u in sorted(users)])
        if len(users) > 1 and index is not None:
            indices.append(index)
    by_adapter = {}
    for name in adapter_names(p):
        mine = [r for r in sent if r.tag == name]
        by_adapter[name] = {"sent": len(mine), "completed": sum(r.ok for r in mine),
                            "failed": sum(not r.ok and r.error != "cancelled" for r in mine),
                            "ttft_p50_ms": _ms(percentile(waits(mine, b), 50)),
                            "ttft_p99_ms": _ms(percentile(waits(mine, b), 99))}
    loads = counted["end"]["lora_loads"] - counted["start"]["lora_loads"]
    unloads = counted["end"]["lora_unloads"] - counted["start"]["lora_unloads"]
    return {
        "sent": len(sent), "completed": sum(r.ok for r in sent),
        "still_waiting_at_end": sum(r.error == "cancelled" and r.first_token_s is None
                                    for r in sent),
        "failed": len(failed), "error_sample": failed[0].error if failed else None,
        "window_s": round(b - a, 3),
        "loads": loads, "unloads": unloads,
        "loads_per_min": round(loads / minutes, 2), "unloads_per_min": round(unloads / minutes, 2),
        "loads_total": counted["end"]["lora_loads"],
        "ttft_p50_ms": _ms(percentile(waits(sent, b), 50)),
        "ttft_p99_ms": _ms(percentile(waits(sent, b), 99)),
        "cold_adapters": sorted(cold), "cold_sent": len(cold_sent),
        "cold_completed": sum(r.ok for r in cold_sent),
        "cold_failed": sum(not r.ok and r.error != "cancelled" for r in cold_sent),
        "cold_ttft_p50_ms": _ms(percentile(waits(cold_sent, b), 50)),
        "cold_ttft_p99_ms": _ms(percentile(waits(cold_sent, b), 99)),
        "output_tok_s": round(tokens_in(results, a, b) / (b - a), 2),
        "jain_mean": round(sum(indices) / len(indices), 4) if indices else None,
        "jain_min": round(min(indices), 4) if indices else None,
        "jain_windows": len(indices),
        "service_by_user": {u: round(v) for u, v in
                            sorted(service_by_user(results, a, b, W_IN, W_OUT).items())},
        "by_adapter": by_adapter,
    }


def sims(bench: Bench, p: dict[str, Any], label: str, gateway: GatewayStart | None = None
         ) -> contextlib.AbstractAsyncContextManager[list[Proc]]:
    """``backends`` fresh simulators, LoRA on, no adapter loaded, started side by side;
    with ``gateway`` (its start, given their URLs) the gateway after them, as the
    last process."""
    return sim_fleet(SimSpec(**p["sim"]), MODEL, bench.log_dir, label, p["backends"], gateway)


async def _baseline(bench: Bench, p: dict[str, Any], policy: str) -> dict[str, Any]:
    async with sims(bench, p, f"sim-{policy}") as procs, new_session() as http:
        urls = [proc.url for proc in procs]
        router = Router(policy, urls, p["slots"], {a: path(a) for a in adapter_names(p)}, http)

        async def sender(session: aiohttp.ClientSession, spec: Spec, sink: list[Result]
                         ) -> None:
            await send_routed(router, session, spec, sink)

        out = await measured(http, sender, urls, p, policy, bench.opts.progress)
        return {**out, "placed_again": router.replaced}


async def _fairgate(bench: Bench, p: dict[str, Any]) -> dict[str, Any]:
    async with aioredis.Redis.from_url(bench.redis_url) as client:
        await client.flushdb()

    def gateway(urls: list[str]) -> tuple[str, Coroutine[Any, Any, Proc]]:
        config = {
            "redis_url": bench.redis_url,
            "backends": [{"name": f"b{i}", "url": url, "model": MODEL}
                         for i, url in enumerate(urls)],
            "adapters": [{"name": a, "base_model": MODEL, "path": path(a), "runtime": True}
                         for a in adapter_names(p)],
            "api_keys": api_keys([(u, "interactive") for u in in_flight(p)]),
        }
        return "gateway-fairgate", start_gateway(config, bench.log_dir, "gateway-fairgate")

    async with sims(bench, p, "sim-fairgate", gateway) as started:
        *procs, gw = started
        urls = [proc.url for proc in procs]
        try:
            async def sender(session: aiohttp.ClientSession, spec: Spec, sink: list[Result]
                             ) -> None:
                await send(session, Target("fairgate", gw.url, spec.tag, True), spec, sink)

            async with new_session() as http:
                out = await measured(http, sender, urls, p, "fairgate", bench.opts.progress)
            await save_diagnostics(gw.url, bench.opts.out / "gateway_diagnostics.json",
                                   "fairgate")
        finally:
            gw.stop()
        return out


# ----------------------------------------------------------------------- fleet-scope phase
SHARE_TOLERANCE = 0.05  # of the fair share: a half within ± 0.025


async def fleet_scope(bench: Bench, p: dict[str, Any]) -> dict[str, Any]:
    """The fleet-scope phase (``loadtest/bench/model_shares.py``): a tenant sending to two
    models against a tenant on one, their token shares by weight with ``fairness_scope:
    fleet`` (target: each within 5 % of a half) and, for contrast, ``model``; each on an
    emptied Redis."""
    out = {}
    for scope in ("fleet", "model"):
        async with aioredis.Redis.from_url(bench.redis_url) as client:
            await client.flushdb()
        shares = await model_shares.run_phase(bench.redis_url, scope, **p["fleet_scope"])
        out[scope] = shares.report()
    return out


# ------------------------------------------------------------------------------- report
COMPARED = (("adapter loads per minute", "loads_per_min"),
            ("adapter unloads per minute", "unloads_per_min"),
            ("TTFT p50 (ms)", "ttft_p50_ms"), ("TTFT p99 (ms)", "ttft_p99_ms"),
            ("TTFT p50 of the coldest adapters (ms)", "cold_ttft_p50_ms"),
            ("TTFT p99 of the coldest adapters (ms)", "cold_ttft_p99_ms"),
            ("output tok/s", "output_tok_s"),
            ("Jain's index over users (window mean)", "jain_mean"),
            ("requests failed", "failed"))


def headline(p: dict[str, Any], runs: dict[str, Any]) -> list[report.Headline]:
    """Each metric against each baseline (direct = the baseline, gateway = fairgate,
    ratio = fairgate ÷ baseline), then fairgate's own targets."""
    fg = runs["fairgate"]
    rows = []
    for label, key in COMPARED:
        for policy in POLICIES:
            base = runs[policy]
            target, met = "–", None
            if key == "loads_per_min":  # issue 27: placement must not thrash
                target = "< baseline (no thrash)"
                met = None if fg[key] is None else fg[key] < base[key]
            named = label.replace("the coldest", f"the {p['cold']} coldest")
            rows.append(report.Headline(f"{named}, vs {policy}", base[key], fg[key],
                                        ratio(fg[key], base[key]), target, met))
    cold_p99 = fg["cold_ttft_p99_ms"]
    rows += [
        report.Headline(f"fairgate: requests failed (of {fg['sent']} sent)", None,
                        fg["failed"], None, "0", fg["failed"] == 0),
        report.Headline(f"fairgate: requests of the {p['cold']} coldest adapters failed (of "
                        f"{fg['cold_sent']} sent)", None, fg["cold_failed"], None,
                        "0 (no starvation)", fg["cold_failed"] == 0),
        report.Headline(f"fairgate: TTFT p99 of the {p['cold']} coldest adapters (ms)", None,
                        cold_p99, None, f"≤ {LOAD_WAIT_S * 1000:,.0f} (bounded wait)",
                        None if cold_p99 is None else cold_p99 <= LOAD_WAIT_S * 1000),
        report.Headline("fairgate: Jain's index over users (window mean)", None,
                        fg["jain_mean"], None, f"≥ {JAIN_TARGET}",
                        None if fg["jain_mean"] is None else fg["jain_mean"] >= JAIN_TARGET),
    ]
    shares = {scope: runs["fleet_scope"][scope]["shares"].get("a")
              for scope in ("fleet", "model")}
    fleet = shares["fleet"]
    rows.append(report.Headline(
        "tenant a's token share by weight on two models vs tenant b on one: fairness_scope "
        "model (direct column) vs fleet", shares["model"], fleet, None,
        f"fleet: 0.5 ± {0.5 * SHARE_TOLERANCE:g}",
        None if fleet is None else abs(fleet - 0.5) <= 0.5 * SHARE_TOLERANCE))
    return rows
    return rows


def runs_table(runs: dict[str, Any]) -> str:
    """The three placements side by side, fairgate with its ratio to each baseline."""
    def cell(value: Any) -> str:
        if value is None:
            return "–"
        return f"{value:,.3f}" if isinstance(value, float) and value < 10 else f"{value:,.0f}"

    lines = ["| metric | round_robin | least_loaded | fairgate | ÷ round_robin | "
             "÷ least_loaded |", "|---|---:|---:|---:|---:|---:|"]
    for label, key in COMPARED:
        values = [runs[name][key] for name in RUNS]
        ratios = [ratio(runs["fairgate"][key], runs[policy][key]) for policy in POLICIES]
        lines.append(f"| {label} | " + " | ".join(cell(v) for v in values) + " | "
                     + " | ".join("–" if r is None else f"{r:.2f}×" for r in ratios) + " |")
    return "\n".join(lines)


def plots(p: dict[str, Any], runs: dict[str, Any]) -> dict[str, Any]:
    names = adapter_names(p)
    fig, ax = report.figure("TTFT p99 by adapter popularity (a starved request counts its "
                            "wait)", "adapter (most popular first)", "TTFT p99 (ms)")
    for run in RUNS:
        ax.plot(range(1, len(names) + 1),
                [runs[run]["by_adapter"][n]["ttft_p99_ms"] for n in names], "-o",
                markersize=3, label=run)
    ax.set_yscale("log")
    ax.legend()
    fig2, ax2 = report.figure("Adapter loads per minute", "placement", "loads / min")
    ax2.bar(list(RUNS), [runs[run]["loads_per_min"] for run in RUNS])
    return {"adapters_ttft_by_rank.png": fig, "adapters_loads.png": fig2}


async def run(opts: Options) -> dict[str, Any]:
    if opts.backend:
        raise SystemExit("bench adapters runs its own simulated backends (no --backend)")
    p = params(opts)
    p["in_flight_by_user"] = in_flight(p)
    runs: dict[str, Any] = {}
    async with Bench(opts) as bench:
        for policy in POLICIES:
            runs[policy] = await _baseline(bench, p, policy)
        runs["fairgate"] = await _fairgate(bench, p)
        runs["fleet_scope"] = await fleet_scope(bench, p)
    notes = ["Columns: **direct** = the baseline the row names (a client-side router "
             "straight to the simulators), **gateway** = fairgate, ratio = fairgate ÷ "
             "baseline. A request with no first token when the run ended counts its wait "
             "so far in the TTFT percentiles (a lower bound).", runs_table(runs)]
    return report.write(opts, "adapters", p, runs, headline(p, runs), plots(p, runs), notes)
