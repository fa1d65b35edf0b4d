"""``overhead``: what the gateway itself costs, on the zero-cost ``instant`` profile, beside
the proxies a user might run instead.

Processes: the simulator in one process, each proxy in its own, the load generator in this
one (plus Valkey), so the client never shares a GIL with what it measures. One simulator
serves the whole run; in front of it, one after the other:

- ``direct``: no proxy (its CPU column is the simulator's own: the floor under everything);
- ``bare_proxy``: a bare aiohttp reverse proxy (:mod:`loadtest.bench.bare_proxy`: the
  request relayed and the answer streamed back, nothing else): the Python floor;
- the peers (:mod:`loadtest.bench.peers`): Envoy, vllm-router, sglang-router, each
  skipped with its reason when it is not installed or does not start (``--peers``);
- ``gateway``: ``fairgate serve --workers 1`` at its defaults;
- ``gateway_wide``: one worker with the waiting gate wide open (``max_waiting`` 100000),
  closed loop only: the process's capacity apart from pacing;
- ``gateway_workers``: ``fairgate serve --workers N`` (``--workers``, default 2) at its
  defaults.

Every proxy is measured streamed and not (``"stream": false``, E2E = the answer read):
open-loop (evenly spaced) runs at fixed rates give the added latency; a closed loop of 64
clients gives the req/s at saturation. Each run records the CPU of the proxy's whole process
tree per request sent, and for fairgate its Redis commands and round trips per request
(from its ``/metrics``, background loops included). With ``--profile``, py-spy records the
one-worker gateway while a closed loop saturates it, streamed and not
(:mod:`loadtest.bench.profile`; not part of the measured runs).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench import overhead_report, peers, profile, report
from loadtest.bench.client import Result, Spec, Target, new_session
from loadtest.bench.env import Backend, Bench, Options, gateway_target
from loadtest.bench.loadgen import LoopUser, closed_loop, open_loop, progress
from loadtest.bench.procs import Proc, SimSpec, start_bare_proxy
from loadtest.bench.stats import summarize

SIM = SimSpec(profile="instant", max_num_seqs=1024, max_num_batched_tokens=8192)
MODES = {"streamed": True, "non_streamed": False}
WIDE: dict[str, Any] = {"classes": {"interactive": {"max_waiting": 100_000}}}


def params(opts: Options) -> dict[str, Any]:
    duration = opts.duration_s or opts.pick(4.0, 1.0)
    selected = peers.NAMES if opts.peers is None else opts.peers
    return {
        "rates": opts.pick([100, 500, 1000], [50]),
        "duration_s": duration,
        # an open-loop run waits this long for its last answers after its last send, then
        # cancels them (a proxy that cannot keep up does not stretch the run)
        "drain_s": duration,
        "warmup_s": opts.pick(0.5, 0.2),
        "max_concurrency": opts.size or opts.pick(64, 8),
        "prompt_tokens": 16, "max_tokens": 8, "users": 64, "sim": SIM.__dict__,
        "modes": list(MODES),
        "peers": list(selected),
        "processes": "sim, the proxy, load generator: three processes (+ Valkey)",
        "workers": opts.workers if opts.workers > 1 else 2,
        "baseline_tree": None if opts.baseline_tree is None else str(opts.baseline_tree),
        "profile_s": opts.pick(10.0, 2.0) if opts.profile else None,
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
        if len(used) > 1:  # the root first, then its children (fairgate: each worker)
            cpu["process_split_cores"] = [round(used[pid] / wall, 3) for pid in sorted(used)]
    if gateway_url:
        counts1 = await _gateway_counts(gateway_url)
        for name in ("commands", "round_trips"):
            cpu[f"redis_{name}_per_req"] = round(
                (counts1[name] - counts0[name]) / max(1, len(results)), 2)
    return results, cpu


class _Load:
    """The load of one proxy in one mode: its request specs, warm-up, open and closed
    loops, on one connection pool."""

    def __init__(self, opts: Options, p: dict[str, Any], target: Target,
                 session: aiohttp.ClientSession, stream: bool) -> None:
        self.opts, self.p, self.target, self.session = opts, p, target, session
        self.specs = [Spec(f"u{i:02d}", "probe", p["prompt_tokens"], p["max_tokens"],
                           stream=stream) for i in range(p["users"])]
        self.mode = "streamed" if stream else "non-streamed"

    async def warm(self) -> None:
        """The connection pool and the proxy's code paths warm."""
        await closed_loop(self.session, self.target, [LoopUser(self.specs[0], 4)],
                          self.p["warmup_s"], progress(None, "warmup", False))

    async def open(self, rate: int) -> list[Result]:
        total = int(rate * self.p["duration_s"])
        bar = progress(total, f"overhead {self.target.name} {self.mode} {rate}/s",
                       self.opts.progress)
        try:
            return await open_loop(self.session, self.target,
                                   lambda i: self.specs[i % len(self.specs)], rate,
                                   self.p["duration_s"], bar, poisson=False,
                                   drain_s=self.p["drain_s"])
        finally:
            bar.close()

    async def closed(self, duration_s: float | None = None) -> list[Result]:
        bar = progress(None, f"overhead {self.target.name} {self.mode} max", self.opts.progress)
        per_user = max(1, self.p["max_concurrency"] // len(self.specs))
        users = [LoopUser(s, per_user) for s in self.specs[: self.p["max_concurrency"]]]
        try:
            return await closed_loop(self.session, self.target, users,
                                     duration_s or self.p["duration_s"], bar)
        finally:
            bar.close()


async def _suite(opts: Options, p: dict[str, Any], target: Target, proc: Proc | None,
                 rates: list[int], backend: Proc | None = None,
                 profile_pid: int | None = None) -> dict[str, Any]:
    """Each mode: the open-loop rates, then the closed loop (then, with ``profile_pid``, a
    closed loop under py-spy)."""
    gateway_url = target.url if target.via_gateway else None
    out: dict[str, Any] = {}
    async with new_session() as session:
        for mode, stream in MODES.items():
            load = _Load(opts, p, target, session, stream)
            await load.warm()
            runs: dict[str, Any] = {}
            for rate in rates:
                results, cpu = await _measured(proc, functools.partial(load.open, rate), backend,
                                               gateway_url)
                runs[f"rate_{rate}"] = {**summarize(results), "cpu": cpu}
            results, cpu = await _measured(proc, load.closed, backend, gateway_url)
            runs["max"] = {**summarize(results), "cpu": cpu}
            if profile_pid is not None and p["profile_s"]:
                runs["profile"] = await _profiled(opts, p, load, profile_pid, mode)
            out[mode] = runs
    return out


async def _profiled(opts: Options, p: dict[str, Any], load: _Load, pid: int,
                    mode: str) -> dict[str, Any]:
    """A closed loop under py-spy (files in ``<out>/profile``); its req/s beside."""
    got: list[Result] = []

    async def run(seconds: float) -> None:
        got.extend(await load.closed(seconds))

    found = await profile.record(pid, opts.out / "profile", f"gateway-{mode}",
                                 p["profile_s"], run)
    return {**found, "req_s_while_profiled": summarize(got)["req_s"] if got else None}


async def _peer(opts: Options, p: dict[str, Any], bench: Bench, be: Backend,
                peer: peers.Peer) -> dict[str, Any]:
    """One peer's suite, or why it was skipped."""
    try:
        proc = await peers.start(peer, be.url, bench.log_dir)
    except peers.Unavailable as exc:
        return {"skipped": str(exc), "label": peer.label}
    try:
        target = Target(peer.name, proc.url, be.model, via_gateway=False)
        return {"label": peer.label,
                **await _suite(opts, p, target, proc, p["rates"], be.proc)}
    finally:
        proc.stop()


async def _proxies(opts: Options, p: dict[str, Any], bench: Bench, be: Backend
                   ) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    runs["direct"] = await _suite(opts, p, be.target(), be.proc, p["rates"])  # sim's CPU
    bare = await start_bare_proxy(be.url, bench.log_dir, "bare-proxy")
    try:
        runs["bare_proxy"] = await _suite(
            opts, p, Target("bare proxy", bare.url, be.model, via_gateway=False), bare,
            p["rates"], be.proc)
    finally:
        bare.stop()
    for peer in peers.PEERS:
        if peer.name in p["peers"]:
            runs[peer.name] = await _peer(opts, p, bench, be, peer)
    return runs


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    async with Bench(opts) as bench, bench.backend(SIM, "sim") as be:
        runs = await _proxies(opts, p, bench, be)
        users = [(f"u{i:02d}", "interactive") for i in range(p["users"])]
        async with bench.gateway(be, users, "gateway", 1) as gw:
            runs["gateway"] = await _suite(opts, p, gateway_target(gw, be), gw, p["rates"],
                                           be.proc, profile_pid=gw.pid)
        async with bench.gateway(be, users, "gateway-wide", 1, **WIDE) as gw:
            runs["gateway_wide"] = await _suite(opts, p, gateway_target(gw, be, "wide"), gw,
                                                [], be.proc)
        if opts.baseline_tree is not None:
            async with bench.gateway(be, users, "gateway-baseline", 1,
                                     source=opts.baseline_tree) as gw:
                runs["gateway_baseline"] = await _suite(
                    opts, p, gateway_target(gw, be, "baseline"), gw, p["rates"], be.proc)
        n = p["workers"]
        async with bench.gateway(be, users, "gateway-workers", n) as gw:
            runs["gateway_workers"] = await _suite(
                opts, p, gateway_target(gw, be, f"workers{n}"), gw, p["rates"], be.proc)
    return report.write(opts, "overhead", p, runs, overhead_report.headline(p, runs),
                        {"overhead_latency.png": overhead_report.figure(p, runs)},
                        notes=overhead_report.notes(p, runs))
