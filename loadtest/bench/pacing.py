"""``pacing``: backlogged users of unequal weight on one backend; does pacing keep vLLM's
queue short *and* the backend busy?

Three users whose keys weigh 1, 1 and 2 each send all their requests at once (fixed
output lengths), so every user stays backlogged until its last request. The same work
goes straight to the backend, then through fairgate with adaptive pacing (the default)
and with ``pacing: fixed``, ``repeats`` times in that order. Per run:

- throughput: output tokens of the whole run ÷ the time until the last token (the same
  work in every run, so the ratio to direct is the ratio of makespans);
- the backend's ``num_requests_waiting``, sampled every 50 ms (p50/p90/max): the mission's
  control target is waiting < 3;
- weighted Jain's index (VTC units: prompt × 1 + output × 2, divided by the key's weight)
  while all three users are backlogged: until the first user's last request starts (after
  that it has nothing queued, and the others rightly take its slots);
- the gateway's CPU seconds (the gateway and a CPU vLLM share the machine's cores).

``--backend URL`` runs it against a real vLLM; by default a simulated backend with a
batch of 16 sequences. Against a real vLLM the gateways get the scrape settings of the
real-vLLM test tier (``SLOW_METRICS``): the CPU build's API server answers /metrics
0.5-3 s late while it streams on 2 cores, which the defaults would call a failed scrape.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from loadtest.bench import report
from loadtest.bench.backend_load import WaitingSampler
from loadtest.bench.client import Result, Spec, Target, new_session, send
from loadtest.bench.env import Bench, Options, gateway_target
from loadtest.bench.loadgen import progress
from loadtest.bench.procs import SimSpec
from loadtest.bench.stats import jain, ratio, service_by_user

SIM = SimSpec(max_num_seqs=16, max_num_batched_tokens=512)
SLOW_METRICS = {"scrape_interval_s": 0.05, "scrape_timeout_s": 5.0, "snapshot_stale_s": 10.0,
                "unhealthy_after_failures": 20}
WEIGHTS = {"u0": 1.0, "u1": 1.0, "u2": 2.0}
W_IN, W_OUT = 1.0, 2.0  # VTC: what the gateway's fairness counts


def params(opts: Options) -> dict[str, Any]:
    return {
        "weights": WEIGHTS, "requests_per_user": opts.size or opts.pick(40, 6),
        "prompt_tokens": 64, "max_tokens": opts.pick(256, 32),
        "repeats": opts.pick(3, 1), "sim": SIM.__dict__,
        "gateway": "defaults (interactive max_waiting 3), one key per user with its weight"
                   + ("; scrape settings SLOW_METRICS" if opts.backend else ""),
        "scrape": SLOW_METRICS if opts.backend else {},
    }


async def _measure(opts: Options, p: dict[str, Any], target: Target, backend_url: str,
                   label: str) -> dict[str, Any]:
    specs = [Spec(user, f"r{i}", p["prompt_tokens"], p["max_tokens"])
             for i in range(p["requests_per_user"]) for user in WEIGHTS]
    bar = progress(len(specs), f"pacing {label}", opts.progress)
    results: list[Result] = []

    async def one(spec: Spec) -> None:
        await send(session, target, spec, results)
        bar.update(1)

    load = os.getloadavg()[0]
    async with new_session() as session, WaitingSampler(backend_url) as waiting:
        start = time.perf_counter()
        await asyncio.gather(*(one(s) for s in specs))
    bar.close()
    ok = [r for r in results if r.ok]
    end = max((r.end_s for r in ok), default=start)
    tokens = sum(r.output_tokens for r in ok)
    # all three backlogged until the first user's last request starts
    last = {u: max((r.first_token_s or r.end_s for r in results if r.user == u),
                   default=start) for u in WEIGHTS}
    served = service_by_user(results, start, min(last.values()), W_IN, W_OUT)
    summary = waiting.summary()
    return {
        "requests": len(results), "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_sample": next((r.error for r in results if not r.ok), None),
        "makespan_s": end - start, "output_tokens": tokens,
        "output_tok_s": tokens / (end - start) if end > start else None,
        "backend_waiting": summary,
        "weighted_service": {u: served.get(u, 0.0) / w for u, w in WEIGHTS.items()},
        "weighted_jain": jain([served.get(u, 0.0) / w for u, w in WEIGHTS.items()]),
        "loadavg_1m_at_start": round(load, 2),
    }


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    users = [(u, "interactive") for u in WEIGHTS]
    runs: dict[str, Any] = {}
    async with Bench(opts) as bench:
        for rep in range(p["repeats"]):
            async with bench.backend(SIM, f"sim-direct-{rep}") as be:
                runs[f"direct_{rep}"] = await _measure(opts, p, be.target(), be.url,
                                                       f"direct {rep}")
            for pacing in ("adaptive", "fixed"):
                label = f"{pacing}_{rep}"
                async with bench.served(SIM, f"sim-{label}", users, f"gateway-{label}",
                                        pacing=pacing, **p["scrape"],
                                        api_keys=[{"key": f"sk-{u}", "user": u,
                                                   "priority_class": "interactive",
                                                   "weight": w} for u, w in WEIGHTS.items()]
                                        ) as (be, gw):
                    cpu = gw.cpu_seconds()
                    runs[label] = await _measure(opts, p, gateway_target(gw, be, label),
                                                 be.url, label)
                    runs[label]["gateway_cpu_s"] = gw.cpu_seconds() - cpu
    headline = []
    for pacing in ("adaptive", "fixed"):
        ratios = [ratio(runs[f"{pacing}_{i}"]["output_tok_s"], runs[f"direct_{i}"]["output_tok_s"])
                  for i in range(p["repeats"])]
        known = [r for r in ratios if r is not None]
        mean = sum(known) / len(known) if known else None
        shown = ", ".join(f"{r:.3f}" for r in known)
        direct_tok = [runs[f"direct_{i}"]["output_tok_s"] for i in range(p["repeats"])]
        gw_tok = [runs[f"{pacing}_{i}"]["output_tok_s"] for i in range(p["repeats"])]
        headline.append(report.Headline(
            f"output tok/s, {pacing} pacing (gateway ÷ direct, each run: {shown})",
            _mean(direct_tok), _mean(gw_tok), mean, "≥ 0.97" if pacing == "adaptive" else "–",
            None if mean is None or pacing != "adaptive" else mean >= 0.97))
        p90 = [runs[f"{pacing}_{i}"]["backend_waiting"]["p90"] for i in range(p["repeats"])]
        top = [runs[f"{pacing}_{i}"]["backend_waiting"]["max"] for i in range(p["repeats"])]
        direct_p90 = [runs[f"direct_{i}"]["backend_waiting"]["p90"] for i in range(p["repeats"])]
        worst = max((x for x in p90 if x is not None), default=None)
        headline.append(report.Headline(
            f"vLLM waiting p90, {pacing} pacing (each run p90/max: "
            + ", ".join(f"{a}/{b}" for a, b in zip(p90, top, strict=True)) + ")",
            max((x for x in direct_p90 if x is not None), default=None), worst, None,
            "p90 ≤ 3, max ≤ 4" if pacing == "adaptive" else "–",
            None if worst is None or pacing != "adaptive"
            else worst <= 3 and max(x for x in top if x is not None) <= 4))
        jains = [runs[f"{pacing}_{i}"]["weighted_jain"] for i in range(p["repeats"])]
        direct_j = [runs[f"direct_{i}"]["weighted_jain"] for i in range(p["repeats"])]
        low = min((x for x in jains if x is not None), default=None)
        headline.append(report.Headline(
            f"weighted Jain 1/1/2, {pacing} pacing (each run: "
            + ", ".join("–" if j is None else f"{j:.3f}" for j in jains) + ")",
            _mean(direct_j), low, None, "≥ 0.99" if pacing == "adaptive" else "–",
            None if low is None or pacing != "adaptive" else low >= 0.99))
        cpu_s = [runs[f"{pacing}_{i}"]["gateway_cpu_s"] for i in range(p["repeats"])]
        headline.append(report.Headline(
            f"gateway CPU s per run, {pacing} pacing", None, _mean(cpu_s), None, "–", None))
    return report.write(opts, "pacing", p, runs, headline, {"pacing_waiting.png": _plot(runs)})


def _mean(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _plot(runs: dict[str, Any]) -> Any:
    fig, ax = report.figure("vLLM's waiting queue: p90 and max per run", "run",
                            "num_requests_waiting")
    labels = list(runs)
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], [runs[k]["backend_waiting"]["p90"] or 0 for k in labels],
           width=0.4, label="p90")
    ax.bar([x + 0.2 for x in xs], [runs[k]["backend_waiting"]["max"] or 0 for k in labels],
           width=0.4, label="max")
    ax.axhline(3, color="red", linestyle="--", label="target (waiting < 3 + 1)")
    ax.set_xticks(list(xs), labels, rotation=30)
    ax.legend()
    return fig
