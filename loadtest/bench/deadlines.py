"""``deadlines``: interactive requests with a 2 s first-token deadline at 1.5× what the
backend can serve, beside a batch flood.

First a calibration run measures the backend's capacity for the interactive requests
(closed loop, ``max_num_seqs`` streams, straight to the backend). Then, each on a fresh
backend, the same Poisson arrivals at 1.5× that rate with a closed-loop batch flood go
(a) straight to the backend (FIFO), (b) through fairgate without deadlines and (c) through
fairgate with ``X-Fairgate-Deadline-Ms: 2000``. Each interactive request ends as one of:

- ``met``: first token within the deadline;
- ``refused_fast``: 429 within ``REFUSE_FAST_S`` of sending (the client can degrade);
- ``refused_late``: refused after that (left the queue when its deadline passed);
- ``late``: served, but its first token came after the deadline (the client had given up:
  every token generated for it is wasted GPU time);
- ``error``: anything else.

Target (c): ``met + refused_fast ≥ 0.99`` of requests. Wasted tokens are reported for all
three.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from loadtest.bench import report
from loadtest.bench.client import Result, Spec, Target, new_session
from loadtest.bench.env import Bench, Options, gateway_target
from loadtest.bench.loadgen import LoopUser, closed_loop, open_loop, progress
from loadtest.bench.procs import SimSpec
from loadtest.bench.stats import dist_ms

# A small batch (8 sequences) keeps the request rate at 1.5× its capacity low enough that
# the load generator and the gateway on a 2-core host are not what limits the run.
SIM = SimSpec(max_num_seqs=8, max_num_batched_tokens=2048)
DEADLINE_MS = 2000
REFUSE_FAST_S = 0.05
OVERLOAD = 1.5
OUTCOMES = ("met", "refused_fast", "refused_late", "late", "error")
TARGET = 0.99


def params(opts: Options) -> dict[str, Any]:
    return {
        "interactive_users": 8, "interactive_prompt_tokens": 300,
        "interactive_max_tokens": 64, "deadline_ms": DEADLINE_MS, "overload": OVERLOAD,
        "batch_concurrency": opts.size or opts.pick(8, 4), "batch_prompt_tokens": 1000,
        "batch_max_tokens": 256, "calibrate_s": opts.pick(8.0, 2.0),
        "duration_s": opts.duration_s or opts.pick(20.0, 3.0), "sim": SIM.__dict__,
        "gateway": "defaults (interactive and batch classes as shipped)",
    }


def outcome(r: Result, deadline_s: float) -> str:
    if r.status == 200 and r.ttft is not None:
        return "met" if r.ttft <= deadline_s else "late"
    if r.status == 200 and r.error is None:
        return "late"
    if r.status == 429:
        return "refused_fast" if r.end_s - r.sent_s <= REFUSE_FAST_S else "refused_late"
    if r.status == 504:
        return "refused_late"
    return "error"


def tally(results: list[Result], deadline_s: float) -> dict[str, Any]:
    counts = Counter(outcome(r, deadline_s) for r in results)
    total = max(len(results), 1)
    wasted = sum(r.output_tokens for r in results if outcome(r, deadline_s) == "late")
    return {
        "requests": len(results),
        "outcomes": {k: counts.get(k, 0) for k in OUTCOMES},
        "shares": {k: round(counts.get(k, 0) / total, 4) for k in OUTCOMES},
        "met_or_refused_fast": round((counts["met"] + counts["refused_fast"]) / total, 4),
        "wasted_tokens": wasted,
        # how long a refusal took, as the client saw it (the 50 ms budget is this)
        "refusal_ms": dist_ms([r.end_s - r.sent_s for r in results if r.status == 429]),
        "error_sample": next((r.error for r in results if outcome(r, deadline_s) == "error"),
                             None),
    }


async def _calibrate(opts: Options, p: dict[str, Any], target: Target) -> float:
    """Interactive requests per second the backend completes when saturated with them."""
    spec = Spec("i0", "interactive", p["interactive_prompt_tokens"], p["interactive_max_tokens"])
    results: list[Result] = []
    bar = progress(None, "deadlines calibrate", opts.progress)
    async with new_session() as session:
        start = time.perf_counter()
        await closed_loop(session, target, [LoopUser(spec, SIM.max_num_seqs)],
                          p["calibrate_s"], bar, sink=results)
    bar.close()
    half = start + p["calibrate_s"] / 2  # the second half: past the first wave
    done = [r for r in results if r.ok and r.end_s >= half]
    return float(len(done) / max(time.perf_counter() - half, 1e-9))


async def _measure(opts: Options, p: dict[str, Any], target: Target, rate: float,
                   deadline_ms: int | None) -> dict[str, Any]:
    batch_spec = Spec("batch", "batch", p["batch_prompt_tokens"], p["batch_max_tokens"])
    batch: list[Result] = []
    chat: list[Result] = []
    bar = progress(None, f"deadlines {target.name}", opts.progress)

    def chat_spec(i: int) -> Spec:
        return Spec(f"i{i % p['interactive_users']}", "interactive",
                    p["interactive_prompt_tokens"], p["interactive_max_tokens"],
                    deadline_ms=deadline_ms)

    async with new_session() as session:
        flood = asyncio.create_task(closed_loop(
            session, target, [LoopUser(batch_spec, p["batch_concurrency"])],
            p["duration_s"] + 2.0, bar, sink=batch))
        await asyncio.sleep(1.0)  # the flood holds the backend first
        await open_loop(session, target, chat_spec, rate, p["duration_s"], bar, seed=7,
                        drain_s=30.0, sink=chat)
        await flood
    bar.close()
    out = tally(chat, p["deadline_ms"] / 1000)
    out["batch_output_tokens"] = sum(r.output_tokens for r in batch)
    return out


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    users = [(f"i{i}", "interactive") for i in range(p["interactive_users"])]
    users.append(("batch", "batch"))
    runs: dict[str, Any] = {}
    async with Bench(opts) as bench:
        async with bench.backend(SIM, "sim-calibrate") as be:
            capacity = await _calibrate(opts, p, be.target())
        rate = OVERLOAD * capacity
        p["capacity_req_s"], p["rate_req_s"] = round(capacity, 2), round(rate, 2)
        async with bench.backend(SIM, "sim-direct") as be:
            runs["direct"] = await _measure(opts, p, be.target(), rate, None)
        for name, deadline in (("gateway_no_deadline", None), ("gateway_deadline", DEADLINE_MS)):
            async with bench.served(SIM, f"sim-{name}", users, name) as (be, gw):
                runs[name] = await _measure(opts, p, gateway_target(gw, be, name), rate,
                                            deadline)
    on = runs["gateway_deadline"]["met_or_refused_fast"]
    headline = [
        report.Headline(
            f"met or refused ≤ {int(REFUSE_FAST_S * 1000)} ms, 2 s deadline, "
            f"{OVERLOAD}× capacity (direct vs fairgate with deadlines)",
            runs["direct"]["met_or_refused_fast"], on, None, f"≥ {TARGET}", on >= TARGET),
        report.Headline("… fairgate without deadlines (gateway column)",
                        runs["direct"]["met_or_refused_fast"],
                        runs["gateway_no_deadline"]["met_or_refused_fast"], None, "–", None),
        report.Headline("wasted tokens (late requests' output), direct vs deadlines",
                        runs["direct"]["wasted_tokens"], runs["gateway_deadline"]["wasted_tokens"],
                        None, "–", None),
        report.Headline("… fairgate without deadlines (gateway column)",
                        runs["direct"]["wasted_tokens"],
                        runs["gateway_no_deadline"]["wasted_tokens"], None, "–", None),
    ]
    return report.write(opts, "deadlines", p, runs, headline,
                        {"deadline_outcomes.png": _bars(runs)})


def _bars(runs: dict[str, Any]) -> Any:
    fig, ax = report.figure("Interactive requests with a 2 s first-token deadline",
                            "", "share of requests")
    names = list(runs)
    bottom = [0.0] * len(names)
    for kind in OUTCOMES:
        values = [runs[n]["shares"][kind] for n in names]
        ax.bar(names, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylim(0, 1.05)
    ax.legend(loc="upper right", fontsize=8)
    return fig
