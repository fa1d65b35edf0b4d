"""Fair share across models (``fairness_scope``): a tenant sending to two models against a
tenant on one, issue 27's fleet-scope phase.

Two simulated vLLM backends in this process, one per model: ``x`` (cost factor 1) and
``y`` (``y_factor``), ``max_num_seqs`` 2 each so requests queue in the gateway; one
gateway in this process on the given Redis (best empty: scores an earlier run left there
shift the start), with ``fairness_scope`` as asked. Tenant ``a`` floods both models,
tenant ``b`` floods ``x`` only, through the ``openai`` SDK; every request is one shape (a
200-token prompt, a few output tokens, ``ignore_eos``).

Run: ``asyncio.run(run_phase(redis_url, "fleet"))`` (and ``"model"`` for the contrast);
``Shares.report()`` is the row to record.

Measured at the backends (their own records, not the gateway's): while all three streams
are backlogged (from the latest first start to the earliest last start of ``a`` on x,
``a`` on y and ``b`` on x), each tenant's weighted service: the tokens its requests were
given, prompt × ``vtc_input_weight`` + output × ``vtc_output_weight`` (1 and 2), times
the model's cost factor, summed over the models, ÷ its tenant weight; its share is that
over both tenants'. Fleet scope: each share within 5 % of a half (``a`` yields its turn on
x for what y gave it). Per model: ``a`` gets half of x besides y (about 2:1 at y_factor
0.5).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import openai

from gateway.core.settings import load_settings
from gateway.http.server import GatewayServer
from loadtest.sim.engine import EngineConfig
from loadtest.sim.server import SimServer

X, Y = "model-x", "model-y"
W_IN, W_OUT = 1.0, 2.0  # the default vtc_input_weight, vtc_output_weight
PROMPT_CHARS = 800  # 200 tokens (a quarter token per ASCII character, as both count)
A_TOKENS, B_TOKENS = 6, 7  # output tokens: the backends' records tell the tenants apart
KEYS = [{"key": "sk-a", "user": "alice", "tenant": "a", "priority_class": "interactive"},
        {"key": "sk-b", "user": "bob", "tenant": "b", "priority_class": "interactive"}]


@dataclass(frozen=True, slots=True)
class Served:
    """One request as a backend ran it: when it was first scheduled (the backend's loop
    clock) and the tokens it was given."""

    tenant: str
    model: str
    at_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Shares:
    scope: str
    shares: dict[str, float]  # tenant -> its weighted share in the window
    service: dict[str, float]  # tenant -> weighted service in the window
    requests: dict[str, int]  # "tenant@model" -> requests started in the window
    window_s: float

    def report(self) -> dict[str, Any]:
        return {"scope": self.scope, "shares": {t: round(s, 4) for t, s in self.shares.items()},
                "requests": self.requests, "window_s": round(self.window_s, 3)}


def window_shares(scope: str, served: Iterable[Served], factors: Mapping[str, float],
                  weights: Mapping[str, float]) -> Shares:
    """Each tenant's weighted share while every (tenant, model) stream is backlogged:
    from the latest first start to the earliest last start of the streams (the last
    start itself excluded)."""
    runs = sorted(served, key=lambda s: s.at_s)
    streams: dict[tuple[str, str], list[float]] = {}
    for s in runs:
        streams.setdefault((s.tenant, s.model), []).append(s.at_s)
    start = max(times[0] for times in streams.values())
    end = min(times[-1] for times in streams.values())
    service = dict.fromkeys(weights, 0.0)
    requests: dict[str, int] = {}
    for s in runs:
        if start <= s.at_s < end:
            amount = (s.prompt_tokens * W_IN + s.output_tokens * W_OUT) * factors.get(s.model, 1.0)
            service[s.tenant] += amount / weights[s.tenant]
            where = f"{s.tenant}@{s.model}"
            requests[where] = requests.get(where, 0) + 1
    total = sum(service.values()) or 1.0
    return Shares(scope, {t: v / total for t, v in service.items()}, service, requests,
                  end - start)


def served_by(backend: SimServer, model: str) -> list[Served]:
    return [Served("a" if r.max_tokens == A_TOKENS else "b", model, r.first_scheduled_s,
                   r.prompt_tokens, r.output_tokens)
            for r in backend.engine.records.values() if r.first_scheduled_s is not None]


async def run_phase(redis_url: str, scope: str = "fleet", y_factor: float = 0.5,
                    a_on_x: int = 50, a_on_y: int = 120, b_on_x: int = 100,
                    **settings: Any) -> Shares:
    """Run the phase (``settings``: more gateway settings) and measure it. The counts
    are such that ``a``'s stream on y ends first in fleet scope, x still busy."""
    sims = [SimServer(EngineConfig(model=m, scheduling_policy="priority", max_num_seqs=2,
                                   profile="cpu-tiny")) for m in (X, Y)]
    for sim in sims:
        await sim.start()
    gw = GatewayServer(load_settings(None, **{
        "redis_url": redis_url, "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"name": "bx", "url": sims[0].url, "model": X},
                     {"name": "by", "url": sims[1].url, "model": Y}],
        "api_keys": KEYS, "tenants": {"a": {"weight": 1.0}, "b": {"weight": 1.0}},
        "fairness_scope": scope, "cost_factors": {Y: y_factor},
        "scrape_interval_s": 0.02, "replica_heartbeat_s": 0.2, **settings}))
    try:
        await gw.start()
        for handle in list(gw.services.pool.handles.values()):
            await handle.scraped.wait()
        await flood(gw.url, a_on_x, a_on_y, b_on_x)
    finally:
        await gw.stop()
        for sim in sims:
            await sim.stop()
    return window_shares(scope, served_by(sims[0], X) + served_by(sims[1], Y),
                         {X: 1.0, Y: y_factor}, {"a": 1.0, "b": 1.0})


async def flood(url: str, a_on_x: int, a_on_y: int, b_on_x: int) -> None:
    """Every request at once: all queue in the gateway (the SDK's pool takes 1,000
    connections, more than a phase sends)."""
    def client(key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0,
                                  timeout=300.0)

    def prompt(i: int) -> str:  # unique: nothing is found in a prefix cache
        return f"{i:06d} " + "x" * (PROMPT_CHARS - 7)

    async with client("sk-a") as a, client("sk-b") as b:
        calls = [c.completions.create(model=m, prompt=prompt(n * 1000 + i), max_tokens=t,
                                      extra_body={"ignore_eos": True})
                 for n, (c, m, t, count) in enumerate(((a, X, A_TOKENS, a_on_x),
                                                       (a, Y, A_TOKENS, a_on_y),
                                                       (b, X, B_TOKENS, b_on_x)))
                 for i in range(count)]
        await asyncio.gather(*calls)
