"""``mixed``: Poisson interactive chat on top of a batch flood.

The batch user runs closed-loop all along (batch key: fairgate's batch class, whose gate
admits work only while the backend queue is below ``max_waiting`` 1); interactive chat
arrives as a Poisson process during the second part of the run. Reports interactive TTFT
and TPOT, and batch throughput while interactive traffic is idle vs busy.

Runs once per endpoint (``--endpoint``, default both ``/v1/chat/completions`` and
``/v1/completions``; batch and interactive traffic both use it), with the backend's
waiting gauge sampled throughout (``backend_waiting``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from loadtest.bench import report
from loadtest.bench.backend_load import WaitingSampler
from loadtest.bench.client import Result, Spec, Target, new_session
from loadtest.bench.env import Bench, Options, gateway_target
from loadtest.bench.loadgen import LoopUser, closed_loop, open_loop, progress
from loadtest.bench.procs import SimSpec
from loadtest.bench.stats import ratio, summarize

SIM = SimSpec(max_num_seqs=256, max_num_batched_tokens=2048)
TPOT_TARGET_MS = 150.0


def params(opts: Options) -> dict[str, Any]:
    return {
        "batch_concurrency": opts.size or opts.pick(192, 8), "batch_prompt_tokens": 1000,
        "batch_max_tokens": 256, "interactive_rate": opts.pick(4.0, 4.0),
        "interactive_users": 8, "interactive_prompt_tokens": 300,
        "interactive_max_tokens": 128,
        "idle_s": opts.pick(12.0, 2.0), "busy_s": opts.duration_s or opts.pick(15.0, 2.0),
        "warmup_s": opts.pick(4.0, 0.5), "sim": SIM.__dict__,
        "gateway": "defaults (batch class: max_waiting 1; interactive: max_waiting 3)",
        "endpoints": list(opts.endpoints),
    }


async def _phase(opts: Options, p: dict[str, Any], target: Target, backend_url: str,
                 endpoint: str) -> dict[str, Any]:
    on_chat = endpoint == "chat"
    batch_spec = Spec("batch", "batch", p["batch_prompt_tokens"], p["batch_max_tokens"],
                      chat=on_chat)
    total = p["idle_s"] + p["busy_s"]
    batch: list[Result] = []
    chat: list[Result] = []
    bar = progress(None, f"mixed {endpoint} {target.name}", opts.progress)

    def chat_spec(i: int) -> Spec:
        return Spec(f"chat{i % p['interactive_users']}", "interactive",
                    p["interactive_prompt_tokens"], p["interactive_max_tokens"], chat=on_chat)

    async with new_session() as session, WaitingSampler(backend_url) as waiting:
        start = time.perf_counter()
        flood = asyncio.create_task(closed_loop(
            session, target, [LoopUser(batch_spec, p["batch_concurrency"])], total, bar,
            sink=batch))
        await asyncio.sleep(p["idle_s"])
        busy_start = time.perf_counter()
        await open_loop(session, target, chat_spec, p["interactive_rate"], p["busy_s"], bar,
                        seed=1, drain_s=max(1.0, total - (time.perf_counter() - start)),
                        sink=chat)
        await flood
    bar.close()
    idle = (start + p["warmup_s"], busy_start)
    busy = (busy_start + min(p["warmup_s"], p["busy_s"] / 4), start + total)
    return {
        "interactive": summarize(chat, slo_ttft_s=1.0, slo_tpot_s=TPOT_TARGET_MS / 1000),
        "batch_idle": summarize(batch, idle),
        "batch_busy": summarize(batch, busy),
        "backend_waiting": waiting.summary(),
    }


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    users = [("batch", "batch")] + [(f"chat{i}", "interactive")
                                    for i in range(p["interactive_users"])]
    runs: dict[str, dict[str, Any]] = {}
    async with Bench(opts) as bench:
        for endpoint in opts.endpoints:
            runs[endpoint] = {}
            async with bench.backend(SIM, f"sim-direct-{endpoint}") as be:
                runs[endpoint]["direct"] = await _phase(opts, p, be.target(), be.url, endpoint)
            async with bench.served(SIM, f"sim-gateway-{endpoint}", users,
                                    f"gateway-{endpoint}") as (be, gw):
                runs[endpoint]["gateway"] = await _phase(opts, p, gateway_target(gw, be),
                                                         be.url, endpoint)
    headline: list[report.Headline] = []
    for endpoint, by_run in runs.items():
        headline += _headline(endpoint, by_run["direct"], by_run["gateway"])
    fig, ax = report.figure("Mixed: interactive latency under a batch flood", "",
                            "milliseconds")
    labels = ["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    bars = [(endpoint, name) for endpoint in runs for name in ("direct", "gateway")]
    width = 0.8 / len(bars)
    for k, (endpoint, name) in enumerate(bars):
        inter = runs[endpoint][name]["interactive"]
        vals = [inter["ttft_ms"]["p50"], inter["ttft_ms"]["p99"], inter["tpot_ms"]["p50"],
                inter["tpot_ms"]["p99"]]
        offset = (k - (len(bars) - 1) / 2) * width
        ax.bar([i + offset for i in range(4)], [v or 0.0 for v in vals], width=width,
               label=f"{endpoint} {name}")
    ax.set_xticks(range(4), labels)
    ax.set_yscale("log")
    ax.axhline(TPOT_TARGET_MS, color="red", linestyle=":", label="TPOT target 150 ms")
    ax.legend()
    return report.write(opts, "mixed", p, runs, headline, {"mixed_latency.png": fig})


def _headline(endpoint: str, d: dict[str, Any], g: dict[str, Any]) -> list[report.Headline]:
    def row(metric: str, section: str, key: str, q: str | None, target: str = "–",
            met: bool | None = None) -> report.Headline:
        dv = d[section][key][q] if q else d[section][key]
        gv = g[section][key][q] if q else g[section][key]
        return report.Headline(f"{endpoint}: {metric}", dv, gv, ratio(gv, dv), target, met)

    g_tpot = g["interactive"]["tpot_ms"]["p99"]
    return [
        row("interactive TTFT p50 (ms)", "interactive", "ttft_ms", "p50"),
        row("interactive TTFT p99 (ms)", "interactive", "ttft_ms", "p99"),
        row("interactive TPOT p99 (ms)", "interactive", "tpot_ms", "p99",
            "gateway ≤ 150 ms", None if g_tpot is None else g_tpot <= TPOT_TARGET_MS),
        row("interactive goodput (req/s, TTFT ≤ 1 s and TPOT ≤ 150 ms)", "interactive",
            "goodput_req_s", None),
        row("interactive completed", "interactive", "completed", None),
        row("batch output tok/s, interactive idle", "batch_idle", "output_tok_s", None),
        row("batch output tok/s, interactive busy", "batch_busy", "output_tok_s", None),
        row("backend waiting, max sampled", "backend_waiting", "max", None,
            "gateway ≤ 3 + in transit"),
    ]
