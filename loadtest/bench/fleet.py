"""``fleet``: the gateway's own cost at fleet size, by the number of gateway replicas.

Processes: ``--size`` (default 32) ``instant``-profile simulators in one process
(``fairgate sim --count N --metrics gateway``, each its own port and /metrics showing only
the samples fairgate reads: vLLM's whole text costs the simulator ~5 ms a scrape, and 32
of them scraped up to 10 times a second would take more than this machine's two cores,
so the bench measured the simulators' contention, not the gateway), 1, 2 and 4 gateway replicas
(``fairgate serve --workers 1`` each, all backends in every config, one Redis), the load
generator in this one. For each replica count:

- **idle** (no traffic, ``idle_s``): CPU of each gateway process from /proc ticks over
  the window, per backend (% of a core), and the scrapes each backend answered per second
  (counted by the simulator, ``/debug/state``);
- **load** (open loop at a fixed rate, spread evenly over the replicas): gateway CPU per
  request, scrapes per backend per second, dispatch decisions per second (every replica's
  ``fairgate_dispatches_total``), and the published snapshots' age (now - ``taken_at`` of
  every ``bk:<backend>:snap`` in Redis, sampled every 50 ms) at p50/p99;
- in both: the simulators' CPU and the machine's busy share (``/proc/stat``): where the
  machine is saturated, the latencies are not the gateway's alone; Redis's script calls
  (every replica's decisions, settles, heartbeats, lease ticks) and command time
  (``INFO commandstats``), per second and, under load, per request; and every replica's
  Redis calls by script or command (their ``fairgate_redis_commands_total``), which tell
  whether a request's Redis work grows with the replicas.

Targets (issue "the gateway's own cost at fleet size"): idle CPU ≤ 1 % of a core per
backend per gateway process; scrapes per backend per second ≤ 1.2 / ``scrape_interval_s``
whatever the replica count.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench import report
from loadtest.bench.client import Spec, Target, new_session
from loadtest.bench.env import MODEL, Bench, Options, api_keys
from loadtest.bench.loadgen import open_loop, progress
from loadtest.bench.procs import Proc, SimSpec, start_gateway, start_sims
from loadtest.bench.stats import percentile, summarize

SCRAPE_INTERVAL_S = 0.1  # the default setting
SIM = SimSpec(profile="instant", max_num_seqs=1024, max_num_batched_tokens=8192,
              metrics="gateway")
USERS = 16


def params(opts: Options) -> dict[str, Any]:
    return {
        "backends": opts.size or opts.pick(32, 4),
        "replicas": opts.pick([1, 2, 4], [1, 2]),
        "idle_s": opts.duration_s or opts.pick(20.0, 1.5),
        "load_s": opts.duration_s or opts.pick(10.0, 1.5),
        "rate": opts.pick(100, 20),
        "prompt_tokens": 16, "max_tokens": 8, "scrape_interval_s": SCRAPE_INTERVAL_S,
        "processes": "simulators: one process; each gateway replica: one process "
                     "(--workers 1); load generator: this process; Valkey",
    }


async def scrapes(http: aiohttp.ClientSession, urls: list[str]) -> list[int]:
    async def one(url: str) -> int:
        async with http.get(url + "/debug/state") as resp:
            return int((await resp.json())["scrapes"])
    return list(await asyncio.gather(*(one(u) for u in urls)))


LAG = "fairgate_event_loop_lag_seconds"


@dataclass
class GatewayCounts:
    """One replica's counts so far, from its /metrics: dispatches, decisions on a stale
    snapshot, and its event-loop lag histogram (probes, their summed lag, and each bucket's
    cumulative count by bound)."""

    dispatches: float = 0.0
    stale_views: float = 0.0  # decisions made on gates two snapshots old (admitted nothing)
    probes: float = 0.0
    lag_s: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)
    commands: dict[str, float] = field(default_factory=dict)  # Redis calls: script or command


async def gateway_counts(http: aiohttp.ClientSession, gateways: list[Proc]
                         ) -> list[GatewayCounts]:
    out = []
    for gw in gateways:
        async with http.get(gw.url + "/metrics") as resp:
            text = await resp.text()
        got = GatewayCounts()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "fairgate_dispatches_total":
                    got.dispatches += sample.value
                elif sample.name == "fairgate_dispatch_stale_view_total":
                    got.stale_views += sample.value
                elif sample.name == LAG + "_bucket":
                    got.buckets[float(sample.labels["le"])] = sample.value
                elif sample.name == LAG + "_count":
                    got.probes = sample.value
                elif sample.name == LAG + "_sum":
                    got.lag_s = sample.value
                elif sample.name == "fairgate_redis_commands_total":
                    name = sample.labels.get("script") or sample.labels.get("command", "?")
                    got.commands[name] = got.commands.get(name, 0.0) + sample.value
        out.append(got)
    return out


def loop_lag(before: GatewayCounts, after: GatewayCounts) -> dict[str, float | None]:
    """One replica's event-loop lag over a window: the mean and the p99 (the upper bound
    of the bucket that holds it), in ms."""
    probes = after.probes - before.probes
    if probes <= 0:
        return {"mean_ms": None, "p99_ms": None}
    p99 = next((bound for bound, count in sorted(after.buckets.items())
                if count - before.buckets.get(bound, 0.0) >= 0.99 * probes), None)
    return {"mean_ms": round((after.lag_s - before.lag_s) / probes * 1000, 2),
            "p99_ms": None if p99 is None or p99 == float("inf") else round(p99 * 1000, 1)}


async def snapshot_ages(client: aioredis.Redis, backends: int, stop: asyncio.Event,
                        ages: list[float]) -> None:
    keys = [f"fg:{{{MODEL}}}:bk:b{i}:snap" for i in range(backends)]
    while not stop.is_set():
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, "taken_at")
        now = time.time()
        ages += [now - float(t) for t in await pipe.execute() if t]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)


async def redis_work(client: aioredis.Redis) -> tuple[int, int]:
    """Script calls (EVAL, EVALSHA) and microseconds of command time Redis has counted
    (``INFO commandstats``)."""
    stats = await client.info("commandstats")
    scripts = sum(int(v["calls"]) for k, v in stats.items()
                  if k in ("cmdstat_evalsha", "cmdstat_eval"))
    return scripts, sum(int(v["usec"]) for v in stats.values())


def machine_ticks() -> tuple[int, int]:
    """All CPU ticks of the machine so far, and the idle ones (``/proc/stat``)."""
    with open("/proc/stat") as handle:
        ticks = [int(x) for x in handle.readline().split()[1:]]
    return sum(ticks), ticks[3] + ticks[4]


async def _measured(http: aiohttp.ClientSession, client: aioredis.Redis,
                    gateways: list[Proc], sims: Proc, urls: list[str],
                    window: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Run ``window()``; the gateway CPU, scrapes, dispatches and Redis work over it."""
    cpu0, sims0, (all0, idle0) = [g.cpu_seconds() for g in gateways], sims.cpu_seconds(), \
        machine_ticks()
    s0, g0 = await scrapes(http, urls), await gateway_counts(http, gateways)
    (scripts0, usec0) = await redis_work(client)
    start = time.perf_counter()
    out: dict[str, Any] = await window()
    wall = time.perf_counter() - start
    cpu = [g.cpu_seconds() - c for g, c in zip(gateways, cpu0, strict=True)]
    sims_s, (all1, idle1) = sims.cpu_seconds() - sims0, machine_ticks()
    s1, g1 = await scrapes(http, urls), await gateway_counts(http, gateways)
    d0, d1 = sum(g.dispatches for g in g0), sum(g.dispatches for g in g1)
    calls: dict[str, float] = {}
    for before, after in zip(g0, g1, strict=True):
        for name, n in after.commands.items():
            calls[name] = calls.get(name, 0.0) + n - before.commands.get(name, 0.0)
    scripts1, usec1 = await redis_work(client)
    per_backend = [(b - a) / wall for a, b in zip(s0, s1, strict=True)]
    return {**out, "wall_s": round(wall, 3),
            "gateway_cores": [round(c / wall, 4) for c in cpu],
            "cpu_s": round(sum(cpu), 4),
            "scrapes_per_backend_s": {"mean": round(sum(per_backend) / len(per_backend), 3),
                                      "max": round(max(per_backend), 3)},
            "dispatches_per_s": round((d1 - d0) / wall, 2),
            # every replica's Redis calls by script (or plain command), per second
            "redis_calls_per_s": {name: round(n / wall, 1) for name, n in
                                  sorted(calls.items(), key=lambda kv: -kv[1]) if n > 0},
            "stale_views_per_s": round((sum(g.stale_views for g in g1)
                                        - sum(g.stale_views for g in g0)) / wall, 2),
            "loop_lag": [loop_lag(a, b) for a, b in zip(g0, g1, strict=True)],
            "redis_scripts_per_s": round((scripts1 - scripts0) / wall, 1),
            "redis_busy": round((usec1 - usec0) / 1e6 / wall, 4),
            "simulator_cores": round(sims_s / wall, 3),
            "machine_busy": round(1 - (idle1 - idle0) / max(1, all1 - all0), 3)}


async def _phase(opts: Options, p: dict[str, Any], bench: Bench, sims: Proc,
                 urls: list[str], replicas: int) -> dict[str, Any]:
    n = p["backends"]
    config = {"redis_url": bench.redis_url,
              "backends": [{"name": f"b{i}", "url": u, "model": MODEL}
                           for i, u in enumerate(urls)],
              "api_keys": api_keys([(f"u{i:02d}", "interactive") for i in range(USERS)]),
              "scrape_interval_s": p["scrape_interval_s"]}
    async with aioredis.Redis.from_url(bench.redis_url, decode_responses=True) as client:
        await client.flushdb()
        gateways = [await start_gateway(config, bench.log_dir, f"fleet-{replicas}-{i}", 1)
                    for i in range(replicas)]
        try:
            async with aiohttp.ClientSession() as http:
                async def idle() -> dict[str, Any]:
                    await asyncio.sleep(p["idle_s"])  # the idle window itself
                    return {}

                await asyncio.sleep(min(2.0, p["idle_s"]))  # settle: leases, first scrapes
                quiet = await _measured(http, client, gateways, sims, urls, idle)
                quiet["cpu_pct_per_backend_per_process"] = [
                    round(100 * c / n, 3) for c in quiet["gateway_cores"]]
                busy = await _measured(http, client, gateways, sims, urls,
                                       lambda: _load(opts, p, client, gateways))
                sent = max(1, busy["requests"]["sent"])
                busy["cpu_ms_per_req"] = round(busy["cpu_s"] * 1000 / sent, 3)
                busy["redis_scripts_per_req"] = round(
                    busy["redis_scripts_per_s"] * busy["wall_s"] / sent, 2)
                busy["redis_calls_per_req"] = {
                    name: round(n * busy["wall_s"] / sent, 2)
                    for name, n in busy["redis_calls_per_s"].items()}
        finally:
            for gw in gateways:
                gw.stop()
    return {"idle": quiet, "load": busy}


async def _load(opts: Options, p: dict[str, Any], client: aioredis.Redis,
                gateways: list[Proc]) -> dict[str, Any]:
    specs = [Spec(f"u{i:02d}", "fleet", p["prompt_tokens"], p["max_tokens"])
             for i in range(USERS)]
    stop, ages = asyncio.Event(), list[float]()
    sampler = asyncio.create_task(snapshot_ages(client, p["backends"], stop, ages))
    bar = progress(int(p["rate"] * p["load_s"]), f"fleet x{len(gateways)}", opts.progress)
    rate = p["rate"] / len(gateways)
    def spreader(i: int) -> Callable[[int], Spec]:
        return lambda k: specs[(k * len(gateways) + i) % len(specs)]

    async with new_session() as session:
        runs = await asyncio.gather(*(
            open_loop(session, Target(f"gateway{i}", gw.url, MODEL, via_gateway=True),
                      spreader(i), rate, p["load_s"], bar, poisson=False, seed=i)
            for i, gw in enumerate(gateways)))
    bar.close()
    stop.set()
    await sampler
    results = [r for run in runs for r in run]
    stats = summarize(results)
    return {"requests": {"sent": len(results), "ok": sum(r.status == 200 for r in results)},
            "req_s": stats["req_s"], "e2e_ms": stats["e2e_ms"],
            "snapshot_age_ms": {q: None if (v := percentile(ages, f)) is None else
                                round(v * 1000, 1) for q, f in (("p50", 50), ("p99", 99))}}


def _headline(p: dict[str, Any], runs: dict[str, Any]) -> list[report.Headline]:
    rows = []
    most_scrapes = 1.2 / p["scrape_interval_s"]
    for replicas in p["replicas"]:
        r = runs[f"replicas_{replicas}"]
        idle_pct = max(r["idle"]["cpu_pct_per_backend_per_process"])
        rows.append(report.Headline(
            f"{replicas} replica(s): idle CPU per backend per gateway process (% of a core, "
            "the busiest process)", None, idle_pct, None, "≤ 1 %", idle_pct <= 1.0))
        for phase in ("idle", "load"):
            got = r[phase]["scrapes_per_backend_s"]["max"]
            rows.append(report.Headline(
                f"{replicas} replica(s): scrapes per backend per second, {phase} (max over "
                "backends)", None, got, None, f"≤ {most_scrapes:g}", got <= most_scrapes))
        load = r["load"]
        rows.append(report.Headline(
            f"{replicas} replica(s): gateway CPU per request at {p['rate']} req/s (ms, all "
            "replicas)", None, load["cpu_ms_per_req"], None, "–", None))
        rows.append(report.Headline(
            f"{replicas} replica(s): Redis script calls per request at {p['rate']} req/s",
            None, load["redis_scripts_per_req"], None, "–", None))
        calls = ", ".join(f"{name} {n:g}" for name, n in
                          list(load["redis_calls_per_req"].items())[:6])
        rows.append(report.Headline(
            f"{replicas} replica(s): the gateways' Redis calls per request by script or "
            f"command (the six most): {calls}", None,
            round(sum(load["redis_calls_per_req"].values()), 2), None, "–", None))
        rows.append(report.Headline(
            f"{replicas} replica(s): Redis script calls per second, idle", None,
            r["idle"]["redis_scripts_per_s"], None, "–", None))
        rows.append(report.Headline(
            f"{replicas} replica(s): snapshot age p99 under load (ms)", None,
            load["snapshot_age_ms"]["p99"], None, "–", None))
        rows.append(report.Headline(
            f"{replicas} replica(s): dispatch decisions per second under load", None,
            load["dispatches_per_s"], None, "–", None))
        rows.append(report.Headline(
            f"{replicas} replica(s): decisions on a stale snapshot per second under load "
            "(gates two snapshots old: none admitted)", None,
            load["stale_views_per_s"], None, "–", None))
        lags = [lag["p99_ms"] for lag in load["loop_lag"]]
        rows.append(report.Headline(
            f"{replicas} replica(s): event-loop lag p99 under load, each replica (ms, bucket "
            f"bound): {', '.join('–' if v is None else f'{v:g}' for v in lags)}", None,
            max((v for v in lags if v is not None), default=None), None, "–", None))
    return rows


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    runs: dict[str, Any] = {}
    async with Bench(opts) as bench:
        sims, urls = await start_sims(SIM, MODEL, p["backends"], bench.log_dir, "sims")
        try:
            for replicas in p["replicas"]:
                runs[f"replicas_{replicas}"] = await _phase(opts, p, bench, sims, urls,
                                                            replicas)
        finally:
            sims.stop()
    fig, ax = report.figure(f"Gateway cost with {p['backends']} backends", "gateway replicas",
                            "% of a core per backend per process (idle)")
    ax.plot(p["replicas"], [max(runs[f"replicas_{n}"]["idle"]["cpu_pct_per_backend_per_process"])
                            for n in p["replicas"]], "-o", label="busiest process")
    ax.legend()
    return report.write(opts, "fleet", p, runs, _headline(p, runs), {"fleet_idle_cpu.png": fig})
