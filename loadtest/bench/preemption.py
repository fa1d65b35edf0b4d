"""``preemption``: interactive newcomers beside a batch load that fills every slot, and
streams that survive a killed backend and a drain that moves them.

Three phases, each bounded in requests and time:

1. **TTFT**: a batch user keeps twice the backend's ``max_num_seqs`` long generations
   going (a closed loop); interactive newcomers arrive one at a time. Direct to the
   backend, then through fairgate with ``preemption: false`` and with preemption on (the
   defaults: interactive may preempt batch after 500 ms). vLLM never takes a running
   slot back for a waiting request, so without preemption a newcomer waits for a batch
   stream to end; with it, a batch stream gives its slot back and continues later from
   its token ids. Measured: newcomer TTFT p50/p99 per run; batch output tok/s (the cost),
   tokens sent again by the preempted streams' continuations (% of batch output).
2. **Failover**: 4 simulated backends under load, one SIGKILLed mid-stream: streams
   completed / errored (each must end with its ``max_tokens`` tokens).
3. **Migrate-drain**: 4 backends under load, ``POST /admin/backends/b0/drain
   {"migrate": true, "grace_s": …}``: streams dropped (target 0).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from loadtest.bench import report
from loadtest.bench.client import Result, Spec, Target, new_session
from loadtest.bench.env import MODEL, Backend, Bench, Options, gateway_target
from loadtest.bench.loadgen import LoopUser, cancel_all, closed_loop, fire, progress
from loadtest.bench.procs import Proc, SimSpec, start_sim, start_together
from loadtest.bench.stats import percentile, ratio, summarize

SIM = SimSpec(max_num_seqs=16, max_num_batched_tokens=2048)
RUNS = ("direct", "off", "on")
ADMIN_KEY = "sk-bench-admin"
PREEMPT_SERIES = ("fairgate_preemptions_total",
                  "fairgate_continuation_recomputed_tokens_total",
                  "fairgate_continuations_total")


def params(opts: Options) -> dict[str, Any]:
    seqs = SIM.max_num_seqs
    return {
        "sim": SIM.__dict__, "batch_streams": 2 * seqs,
        "batch_prompt_tokens": 500, "batch_max_tokens": opts.pick(1500, 300),
        "newcomers": opts.size or opts.pick(30, 3), "newcomer_prompt_tokens": 200,
        "newcomer_max_tokens": 32, "warmup_s": opts.pick(5.0, 1.5),
        "newcomer_spacing_s": opts.pick(1.5, 0.5),
        "gateway": "defaults (interactive preempt_after_ms 500, batch preemptible, "
                   "max_preemptions 2)",
        "fault_backends": 4, "fault_streams": opts.pick(48, 8),
        "fault_max_tokens": opts.pick(800, 150), "fault_after_s": opts.pick(2.0, 0.5),
        "drain_grace_s": opts.pick(1.0, 0.2), "time_bound_s": opts.pick(180.0, 40.0),
    }


def _users(p: dict[str, Any]) -> list[tuple[str, str]]:
    return [("bulk", "batch")] + [(f"new{i}", "interactive") for i in range(p["newcomers"])]


async def _ttft_phase(opts: Options, p: dict[str, Any], target: Target
                      ) -> list[Result]:
    """The batch load, and the newcomers one by one after the warm-up."""
    results: list[Result] = []
    bar = progress(None, f"preemption {target.name}", opts.progress)
    batch = Spec("bulk", "batch", p["batch_prompt_tokens"], p["batch_max_tokens"])
    span = p["warmup_s"] + p["newcomers"] * p["newcomer_spacing_s"]
    async with new_session() as session:
        load = asyncio.create_task(closed_loop(
            session, target, [LoopUser(batch, p["batch_streams"])], span, bar,
            max_requests=p["batch_streams"] * 50, sink=results))
        await asyncio.sleep(p["warmup_s"])
        newcomers: list[asyncio.Task[Any]] = []
        for i in range(p["newcomers"]):
            spec = Spec(f"new{i}", "newcomer", p["newcomer_prompt_tokens"],
                        p["newcomer_max_tokens"])
            newcomers += await fire(session, target, [spec], bar, results)
            await asyncio.sleep(p["newcomer_spacing_s"])
        await asyncio.wait(newcomers, timeout=p["time_bound_s"])
        await cancel_all(newcomers)
        await asyncio.wait([load], timeout=p["time_bound_s"])
        await cancel_all([load])
    bar.close()
    return results


async def _metric_values(url: str, names: Sequence[str]) -> dict[str, float]:
    """The gateway's samples of ``names`` (summed over labels but ``reason``)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    found = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                key = sample.name + (f"{{reason={sample.labels['reason']}}}"
                                     if "reason" in sample.labels else "")
                if sample.labels.get("outcome", "continued") == "continued":
                    found[key] = found.get(key, 0.0) + sample.value
    return found


@asynccontextmanager
async def _fleet(bench: Bench, label: str, count: int) -> AsyncIterator[list[Proc]]:
    """``count`` simulators, each its own process (one can be SIGKILLed), started side by
    side."""
    sims = await start_together({f"{label}-{i}": start_sim(SIM, MODEL, bench.log_dir,
                                                            f"{label}-{i}")
                                 for i in range(count)})
    try:
        yield sims
    finally:
        for sim in sims:
            sim.stop()


async def _fault_phase(opts: Options, p: dict[str, Any], bench: Bench, kind: str
                       ) -> dict[str, Any]:
    """Streams on 4 backends; one backend SIGKILLed (``failover``) or drained with
    ``migrate`` (``drain``) while they run."""
    users = [("bulk", "batch"), ("chat", "interactive")]
    async with _fleet(bench, f"sim-{kind}", p["fault_backends"]) as sims:
        backends = [{"name": f"b{i}", "url": s.url, "model": MODEL}
                    for i, s in enumerate(sims)]
        sim0 = sims[0]
        async with bench.gateway(Backend(sim0.url, MODEL, None), users, f"gateway-{kind}",
                                 backends=backends, admin_keys=[ADMIN_KEY]) as gw:
            target = Target("gateway", gw.url, MODEL, via_gateway=True)
            specs = [Spec("bulk" if i % 2 else "chat", kind, 200, p["fault_max_tokens"],
                          chat=bool(i % 2)) for i in range(p["fault_streams"])]
            results: list[Result] = []
            bar = progress(len(specs), f"preemption {kind}", opts.progress)
            async with new_session() as session:
                tasks = await fire(session, target, specs, bar, results)
                await asyncio.sleep(p["fault_after_s"])
                acted = time.perf_counter()
                action = await _act(kind, gw, sim0, p)
                await asyncio.wait(tasks, timeout=p["time_bound_s"])
                await cancel_all(tasks)
            bar.close()
            moved = await _metric_values(gw.url, PREEMPT_SERIES)
    whole = [r for r in results if r.ok and r.output_tokens == p["fault_max_tokens"]]
    running_at_fault = sum(1 for r in results if r.first_token_s is not None
                           and r.first_token_s < acted)
    return {"streams": len(results), "completed": len(whole),
            "errored": len(results) - len(whole), "running_at_fault": running_at_fault,
            "error_sample": next((r.error for r in results if r.error), None),
            "action": action, "continuations": moved}


async def _act(kind: str, gw: Proc, sim0: Proc, p: dict[str, Any]) -> str:
    if kind == "failover":
        sim0.process.send_signal(signal.SIGKILL)
        sim0.process.wait(timeout=10)
        return "SIGKILL b0"
    async with aiohttp.ClientSession() as http, http.post(
            gw.url + "/admin/backends/b0/drain", json={"migrate": True,
                                                       "grace_s": p["drain_grace_s"]},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
        return f"drain b0: HTTP {resp.status}"


def _ttft(results: list[Result], q: float) -> float | None:
    values = [r.ttft for r in results if r.tag == "newcomer" and r.ttft is not None]
    value = percentile(values, q)
    return None if value is None else round(value * 1000, 1)


def _batch_tok_s(results: list[Result]) -> float:
    batch = [r for r in results if r.tag == "batch"]
    return float(summarize(batch)["output_tok_s"]) if batch else 0.0


def _headline(p: dict[str, Any], runs: dict[str, list[Result]], recomputed: float,
              preemptions: float, faults: dict[str, dict[str, Any]]) -> list[report.Headline]:
    d50, off50, on50 = (_ttft(runs[r], 50) for r in RUNS)
    d99, off99, on99 = (_ttft(runs[r], 99) for r in RUNS)
    off_tok, on_tok = _batch_tok_s(runs["off"]), _batch_tok_s(runs["on"])
    batch_out = sum(r.output_tokens for r in runs["on"] if r.tag == "batch")
    share = round(100 * recomputed / batch_out, 2) if batch_out else None
    r50 = ratio(off50, on50)
    rows = [
        report.Headline("newcomer TTFT p50 (ms): direct | preemption on; ratio = direct ÷ on",
                        d50, on50, ratio(d50, on50), "–", None),
        report.Headline("newcomer TTFT p50 (ms): preemption off | on; ratio = off ÷ on",
                        off50, on50, r50, "≥ 10× lower", None if r50 is None else r50 >= 10),
        report.Headline("newcomer TTFT p99 (ms): preemption off | on; ratio = off ÷ on",
                        off99, on99, ratio(off99, on99), "–", None),
        report.Headline("newcomer TTFT p99 (ms): direct | preemption on",
                        d99, on99, ratio(d99, on99), "–", None),
        report.Headline("batch output tok/s: preemption off | on; ratio = on ÷ off",
                        off_tok, on_tok, ratio(on_tok, off_tok), "≥ 0.9",
                        None if not off_tok else on_tok / off_tok >= 0.9),
        report.Headline("batch tokens sent again by preempted streams (% of batch output); "
                        "preemptions", preemptions, share, None, "≤ 10 %",
                        None if share is None else share <= 10),
    ]
    for kind, what in (("failover", "SIGKILL 1 of 4 backends"),
                       ("drain", "drain b0 with migrate")):
        f = faults.get(kind)
        if f is None:
            continue
        acted = kind == "failover" or "HTTP 200" in f["action"]
        rows.append(report.Headline(
            f"{kind} ({what}; {f['action']}): streams completed | errored", f["completed"],
            f["errored"], None, "0 errored", f["errored"] == 0 and acted))
    return rows


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    runs: dict[str, list[Result]] = {}
    moved: dict[str, float] = {}
    faults: dict[str, dict[str, Any]] = {}
    async with Bench(opts) as bench:
        async with bench.backend(SIM, "sim-direct") as be:
            runs["direct"] = await _ttft_phase(opts, p, be.target())
        for name, on in (("off", False), ("on", True)):
            async with bench.served(SIM, f"sim-{name}", _users(p), f"gateway-{name}",
                                    preemption=on) as (be, gw):
                runs[name] = await _ttft_phase(opts, p, gateway_target(gw, be, name))
                if on:
                    moved = await _metric_values(gw.url, PREEMPT_SERIES)
        if not opts.backend:  # the fault phases need simulators of their own
            for kind in ("failover", "drain"):
                faults[kind] = await _fault_phase(opts, p, bench, kind)
    recomputed = moved.get("fairgate_continuation_recomputed_tokens_total{reason=preempt}", 0.0)
    preemptions = moved.get("fairgate_preemptions_total", 0.0)
    summary: dict[str, Any] = {
        name: {"newcomer": summarize([r for r in results if r.tag == "newcomer"]),
               "batch": summarize([r for r in results if r.tag == "batch"]),
               "newcomer_ttft_ms": sorted(round((r.ttft or 0) * 1000, 1) for r in results
                                          if r.tag == "newcomer" and r.ttft is not None)}
        for name, results in runs.items()}
    summary["on"]["gateway_metrics"] = moved
    summary["faults"] = faults
    headline = _headline(p, runs, recomputed, preemptions, faults)
    fig, ax = report.figure("Newcomer TTFT beside a batch load filling every slot",
                            "newcomer", "TTFT (ms, log)")
    for name, marker in zip(RUNS, ("o", "s", "^"), strict=True):
        values = summary[name]["newcomer_ttft_ms"]
        ax.plot(range(len(values)), values, marker=marker, linestyle="", label=name)
    ax.set_yscale("log")
    ax.legend()
    return report.write(opts, "preemption", p, summary, headline,
                        {"newcomer_ttft.png": fig})
