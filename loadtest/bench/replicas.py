"""``replicas``: fairness across gateway replicas under skewed ingress, and after one dies.

Three ``fairgate serve`` replicas on one Redis in front of one simulated backend. A
weight-4 user's requests all enter replica 1; a weight-1 user's are spread evenly over
the three. Both are backlogged (closed loops deeper than their share of the batch). The
served weighted tokens (prompt × 1 when the first token arrives, output × 2 per token:
VTC's cost) are measured over the first phase, then replica 3 is SIGKILLed and they are
measured over the phase after the kill; the light user's clients of the dead replica
move to the next one, as a load balancer would. Beside the measured shares, the
``fairgate_share_ratio`` gauges scraped from replica 1's ``/metrics`` every second.

The global queue in Redis should keep 4 : 1. Scheduling fairly per replica instead
(each replica fair over its own ingress, each with its share of the backend) would
give the weight-4 user 4/5 of one replica's third: 4 : 11 with three replicas, 2 : 3
with two; ``params.per_replica_prediction`` states it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench import report
from loadtest.bench.client import Result, Spec, Target, new_session, send
from loadtest.bench.env import Backend, Bench, Options, gateway_target
from loadtest.bench.loadgen import cancel_all, progress
from loadtest.bench.procs import Proc, SimSpec
from loadtest.bench.stats import backlogged, service_by_user, sliding_windows, summarize

# a batch smaller than the two users' demand, so that requests queue in the gateway
# and its order decides the shares
SIM = SimSpec(max_num_seqs=16, max_num_batched_tokens=2048)
QUICK_SIM = SimSpec(max_num_seqs=4, max_num_batched_tokens=2048)
W_IN, W_OUT = 1.0, 2.0
HEAVY, LIGHT = "heavy", "light"
WEIGHTS = {HEAVY: 4.0, LIGHT: 1.0}
REPLICAS = 3
KILLED = 2  # replica 3 (not replica 1, where the heavy user enters)
TARGET = (3.8, 4.2)


def params(opts: Options) -> dict[str, Any]:
    return {
        "replicas": REPLICAS, "killed_replica": KILLED + 1, "weights": WEIGHTS,
        # deep loops: the heavy user's queue in Redis holds about a second of its service,
        # so a replica or client stalling for a moment does not empty it (an emptied queue
        # loses its turns: no banked credit)
        "heavy_concurrency": opts.size or opts.pick(64, 16),
        "light_concurrency_per_replica": opts.pick(8, 3),
        "prompt_tokens": 128, "max_tokens": opts.pick(64, 16),
        "phase_s": opts.duration_s or opts.pick(45.0, 4.0), "warmup_s": opts.pick(5.0, 1.0),
        "window_s": opts.pick(10.0, 2.0), "step_s": opts.pick(1.0, 0.5),
        "scrape_every_s": opts.pick(1.0, 0.5), "cost": {"input": W_IN, "output": W_OUT},
        "target_ratio": list(TARGET), "sim": opts.pick(SIM, QUICK_SIM).__dict__,
        "per_replica_prediction": {"three_replicas": round(4 / 11, 3),
                                   "two_replicas": round(2 / 3, 3)},
        "gateway": "fairness vtc; replica_ttl_s 3 (default); keys of weight 4 and 1",
    }


def keys() -> list[dict[str, Any]]:
    return [{"key": f"sk-{u}", "user": u, "priority_class": "interactive", "weight": w}
            for u, w in WEIGHTS.items()]


class Ingress:
    """Which replica each client sends to: fixed, until its replica dies."""

    def __init__(self, targets: list[Target]) -> None:
        self.targets = targets
        self.dead: set[int] = set()

    def target(self, home: int) -> Target:
        index = home
        while index in self.dead:  # the load balancer's next live replica
            index = (index + 1) % len(self.targets)
        return self.targets[index]


async def worker(session: aiohttp.ClientSession, ingress: Ingress, home: int, spec: Spec,
                 results: list[Result], deadline: float, bar: Any) -> None:
    while time.perf_counter() < deadline:
        await send(session, ingress.target(home), spec, results)
        bar.update(1)


async def scrape_ratios(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """``fairgate_share_ratio`` of each user on one replica's /metrics."""
    try:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    return {s.labels["name"]: s.value for family in text_string_to_metric_families(text)
            if family.name == "fairgate_share_ratio" for s in family.samples
            if s.labels.get("level") == "user"}


async def sample_ratios(session: aiohttp.ClientSession, url: str, every_s: float,
                        start: float, sink: list[dict[str, Any]]) -> None:
    while True:
        ratios = await scrape_ratios(session, url)
        sink.append({"t": round(time.perf_counter() - start, 2), **ratios})
        await asyncio.sleep(every_s)


def shares(results: list[Result], a: float, b: float) -> dict[str, Any]:
    served = service_by_user(results, a, b, W_IN, W_OUT)
    heavy, light = served.get(HEAVY, 0.0), served.get(LIGHT, 0.0)
    total = heavy + light
    return {"service": {HEAVY: round(heavy), LIGHT: round(light)},
            "ratio": round(heavy / light, 3) if light else None,
            "heavy_share": round(heavy / total, 4) if total else None,
            "both_backlogged": backlogged(results, a, b) >= {HEAVY, LIGHT},
            "window_s": round(b - a, 2)}


def ratio_mean(samples: list[dict[str, Any]], a: float, b: float, user: str) -> float | None:
    values = [s[user] for s in samples if a <= s["t"] < b and user in s]
    return round(sum(values) / len(values), 3) if values else None


async def _run(opts: Options, p: dict[str, Any], gateways: list[Proc],
               backend: Backend) -> dict[str, Any]:
    targets = [gateway_target(gw, backend, f"replica{i + 1}") for i, gw in enumerate(gateways)]
    ingress = Ingress(targets)
    results: list[Result] = []
    samples: list[dict[str, Any]] = []
    heavy = Spec(HEAVY, "heavy", p["prompt_tokens"], p["max_tokens"])
    light = Spec(LIGHT, "light", p["prompt_tokens"], p["max_tokens"])
    bar = progress(None, "replicas", opts.progress)
    async with new_session() as session:
        start = time.perf_counter()
        end = start + 2 * p["phase_s"]
        tasks = [asyncio.create_task(worker(session, ingress, 0, heavy, results, end, bar))
                 for _ in range(p["heavy_concurrency"])]
        tasks += [asyncio.create_task(worker(session, ingress, r, light, results, end, bar))
                  for r in range(REPLICAS) for _ in range(p["light_concurrency_per_replica"])]
        sampler = asyncio.create_task(sample_ratios(session, targets[0].url,
                                                    p["scrape_every_s"], start, samples))
        try:
            await asyncio.sleep(p["phase_s"])
            at_kill = await scrape_ratios(session, targets[0].url)
            doomed = gateways[KILLED].process
            doomed.send_signal(signal.SIGKILL)
            killed = time.perf_counter()
            ingress.dead.add(KILLED)
            await asyncio.get_running_loop().run_in_executor(None, doomed.wait)
            await asyncio.wait(tasks, timeout=max(0.0, end - time.perf_counter()))
            at_end = await scrape_ratios(session, targets[0].url)
        finally:
            await cancel_all([*tasks, sampler])
    bar.close()
    first = (start + p["warmup_s"], killed)
    second = (killed, end)
    errors = [r for r in results if not r.ok and r.error != "cancelled"]
    lost_at_kill = [r for r in errors if r.sent_s < killed <= r.end_s + 1.0]
    curve = []
    for a, b in sliding_windows(start + p["warmup_s"], end, p["window_s"], p["step_s"]):
        s = shares(results, a, b)
        curve.append({"t": round(b - start, 2), "heavy_share": s["heavy_share"]})
    rel = killed - start
    return {
        "three_replicas": {**shares(results, *first),
                           "share_ratio_at_kill": at_kill,
                           "share_ratio_mean": {u: ratio_mean(samples, p["warmup_s"], rel, u)
                                                for u in WEIGHTS}},
        "after_kill": {**shares(results, *second),
                       "share_ratio_at_end": at_end,
                       "share_ratio_mean": {u: ratio_mean(samples, rel, 2 * p["phase_s"], u)
                                            for u in WEIGHTS}},
        "killed_at_s": round(rel, 2),
        "errors": len(errors), "errors_at_kill": len(lost_at_kill),
        "error_sample": next((r.error for r in errors), None),
        "summary": summarize(results, (start + p["warmup_s"], end)),
        "heavy_share_curve": curve, "share_ratio_samples": samples,
    }


def within(value: float | None) -> bool | None:
    return None if value is None else TARGET[0] <= value <= TARGET[1]


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    users = [(u, "interactive") for u in WEIGHTS]
    async with Bench(opts) as bench, bench.backend(SimSpec(**p["sim"]), "sim") as be, \
            contextlib.AsyncExitStack() as stack:
        gateways = [await stack.enter_async_context((bench.gateway if i == 0 else bench.replica)(
            be, users, f"replica{i + 1}", workers=1, fairness="vtc", api_keys=keys()))
            for i in range(REPLICAS)]
        runs = {"replicas": await _run(opts, p, gateways, be)}
    r = runs["replicas"]
    one, two = r["three_replicas"], r["after_kill"]
    headline = [
        report.Headline("weight-4 : weight-1 served tokens; 3 replicas vs after replica 3 "
                        "was killed", one["ratio"], two["ratio"], None,
                        f"{TARGET[0]}–{TARGET[1]}", within(one["ratio"]) is True
                        and within(two["ratio"]) is True),
        report.Headline("weight-4 user's share of served tokens", one["heavy_share"],
                        two["heavy_share"], None, "0.80", None),
        report.Headline("the same ratio if each replica were fair alone (predicted)",
                        p["per_replica_prediction"]["three_replicas"],
                        p["per_replica_prediction"]["two_replicas"], None, "–", None),
    ]
    for user in WEIGHTS:
        headline.append(report.Headline(
            f"fairgate_share_ratio{{level=\"user\",name=\"{user}\"}} on replica 1, mean of "
            "the phase's scrapes", one["share_ratio_mean"][user], two["share_ratio_mean"][user],
            None, "≈ 1", None))
    headline.append(report.Headline("failed requests (all at the kill: the dead replica's "
                                    "clients)", None, r["errors"], None, "–", None))
    fig, ax = report.figure("Weight-4 user's share of served tokens (sliding windows)",
                            "seconds", "share")
    ax.plot([c["t"] for c in r["heavy_share_curve"]],
            [c["heavy_share"] for c in r["heavy_share_curve"]], label="measured share")
    ax.axhline(0.8, color="green", linestyle=":", label="4 : 1 (0.80)")
    ax.axhline(4 / 15, color="red", linestyle=":", label="fair per replica (0.27)")
    ax.axvline(r["killed_at_s"], color="black", linestyle="--", label="replica 3 killed")
    ax.set_ylim(0, 1)
    ax.legend()
    fig2, ax2 = report.figure("fairgate_share_ratio scraped from replica 1", "seconds",
                              "served ÷ entitled share")
    for user in WEIGHTS:
        pts = [(s["t"], s[user]) for s in r["share_ratio_samples"] if user in s]
        ax2.plot([t for t, _ in pts], [v for _, v in pts], label=user)
    ax2.axhline(1.0, color="green", linestyle=":")
    ax2.axvline(r["killed_at_s"], color="black", linestyle="--", label="replica 3 killed")
    ax2.legend()
    notes = ["Columns: 'direct' is the phase with 3 replicas (after the warm-up), 'gateway' "
             "the phase after replica 3 was SIGKILLed (from the kill on).",
             "fairgate_share_ratio reads a 60 s half-life window, so the second phase's "
             "values still carry some of the first's service."]
    return report.write(opts, "replicas", p, runs, headline,
                        {"replicas_share.png": fig, "replicas_share_ratio.png": fig2}, notes)
