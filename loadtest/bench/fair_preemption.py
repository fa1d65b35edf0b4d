"""``fair_preemption``: a newcomer behind one interactive user's running streams, with
the default settings (issue 46).

One interactive user sends a flood of streams at once (64 by default); once the flood
fills the backend, one interactive newcomer sends one stream. Per endpoint, three runs:
direct to the backend, through fairgate with ``preemption: false``, and through fairgate
with the defaults (fair preemption on: the newcomer, below its fair share of the slots,
takes the heavy user's youngest stream past its grace after 500 ms). Direct, the newcomer
waits behind the whole flood in vLLM's queue; through fairgate without preemption it waits
for a slot to free; with it, for its class's wait.

Measured: the newcomer's TTFT (ratio direct ÷ on: the issue's ≥ 20×), vLLM's waiting
gauge (p90 ≤ 3), the heavy user's output tok/s with preemption ÷ without (≥ 0.95), and
the tokens the preempted streams sent again as a part of the tokens served (≤ 5 %).
Against a real vLLM (``--backend``), run the server on a CPU of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aiohttp

from loadtest.bench import report
from loadtest.bench.backend_load import WaitingSampler
from loadtest.bench.client import Result, Spec, Target, new_session
from loadtest.bench.env import Bench, Options, gateway_target
from loadtest.bench.loadgen import cancel_all, fire, progress
from loadtest.bench.procs import SimSpec
from loadtest.bench.stats import ratio

SIM = SimSpec(max_num_seqs=8, max_num_batched_tokens=512)
RUNS = ("direct", "off", "on")
SERIES = ("fairgate_preemptions_total", "fairgate_preemption_recomputed_tokens_total")


def params(opts: Options) -> dict[str, Any]:
    return {
        "flood": opts.size or opts.pick(64, 16), "flood_prompt_tokens": 64,
        "flood_max_tokens": opts.pick(384, 64), "newcomer_prompt_tokens": 32,
        "newcomer_max_tokens": 16, "newcomer_delay_s": opts.pick(2.0, 0.5),
        "sim": SIM.__dict__, "gateway": "defaults; off: preemption false",
        "time_bound_s": opts.pick(300.0, 60.0), "endpoints": list(opts.endpoints),
    }


async def _phase(opts: Options, p: dict[str, Any], target: Target, backend_url: str,
                 chat: bool) -> tuple[list[Result], dict[str, Any]]:
    flood = [Spec("heavy", "flood", p["flood_prompt_tokens"], p["flood_max_tokens"], chat)
             for _ in range(p["flood"])]
    results: list[Result] = []
    bar = progress(p["flood"] + 1, f"fair_preemption {target.name}", opts.progress)
    async with new_session() as session, WaitingSampler(backend_url) as waiting:
        tasks = await fire(session, target, flood, bar, results)
        await asyncio.sleep(p["newcomer_delay_s"])
        tasks += await fire(session, target, [Spec(
            "new0", "newcomer", p["newcomer_prompt_tokens"], p["newcomer_max_tokens"], chat)],
            bar, results)
        await asyncio.wait(tasks, timeout=p["time_bound_s"])
        await cancel_all(tasks)
    bar.close()
    return results, waiting.summary()


async def _metric_totals(url: str, names: Sequence[str]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    found = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] += sample.value
    return found


def _summary(results: list[Result], waiting: dict[str, Any],
             moved: dict[str, float] | None) -> dict[str, Any]:
    heavy = [r for r in results if r.tag == "flood"]
    new = next((r for r in results if r.tag == "newcomer"), None)
    done = [r for r in heavy if r.ok]
    span = (max(r.end_s for r in done) - min(r.sent_s for r in heavy)) if done else 0.0
    output = sum(r.output_tokens for r in heavy)
    served = sum(r.prompt_tokens + r.output_tokens for r in results if r.ok)
    out: dict[str, Any] = {
        "newcomer_ttft_ms": None if new is None or new.ttft is None
        else round(new.ttft * 1000, 1),
        "heavy_completed": len(done), "heavy_output_tokens": output,
        "heavy_tok_s": round(output / span, 1) if span > 0 else None,
        "errors": sum(1 for r in results if not r.ok),
        "backend_waiting": waiting, "served_tokens": served,
    }
    if moved is not None:
        recomputed = moved["fairgate_preemption_recomputed_tokens_total"]
        out.update(preemptions=moved["fairgate_preemptions_total"],
                   recomputed_tokens=recomputed,
                   recomputed_pct=round(100 * recomputed / served, 2) if served else None)
    return out


def _headline(endpoint: str, s: dict[str, dict[str, Any]]) -> list[report.Headline]:
    d, off, on = (s[r]["newcomer_ttft_ms"] for r in RUNS)
    r_on = ratio(d, on)
    tok = ratio(s["on"]["heavy_tok_s"], s["off"]["heavy_tok_s"])
    p90 = s["on"]["backend_waiting"]["p90"]
    pct = s["on"].get("recomputed_pct")
    return [
        report.Headline(f"{endpoint}: newcomer TTFT (ms), direct | on; ratio = direct ÷ on",
                        d, on, r_on, "≥ 20× lower", None if r_on is None else r_on >= 20),
        report.Headline(f"{endpoint}: newcomer TTFT (ms), off | on; ratio = off ÷ on",
                        off, on, ratio(off, on), "–", None),
        report.Headline(f"{endpoint}: heavy user's output tok/s, off | on; ratio = on ÷ off",
                        s["off"]["heavy_tok_s"], s["on"]["heavy_tok_s"], tok, "≥ 0.95",
                        None if tok is None else tok >= 0.95),
        report.Headline(f"{endpoint}: backend waiting p90, direct | on",
                        s["direct"]["backend_waiting"]["p90"], p90, None, "on ≤ 3",
                        None if p90 is None else p90 <= 3),
        report.Headline(f"{endpoint}: tokens sent again by preemption, % of served (on)",
                        None, pct, None, "≤ 5 %", None if pct is None else pct <= 5),
    ]


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    users = [("heavy", "interactive"), ("new0", "interactive")]
    summary: dict[str, Any] = {}
    headline: list[report.Headline] = []
    async with Bench(opts) as bench:
        for endpoint in opts.endpoints:
            chat = endpoint == "chat"
            by_run: dict[str, dict[str, Any]] = {}
            async with bench.backend(SIM, f"sim-direct-{endpoint}") as be:
                results, waiting = await _phase(opts, p, be.target(), be.url, chat)
                by_run["direct"] = _summary(results, waiting, None)
            for name, settings in (("off", {"preemption": False}), ("on", {})):
                async with bench.served(SIM, f"sim-{name}-{endpoint}", users,
                                        f"gateway-{name}-{endpoint}", **settings) as (be, gw):
                    results, waiting = await _phase(opts, p, gateway_target(gw, be), be.url,
                                                    chat)
                    by_run[name] = _summary(results, waiting,
                                            await _metric_totals(gw.url, SERIES))
            summary[endpoint] = by_run
            headline += _headline(endpoint, by_run)
    return report.write(opts, "fair_preemption", p, summary, headline, {})
