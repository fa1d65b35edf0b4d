"""``sessions``: one user runs an agent of many parallel calls in one session and a chat
of one call at a time in another, through fairgate with ``sessions`` off, then on.

Off, the user is one queue: each chat turn waits behind the agent's backlog in it. On,
the user's sessions share its service (the third fairness level, docs/scheduling.md):
a chat turn waits for about one of the agent's calls. Measured: the chat session's TTFT
(p50, p99) in each run, and the agent's throughput (its user's share is the same either
way; here it is alone on the backend).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from loadtest.bench import report
from loadtest.bench.client import Result, Spec, new_session, send
from loadtest.bench.env import Bench, Options, gateway_target
from loadtest.bench.loadgen import cancel_all
from loadtest.bench.procs import SimSpec
from loadtest.bench.stats import percentile, ratio, summarize

RUNS = ("sessions_off", "sessions_on")
USER = "agentuser"


def params(opts: Options) -> dict[str, Any]:
    return {
        "agent_parallel": opts.size or opts.pick(50, 12), "agent_prompt_tokens": 800,
        "agent_max_tokens": opts.pick(128, 32), "chat_turns": opts.pick(20, 4),
        "chat_prompt_tokens": 200, "chat_max_tokens": 32,
        "sim": SimSpec(max_num_seqs=opts.pick(16, 4)).__dict__,
        "time_bound_s": opts.pick(300.0, 60.0),
    }


async def _phase(target: Any, p: dict[str, Any]) -> list[Result]:
    """The agent keeps ``agent_parallel`` calls in flight in session "agent" while the
    chat session sends its turns one at a time; ends with the last turn (bounded)."""
    results: list[Result] = []
    done = asyncio.Event()
    agent_spec = Spec(USER, "agent", p["agent_prompt_tokens"], p["agent_max_tokens"], True,
                      session="agent")

    async with new_session() as session:
        async def agent_worker() -> None:
            while not done.is_set():
                await send(session, target, agent_spec, results)

        async def chat() -> None:
            await asyncio.sleep(0.5)  # the agent's calls are queued first
            for _ in range(p["chat_turns"]):
                await send(session, target, Spec(USER, "chat", p["chat_prompt_tokens"],
                                                 p["chat_max_tokens"], True,
                                                 session="chat"), results)

        workers = [asyncio.create_task(agent_worker()) for _ in range(p["agent_parallel"])]
        try:
            await asyncio.wait_for(chat(), p["time_bound_s"])
        except TimeoutError:
            pass  # a bounded run: the turns not sent are missing from the count
        finally:
            done.set()
            await asyncio.wait(workers, timeout=5.0)
            await cancel_all(workers)
    return results


def _ttft_ms(results: list[Result], q: float) -> float | None:
    value = percentile([r.ttft for r in results if r.tag == "chat" and r.ttft is not None], q)
    return None if value is None else round(value * 1000, 2)


async def run(opts: Options) -> dict[str, Any]:
    p = params(opts)
    runs: dict[str, list[Result]] = {}
    spans: dict[str, float] = {}
    async with Bench(opts) as bench:
        for name in RUNS:
            async with bench.served(SimSpec(**p["sim"]), f"sim-{name}", [(USER, "interactive")],
                                    f"gateway-{name}", sessions=name == "sessions_on"
                                    ) as (be, gw):
                started = time.perf_counter()
                runs[name] = await _phase(gateway_target(gw, be, name), p)
                spans[name] = time.perf_counter() - started
    summary: dict[str, dict[str, Any]] = {
        name: {"chat": summarize([r for r in results if r.tag == "chat"]),
               "agent": summarize([r for r in results if r.tag == "agent"]),
               "chat_ttft_ms": sorted(round((r.ttft or 0) * 1000, 2) for r in results
                                      if r.tag == "chat" and r.ttft is not None),
               "run_s": spans[name]}
        for name, results in runs.items()
    }
    off, on = runs["sessions_off"], runs["sessions_on"]
    p50 = ratio(_ttft_ms(off, 50), _ttft_ms(on, 50))
    headline = [
        report.Headline("chat session TTFT p50 (ms); direct = sessions off, gateway = on, "
                        "ratio = off ÷ on", _ttft_ms(off, 50), _ttft_ms(on, 50), p50,
                        "≥ 5× lower", None if p50 is None else p50 >= 5),
        report.Headline("chat session TTFT p99 (ms); off vs on", _ttft_ms(off, 99),
                        _ttft_ms(on, 99), ratio(_ttft_ms(off, 99), _ttft_ms(on, 99)), "–",
                        None),
        report.Headline("chat turns completed; off vs on",
                        summary["sessions_off"]["chat"]["completed"],
                        summary["sessions_on"]["chat"]["completed"], None,
                        f"{p['chat_turns']} of {p['chat_turns']}", None),
        report.Headline("agent output tok/s; off vs on",
                        summary["sessions_off"]["agent"]["output_tok_s"],
                        summary["sessions_on"]["agent"]["output_tok_s"], None, "–", None),
    ]
    fig, ax = report.figure("A chat session beside an agent of parallel calls (one user)",
                            "chat turn (sorted)", "TTFT (ms, log)")
    for name, marker in zip(RUNS, ("o", "s"), strict=True):
        values = summary[name]["chat_ttft_ms"]
        ax.plot(range(len(values)), values, marker=marker, linestyle="", label=name)
    ax.set_yscale("log")
    ax.legend()
    return report.write(opts, "sessions", p, summary, headline, {"chat_ttft.png": fig})
