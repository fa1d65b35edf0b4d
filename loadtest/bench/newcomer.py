"""``newcomer``: one user floods, then newcomers send one request each.

Direct, the newcomers queue behind the whole flood in vLLM's waiting queue; through
fairgate the flood waits in the gateway (backend waiting < 3) and a newcomer is next
in line, with vLLM priority 0 against the flood's growing ranks.

Runs once per endpoint (``--endpoint``, default both ``/v1/chat/completions`` and
``/v1/completions``): the gateway's pacing reads the stream's frames, and chat streams
open with a role frame that carries no token, so each endpoint is its own result. The
backend's waiting gauge is sampled throughout (``backend_waiting``): through fairgate it
should stay at ``max_waiting`` 3 plus what is in transit.
"""

from __future__ import annotations

import asyncio
from typing import Any

from loadtest.bench import report
from loadtest.bench.backend_load import WaitingSampler
from loadtest.bench.client import Result, Spec, Target, new_session
from loadtest.bench.env import Bench, Options, gateway_target
from loadtest.bench.loadgen import cancel_all, fire, progress
from loadtest.bench.procs import SimSpec
from loadtest.bench.stats import percentile, ratio, summarize

SIM = SimSpec(max_num_seqs=256, max_num_batched_tokens=2048)
RUNS = ("direct", "gateway")


def params(opts: Options) -> dict[str, Any]:
    return {
        "flood": opts.size or opts.pick(200, 30), "flood_prompt_tokens": 1000,
        "flood_max_tokens": 256, "newcomers": opts.pick(10, 3),
        "newcomer_prompt_tokens": 200, "newcomer_max_tokens": 32,
        "newcomer_delay_s": opts.pick(1.0, 0.3), "newcomer_spacing_s": 0.1,
        "sim": SIM.__dict__, "gateway": "defaults (interactive: max_waiting 3, TPOT 150 ms)",
        "time_bound_s": opts.pick(120.0, 20.0), "flood_bound_s": opts.pick(5.0, 1.0),
        "endpoints": list(opts.endpoints),
    }


async def _phase(opts: Options, p: dict[str, Any], target: Target, backend_url: str,
                 chat: bool) -> tuple[list[Result], dict[str, Any]]:
    flood = [Spec("heavy", "flood", p["flood_prompt_tokens"], p["flood_max_tokens"], chat)
             for _ in range(p["flood"])]
    results: list[Result] = []
    endpoint = "chat" if chat else "completions"
    bar = progress(p["flood"] + p["newcomers"], f"newcomer {endpoint} {target.name}",
                   opts.progress)
    async with new_session() as session, WaitingSampler(backend_url) as waiting:
        tasks = await fire(session, target, flood, bar, results)
        await asyncio.sleep(p["newcomer_delay_s"])
        for i in range(p["newcomers"]):
            spec = Spec(f"new{i}", "newcomer", p["newcomer_prompt_tokens"],
                        p["newcomer_max_tokens"], chat)
            tasks += await fire(session, target, [spec], bar, results)
            await asyncio.sleep(p["newcomer_spacing_s"])
        newcomers = tasks[p["flood"]:]
        await asyncio.wait(newcomers, timeout=p["time_bound_s"])
        # The flood may go on: newcomers are what we measure. Bound the rest and stop (a
        # quick run's flood, paced by the gateway, ended 2-3 s after them: not measured)
        await asyncio.wait(tasks, timeout=p["flood_bound_s"])
        await cancel_all(tasks)
    bar.close()
    return results, waiting.summary()


def _ttft(results: list[Result], q: float) -> float | None:
    values = [r.ttft for r in results if r.tag == "newcomer" and r.ttft is not None]
    p = percentile(values, q)
    return None if p is None else round(p * 1000, 2)


def _headline(endpoint: str, p: dict[str, Any], runs: dict[str, list[Result]],
              summary: dict[str, Any]) -> list[report.Headline]:
    d50, g50 = _ttft(runs["direct"], 50), _ttft(runs["gateway"], 50)
    d99, g99 = _ttft(runs["direct"], 99), _ttft(runs["gateway"], 99)
    r50 = ratio(d50, g50)
    waiting = [summary[r]["backend_waiting"]["max"] for r in RUNS]
    return [
        report.Headline(f"{endpoint}: newcomer TTFT p50 (ms); ratio = direct ÷ gateway", d50,
                        g50, r50, "≥ 10× lower", None if r50 is None else r50 >= 10),
        report.Headline(f"{endpoint}: newcomer TTFT p99 (ms); ratio = direct ÷ gateway", d99,
                        g99, ratio(d99, g99), "–", None),
        report.Headline(f"{endpoint}: newcomers completed",
                        summary["direct"]["newcomer"]["completed"],
                        summary["gateway"]["newcomer"]["completed"], None,
                        f"{p['newcomers']} of {p['newcomers']}", None),
        report.Headline(f"{endpoint}: backend waiting, max sampled", waiting[0], waiting[1],
                        None, "gateway ≤ 3 + in transit", None),
    ]


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    users = [("heavy", "interactive")] + [(f"new{i}", "interactive")
                                         for i in range(p["newcomers"])]
    runs: dict[str, dict[str, list[Result]]] = {}
    waiting: dict[str, dict[str, Any]] = {}
    async with Bench(opts) as bench:
        for endpoint in opts.endpoints:
            chat = endpoint == "chat"
            runs[endpoint], waiting[endpoint] = {}, {}
            async with bench.backend(SIM, f"sim-direct-{endpoint}") as be:
                runs[endpoint]["direct"], waiting[endpoint]["direct"] = await _phase(
                    opts, p, be.target(), be.url, chat)
            async with bench.served(SIM, f"sim-gateway-{endpoint}", users,
                                    f"gateway-{endpoint}") as (be, gw):
                runs[endpoint]["gateway"], waiting[endpoint]["gateway"] = await _phase(
                    opts, p, gateway_target(gw, be), be.url, chat)
    summary: dict[str, Any] = {}
    headline: list[report.Headline] = []
    for endpoint, by_run in runs.items():
        summary[endpoint] = {
            name: {
                "newcomer": summarize([r for r in results if r.tag == "newcomer"]),
                "flood": summarize([r for r in results if r.tag == "flood"]),
                "newcomer_ttft_ms": sorted(round((r.ttft or 0) * 1000, 2) for r in results
                                           if r.tag == "newcomer" and r.ttft is not None),
                "backend_waiting": waiting[endpoint][name],
            }
            for name, results in by_run.items()
        }
        headline += _headline(endpoint, p, by_run, summary[endpoint])
    fig, ax = report.figure("Newcomer TTFT behind a flood", "newcomer", "TTFT (ms, log)")
    markers = {"direct": "o", "gateway": "s"}
    for endpoint in summary:
        for name in RUNS:
            values = summary[endpoint][name]["newcomer_ttft_ms"]
            ax.plot(range(len(values)), values, marker=markers[name], linestyle="",
                    fillstyle="full" if endpoint == "chat" else "none",
                    label=f"{endpoint} {name}")
    ax.set_yscale("log")
    ax.legend()
    return report.write(opts, "newcomer", p, summary, headline,
                        {"newcomer_ttft.png": fig})
