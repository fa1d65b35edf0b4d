"""``locality``: multi-turn chat sessions with per-session system prompts on several
simulated backends: direct round-robin vs fairgate ``routing: least_loaded`` vs
``routing: locality``, and locality with the prefill-token gate off (the behaviour before
it, ``max_waiting_prefill_tokens: 0``), with a length-aware pool (the last backend a
``long_context`` pool for prompts over ``pool_split_tokens``, the others below it), and
both routings with one request waiting per backend (``max_waiting: 1``, not the default 3).

Each session has its own long system prompt and runs its turns one after the other (each
turn adds the previous answer and a new question), all sessions at once; two users own
half of the sessions. Beside them, RAG users each send long prompts (distinct documents)
one after the other until the chats are done. The backends are small enough to be
saturated, so requests queue and where each goes matters. Prefix hits come from the
simulators' own vLLM counters (``vllm:prefix_cache_queries_total`` /
``vllm:prefix_cache_hits_total``); prompt tokens computed = queries − hits. TPOT p99 is
taken over the chat streams that overlap a RAG prompt's [sent, first token] (its queueing
and prefill); Jain's index of weighted service (prompt × 1 at the first token, output × 2
per token, VTC's weights) over sliding windows among the users backlogged for the whole
window, as ``fairgate bench fairness`` measures it: in the unit fairgate charges (the
prompt tokens the backend computed, its usage's ``cached_tokens`` left out; the
simulators report them as ``deploy/`` runs vLLM, ``--enable-prompt-tokens-details``), and,
for comparison, counting every prompt token; and, through the gateway, among the users
with a request waiting in its queue for the whole window (VTC's "backlogged": a user
served at once on every arrival asks for less than a fair share and gets all of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.bench import report
from loadtest.bench.client import Result, cached_tokens, new_session
from loadtest.bench.env import MODEL, Bench, Options, api_keys, save_diagnostics
from loadtest.bench.loadgen import progress
from loadtest.bench.procs import GatewayStart, Proc, SimSpec, sim_fleet, start_gateway
from loadtest.bench.stats import (
    backlogged,
    jain,
    percentile,
    queued,
    service_by_user,
    sliding_windows,
)

WORD = " the"  # one simulator token
# name -> (routing, more gateway settings, whether the last backend is a long_context pool)
VARIANTS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "least_loaded": ("least_loaded", {}, False),
    "locality": ("locality", {}, False),
    "locality_no_prefill_gate": ("locality", {"classes": {
        "interactive": {"max_waiting_prefill_tokens": 0}}}, False),
    "locality_pools": ("locality", {}, True),
    # one request waiting per backend instead of the default 3 (RESULTS: the knob that
    # moves TTFT on this workload, and what it costs on bench utilization's)
    "least_loaded_waiting_1": ("least_loaded", {"classes": {
        "interactive": {"max_waiting": 1}}}, False),
    "locality_waiting_1": ("locality", {"classes": {"interactive": {"max_waiting": 1}}},
                           False),
}
W_IN, W_OUT = 1.0, 2.0


def params(opts: Options) -> dict[str, Any]:
    return {
        "backends": opts.pick(4, 2), "sessions": opts.size or opts.pick(64, 6),
        "users": opts.pick(16, 3), "turns": opts.pick(6, 3),
        "system_prompt_tokens": opts.pick(1500, 400), "question_tokens": 100,
        "max_tokens": opts.pick(64, 8),
        "rag_users": opts.pick(4, 1), "rag_prompt_tokens": opts.pick(12_000, 2_000),
        "rag_max_tokens": opts.pick(64, 8),
        # runs last about 10 s on a quiet machine: 4 s windows give a dozen of them
        "jain_window_s": opts.pick(4.0, 2.0), "jain_step_s": opts.pick(0.5, 0.5),
        "weights": {"input": W_IN, "output": W_OUT},
        "sim": SimSpec(max_num_seqs=opts.pick(6, 2)).__dict__,
        "gateway": "defaults; " + "; ".join(
            f"{name}: routing {routing} {extra or ''}{' + long_context pool' * pools}".strip()
            for name, (routing, extra, pools) in VARIANTS.items()),
        # locality_pools: the short pool's max_prompt_tokens (above: the long pool)
        "pool_split_tokens": opts.pick(8192, 1000),
    }


@dataclass
class Turn:
    user: str
    session: int
    turn: int
    sent_s: float
    first_token_s: float | None = None
    end_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, from the backend's prefix cache (its usage)
    queue_wait_s: float | None = None  # in the gateway's queue (X-Fairgate-Queue-Wait-Ms)
    error: str | None = None
    text: list[str] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    kind: str = "chat"  # or "rag"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s


def owner(session: int, p: dict[str, Any]) -> str:
    """Two users own half the sessions; the others share the rest."""
    half = p["sessions"] // 2
    if session < half:
        return f"u{session % 2:02d}"
    return f"u{2 + (session - half) % (p['users'] - 2):02d}"


def system_prompt(session: int, tokens: int) -> str:
    return f"Session {session:04d} house rules." + WORD * tokens


async def chat_turn(http: aiohttp.ClientSession, url: str, headers: dict[str, str],
                    messages: list[dict[str, str]], turn: Turn, max_tokens: int) -> None:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            wait_ms = resp.headers.get("X-Fairgate-Queue-Wait-Ms")
            if wait_ms is not None and wait_ms.isdigit():
                turn.queue_wait_s = int(wait_ms) / 1000
            if resp.status != 200:
                turn.error = (await resp.text())[:300]
                return
            pending = b""
            async for chunk in resp.content.iter_any():
                pending += chunk
                *frames, pending = pending.split(b"\n\n")
                for frame in frames:
                    if not frame.startswith(b"data: {"):
                        continue
                    obj = json.loads(frame[6:])
                    for choice in obj.get("choices") or ():
                        if text := (choice.get("delta") or {}).get("content"):
                            now = time.perf_counter()
                            turn.first_token_s = turn.first_token_s or now
                            turn.token_times.append(now)
                            turn.text.append(text)
                    if usage := obj.get("usage"):
                        turn.output_tokens = int(usage.get("completion_tokens") or 0)
                        turn.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        turn.cached_tokens = cached_tokens(usage)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        turn.error = repr(exc)[:300]
    finally:
        turn.end_s = time.perf_counter()


async def run_sessions(urls: list[str], via_gateway: bool, p: dict[str, Any],
                       label: str, show: bool) -> list[Turn]:
    """Every session at once, turns in order; direct: each request to the next backend
    (round-robin), through fairgate: all to the gateway (``urls[0]``)."""
    turns: list[Turn] = []
    next_backend = itertools.cycle(urls)
    bar = progress(p["sessions"] * p["turns"], f"locality {label}", show)

    async def session(http: aiohttp.ClientSession, i: int) -> None:
        user = owner(i, p)
        headers = {"Authorization": f"Bearer sk-{user}"} if via_gateway else {}
        messages = [{"role": "system", "content": system_prompt(i, p["system_prompt_tokens"])}]
        for t in range(p["turns"]):
            messages.append({"role": "user",
                             "content": f"Question {t}:" + WORD * p["question_tokens"]})
            turn = Turn(user, i, t, time.perf_counter())
            turns.append(turn)
            await chat_turn(http, next(next_backend), headers, messages, turn, p["max_tokens"])
            bar.update(1)
            if turn.error:
                return
            messages.append({"role": "assistant", "content": "".join(turn.text)})

    chats_done = asyncio.Event()

    async def rag(http: aiohttp.ClientSession, r: int) -> None:
        user = f"r{r:02d}"
        headers = {"Authorization": f"Bearer sk-{user}"} if via_gateway else {}
        for n in itertools.count():
            if chats_done.is_set():
                return
            doc = f"Document {r:02d}-{n:04d} for retrieval." + WORD * p["rag_prompt_tokens"]
            messages = [{"role": "user", "content": doc + " Summarise it."}]
            turn = Turn(user, -1 - r, n, time.perf_counter(), kind="rag")
            turns.append(turn)
            await chat_turn(http, next(next_backend), headers, messages, turn,
                            p["rag_max_tokens"])
            if turn.error:
                return

    async def chats(http: aiohttp.ClientSession) -> None:
        try:
            await asyncio.gather(*(session(http, i) for i in range(p["sessions"])))
        finally:
            chats_done.set()

    async with new_session() as http:
        await asyncio.gather(chats(http), *(rag(http, r) for r in range(p["rag_users"])))
    bar.close()
    return turns


async def prefix_counters(urls: list[str]) -> dict[str, float]:
    """The backends' own counters, summed: prefix cache queries and hits, prompt tokens,
    and the sums and counts of vLLM's queue-time and prefill-time histograms."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {"vllm:prefix_cache_queries_total": "queries",
             "vllm:prefix_cache_hits_total": "hits", "vllm:prompt_tokens_total": "prompt_tokens",
             # where a request's time to first token went at the engine (every request)
             "vllm:request_queue_time_seconds_sum": "queue_s",
             "vllm:request_queue_time_seconds_count": "queued",
             "vllm:request_prefill_time_seconds_sum": "prefill_s",
             "vllm:request_prefill_time_seconds_count": "prefilled"}
    totals = dict.fromkeys(names.values(), 0.0)
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in names:
                        totals[names[sample.name]] += sample.value
    return totals


def tpot(t: Turn) -> float | None:
    if t.first_token_s is None or len(t.token_times) < 2:
        return None
    return (t.token_times[-1] - t.first_token_s) / (len(t.token_times) - 1)


def tpot_during_rag_prefill(turns: list[Turn]) -> list[float]:
    """TPOT of the chat streams whose streaming overlaps some RAG prompt's wait for its
    first token (its queueing and prefill)."""
    spans = [(t.sent_s, t.first_token_s) for t in turns
             if t.kind == "rag" and t.first_token_s is not None]
    out = []
    for t in turns:
        value = tpot(t)
        if t.kind != "chat" or value is None or t.first_token_s is None:
            continue
        if any(a < t.end_s and t.first_token_s < b for a, b in spans):
            out.append(value)
    return out


def weighted_jain(turns: list[Turn], p: dict[str, Any], uncached: bool = True,
                  key: str = "jain", among: Callable[..., set[str]] = backlogged
                  ) -> dict[str, Any]:
    """Jain's index of weighted service over sliding windows, among the users ``among``
    picks for each window: ``backlogged`` (a request outstanding throughout: the issue's
    measure) or ``queued`` (a request waiting in the gateway's queue throughout: VTC's
    "backlogged", the users its bound is about; through the gateway only). ``uncached``:
    in the unit fairgate charges (the prompt tokens vLLM computed), else counting every
    prompt token."""
    results = [Result(t.user, t.kind, t.prompt_tokens, t.sent_s, t.end_s, 200,
                      t.first_token_s, t.token_times, t.output_tokens, t.error,
                      t.cached_tokens, t.queue_wait_s)
               for t in turns]
    start = min(t.sent_s for t in turns)
    end = max(t.end_s for t in turns)
    indices = []
    for a, b in sliding_windows(start, end, p["jain_window_s"], p["jain_step_s"]):
        users = among(results, a, b)
        served = service_by_user(results, a, b, W_IN, W_OUT, uncached)
        index = jain([served.get(u, 0.0) for u in sorted(users)]) if len(users) > 1 else None
        if index is not None:
            indices.append(index)
    return {f"{key}_mean": round(sum(indices) / len(indices), 4) if indices else None,
            f"{key}_min": round(min(indices), 4) if indices else None,
            f"{key}_windows": len(indices)}


def analyse(all_turns: list[Turn], counters: dict[str, float], p: dict[str, Any]
            ) -> dict[str, Any]:
    turns = [t for t in all_turns if t.kind == "chat"]
    rags = [t for t in all_turns if t.kind == "rag"]
    ok = [t for t in turns if t.error is None and t.first_token_s is not None]
    start = min(t.sent_s for t in turns)
    end = max(t.end_s for t in turns)
    ttfts = [t.ttft for t in ok if t.ttft is not None]
    later = [t.ttft for t in ok if t.ttft is not None and t.turn > 0]
    during_rag = tpot_during_rag_prefill(all_turns)
    served = [t for t in all_turns if t.error is None]
    queries, hits = counters["queries"], counters["hits"]
    return {
        "requests": len(turns), "completed": len(ok), "errors": len(turns) - len(ok),
        "error_sample": next((t.error for t in turns if t.error), None),
        "makespan_s": round(end - start, 3),
        "output_tok_s": round(sum(t.output_tokens for t in served) / max(end - start, 1e-9),
                              2),
        "rag_requests": len(rags), "rag_errors": sum(1 for t in rags if t.error),
        "rag_ttft_p50_ms": _ms(percentile([t.ttft for t in rags if t.ttft is not None], 50)),
        "tpot_p99_during_rag_prefill_ms": _ms(percentile(during_rag, 99)),
        "streams_during_rag_prefill": len(during_rag),
        "tpot_p99_ms": _ms(percentile([v for t in ok if (v := tpot(t)) is not None], 99)),
        **weighted_jain(all_turns, p),
        **weighted_jain(all_turns, p, uncached=False, key="jain_all_prompt"),
        **weighted_jain(all_turns, p, key="jain_queued", among=queued),
        "cached_tokens": sum(t.cached_tokens for t in served),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        # the part of a chat turn's TTFT spent in the gateway's queue (none direct)
        "queue_wait_p50_ms": _ms(percentile(
            [t.queue_wait_s for t in ok if t.queue_wait_s is not None], 50)),
        "ttft_later_turns_p50_ms": _ms(percentile(later, 50)),
        "ttft_later_turns_p99_ms": _ms(percentile(later, 99)),
        # vLLM's own split of a request's wait for its first token (chat and RAG alike):
        # waiting for a slot, then its prefill
        "vllm_queue_time_mean_ms": _ms(counters["queue_s"] / counters["queued"])
        if counters["queued"] else None,
        "vllm_prefill_time_mean_ms": _ms(counters["prefill_s"] / counters["prefilled"])
        if counters["prefilled"] else None,
        "prefix_queries": queries, "prefix_hits": hits,
        "prefix_hit_rate": round(hits / queries, 4) if queries else None,
        "prompt_tokens_computed": queries - hits,
        # RAG documents are distinct: their prompts are computed in full, so the chats'
        # share of the computed tokens is the rest
        "rag_prompt_tokens": (rag_prompts := sum(t.prompt_tokens for t in rags)),
        "chat_prompt_tokens_computed": queries - hits - rag_prompts,
        "ttft_series_ms": [_ms(t.ttft) for t in sorted(ok, key=lambda t: t.sent_s)],
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def sims(bench: Bench, p: dict[str, Any], label: str, gateway: GatewayStart | None = None
         ) -> contextlib.AbstractAsyncContextManager[list[Proc]]:
    """``backends`` fresh simulators, started side by side; with ``gateway`` (its start,
    given their URLs) the gateway after them, as the last process."""
    return sim_fleet(SimSpec(**p["sim"]), MODEL, bench.log_dir, label, p["backends"], gateway)


async def _direct(bench: Bench, p: dict[str, Any]) -> dict[str, Any]:
    async with sims(bench, p, "sim-direct") as procs:
        urls = [s.url for s in procs]
        turns = await run_sessions(urls, False, p, "direct", bench.opts.progress)
        return analyse(turns, await prefix_counters(urls), p)


def backend_options(index: int, count: int, long_pool: bool, split: int) -> dict[str, Any]:
    """A backend's prompt range in a variant with a long pool: the last backend takes
    prompts over ``split`` tokens, the others the rest."""
    if not long_pool:
        return {}
    if index == count - 1:
        return {"min_prompt_tokens": split + 1, "pool": "long_context"}
    return {"max_prompt_tokens": split}


async def _gateway(bench: Bench, p: dict[str, Any], variant: str) -> dict[str, Any]:
    routing, extra, pools = VARIANTS[variant]
    import redis

    client = redis.Redis.from_url(bench.redis_url)
    try:
        client.flushdb()
    finally:
        client.close()
    users = sorted({owner(i, p) for i in range(p["sessions"])}
                   | {f"r{r:02d}" for r in range(p["rag_users"])})
    label = f"gateway-{variant}"

    def gateway(urls: list[str]) -> tuple[str, Coroutine[Any, Any, Proc]]:
        config = {"redis_url": bench.redis_url, "routing": routing, **extra,
                  "backends": [{"name": f"b{i}", "url": url, "model": MODEL,
                                **backend_options(i, len(urls), pools,
                                                  p["pool_split_tokens"])}
                               for i, url in enumerate(urls)],
                  "api_keys": api_keys([(u, "interactive") for u in users])}
        return label, start_gateway(config, bench.log_dir, label, bench.opts.workers)

    async with sims(bench, p, f"sim-{variant}", gateway) as started:
        *procs, gw = started
        try:
            turns = await run_sessions([gw.url], True, p, variant, bench.opts.progress)
            await save_diagnostics(gw.url, bench.opts.out / "gateway_diagnostics.json",
                                   variant)
        finally:
            gw.stop()
        return analyse(turns, await prefix_counters([s.url for s in procs]), p)


COMPARED = (("prompt tokens computed", "prompt_tokens_computed"),
            ("chat TTFT p50 ms", "ttft_p50_ms"), ("chat TTFT p99 ms", "ttft_p99_ms"),
            ("output tok/s", "output_tok_s"),
            ("TPOT p99 during RAG ms", "tpot_p99_during_rag_prefill_ms"),
            ("Jain mean", "jain_mean"), ("Jain, waiting in the queue", "jain_queued_mean"))


def variants_table(runs: dict[str, Any]) -> str:
    """Every run side by side, each value with its ratio to least_loaded's."""
    base = runs["least_loaded"]

    def cell(run: dict[str, Any], key: str) -> str:
        value, ref = run.get(key), base.get(key)
        if value is None:
            return "–"
        ratio = f" ({value / ref:.2f}×)" if ref and run is not base else ""
        return f"{value:,.3f}{ratio}" if isinstance(value, float) and value < 10 \
            else f"{value:,.0f}{ratio}"

    lines = ["| run | " + " | ".join(label for label, _ in COMPARED) + " |",
             "|---|" + "---:|" * len(COMPARED)]
    lines += [f"| {name} | " + " | ".join(cell(run, key) for _, key in COMPARED) + " |"
              for name, run in runs.items()]
    return "\n".join(lines)


async def run(opts: Options) -> dict[str, Any]:
    if opts.backend:
        raise SystemExit("bench locality runs its own simulated backends (no --backend)")
    p = params(opts)
    runs: dict[str, Any] = {}
    async with Bench(opts) as bench:
        runs["direct_round_robin"] = await _direct(bench, p)
        for variant in VARIANTS:
            runs[variant] = await _gateway(bench, p, variant)
    d, blind, local = runs["direct_round_robin"], runs["least_loaded"], runs["locality"]

    def row(metric: str, key: str, target: str = "–", good: str | None = None,
            factor: float = 1.0) -> report.Headline:
        ratio = round(local[key] / blind[key], 3) if blind[key] and local[key] is not None \
            else None
        met = None
        if good == "lower" and ratio is not None:
            met = ratio <= factor
        elif good == "higher" and ratio is not None:
            met = ratio >= factor
        return report.Headline(metric, blind[key], local[key], ratio, target, met)

    headline = [
        row("prefix cache hit rate (vLLM counters)", "prefix_hit_rate"),
        row("prompt tokens computed (queries − hits)", "prompt_tokens_computed",
            "≤ 0.5× least_loaded", "lower", 0.5),
        row("of which chat turns (computed − RAG prompts)", "chat_prompt_tokens_computed"),
        row("TTFT p50 of chat turns (ms)", "ttft_p50_ms", "≥ 2× lower", "lower", 0.5),
        row("TTFT p99 of chat turns (ms)", "ttft_p99_ms"),
        row("of the TTFT, in the gateway's queue: p50 (ms)", "queue_wait_p50_ms"),
        row("at vLLM, waiting for a slot: mean of every request (ms)",
            "vllm_queue_time_mean_ms"),
        row("at vLLM, prefill: mean of every request (ms)", "vllm_prefill_time_mean_ms"),
        row("output tok/s", "output_tok_s", "≥ least_loaded", "higher", 1.0),
        row("TPOT p99 of chat streams while RAG prompts prefill (ms)",
            "tpot_p99_during_rag_prefill_ms"),
        row("Jain's index of charged service (window mean)", "jain_mean"),
        row("Jain's index counting cached prompt tokens too (window mean)",
            "jain_all_prompt_mean"),
        row("Jain's index of charged service among users waiting in the gateway's queue "
            "(VTC's backlogged; window mean)", "jain_queued_mean"),
        report.Headline("TPOT p99 while RAG prompts prefill, locality (ms)",
                        None, local["tpot_p99_during_rag_prefill_ms"], None, "≤ 150",
                        None if local["tpot_p99_during_rag_prefill_ms"] is None
                        else local["tpot_p99_during_rag_prefill_ms"] <= 150),
        report.Headline("Jain's index, locality", None, local["jain_mean"], None, "≥ 0.95",
                        None if local["jain_mean"] is None else local["jain_mean"] >= 0.95),
        report.Headline("prefix hit rate, direct round-robin", d["prefix_hit_rate"],
                        None, None, "–", None),
    ]
    # the same comparison with one request waiting per backend (direct column: least_loaded)
    blind1, local1 = runs["least_loaded_waiting_1"], runs["locality_waiting_1"]
    for metric, key in (("TTFT p50 of chat turns (ms)", "ttft_p50_ms"),
                        ("output tok/s", "output_tok_s"),
                        ("Jain's index of charged service (window mean)", "jain_mean")):
        a, b = blind1[key], local1[key]
        headline.append(report.Headline(
            f"{metric}, max_waiting 1 (least_loaded → locality)", a, b,
            round(b / a, 3) if a and b is not None else None, "–", None))
    fig, ax = report.figure("Prompt tokens computed vs cached (all backends)", "run", "tokens")
    names = list(runs)
    computed = [runs[n]["prompt_tokens_computed"] for n in names]
    cached = [runs[n]["prefix_hits"] for n in names]
    ax.bar(names, computed, label="computed")
    ax.bar(names, cached, bottom=computed, label="cached (prefix hits)")
    ax.legend()
    fig2, ax2 = report.figure("TTFT of chat turns, in send order", "turn", "TTFT (ms)")
    for name in names:
        ax2.plot(runs[name]["ttft_series_ms"], label=name, linewidth=0.8)
    ax2.set_yscale("log")
    ax2.legend()
    notes = ["Columns: **direct** = fairgate `routing: least_loaded`, **gateway** = "
             "`routing: locality`, ratio = locality ÷ least_loaded. Direct round-robin "
             "(no gateway) is in report.json under `direct_round_robin`.",
             variants_table(runs)]
    return report.write(opts, "locality", p, runs, headline,
                        {"locality_prefill.png": fig, "locality_ttft.png": fig2}, notes)
