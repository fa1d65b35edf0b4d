"""Limits and budgets of keys and tenants: the decisions, without I/O.

A request is checked against up to two scopes, its key's limits and its tenant's, and is
admitted only when both allow it (``gateway/scheduling/quotas.py`` runs the check and the charge as
one Lua script, ``gateway/storage/lua/quota_admit.lua``, which mirrors :func:`bucket_level`).

- ``rpm`` and ``tpm`` are token buckets of that capacity, refilled evenly over a minute:
  a request needs one request unit and, for ``tpm``, its reservation (capped at the
  capacity) — the most it can cost, ``policies/cost.max_cost_tokens``: the prompt's
  bound plus its output bound (the model's context when it sets none) times ``n``. The end
  of the request corrects the reservation to the tokens vLLM reported (the bucket may go
  below zero: the next request waits until it refilled, so a key overdraws a minute by
  one request at most). A whole (non-streamed) answer cut before vLLM reported anything
  (its client gone, the upstream timeout) keeps its reservation: it may have generated
  up to its bound (``Ticket.cut`` in ``gateway/scheduling/admission.py``).
- ``max_concurrent``: requests admitted and not yet finished (slots with a lease).
- ``daily_tokens`` and ``monthly_tokens``: budgets per UTC day and calendar month. The
  reservation is charged at admission, so concurrent requests cannot spend the same
  budget twice, and corrected at the end; a request whose reservation does not fit is
  refused. A replica that dies leaves its reservations charged (never a lost count).

Over a rate limit: 429 ``rate_limit_exceeded`` with ``Retry-After`` (when the bucket holds
enough again); over a budget: 429 ``insufficient_quota``, ``Retry-After`` the start of the
next period. Every answer of a limited key carries OpenAI's ``x-ratelimit-*`` headers.
"""

from __future__ import annotations

import calendar
import math
import time
from dataclasses import dataclass

WINDOW_S = 60.0  # rpm and tpm refill over a minute
RATE_KINDS = ("rpm", "tpm", "max_concurrent")
BUDGET_KINDS = ("daily_tokens", "monthly_tokens")
KINDS = (*RATE_KINDS, *BUDGET_KINDS)


@dataclass(frozen=True, slots=True)
class Scope:
    """One set of limits a request is checked against: a key's or a tenant's."""

    kind: str  # "key" or "tenant"
    name: str  # the key id or the tenant name
    redis_scope: str  # "k:<key id>" or "t"
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    daily_tokens: int | None = None
    monthly_tokens: int | None = None

    def limit(self, kind: str) -> int | None:
        value: int | None = getattr(self, kind)
        return value

    def limits(self) -> dict[str, int]:
        """Every limit by its kind, as the Lua scripts take them (0: no limit)."""
        return {k: self.limit(k) or 0 for k in KINDS}


@dataclass(frozen=True, slots=True)
class ScopeState:
    """What is left of a scope's limits (None where it has no such limit)."""

    requests_remaining: int | None = None
    requests_reset_s: float = 0.0
    tokens_remaining: int | None = None
    tokens_reset_s: float = 0.0
    concurrent: int | None = None
    daily_remaining: int | None = None
    monthly_remaining: int | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    code: str  # "rate_limit_exceeded" or "insufficient_quota"
    message: str
    retry_after_s: int


def bucket_level(level: float | None, at: float | None, capacity: int, now: float) -> float:
    """A token bucket's level now: full when never used, refilled ``capacity`` a minute."""
    if level is None or at is None:
        return float(capacity)
    return min(float(capacity), level + max(0.0, now - at) * capacity / WINDOW_S)


def refill_s(level: float, need: float, capacity: int) -> float:
    """Seconds until a bucket at ``level`` holds ``need``."""
    return max(0.0, (need - level) * WINDOW_S / capacity)


def periods(now: float) -> tuple[str, str, int, int]:
    """(day id, month id, seconds to the next UTC day, to the next UTC month)."""
    t = time.gmtime(now)
    day_end = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0)) + 86400
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    month_end = calendar.timegm((year, month, 1, 0, 0, 0))
    return (f"d{t.tm_year:04d}{t.tm_mon:02d}{t.tm_mday:02d}", f"m{t.tm_year:04d}{t.tm_mon:02d}",
            math.ceil(day_end - now), math.ceil(month_end - now))


def refusal(scope: Scope, kind: str, retry_s: float, now: float) -> Refusal:
    """The answer to a request refused by ``scope``'s limit ``kind``."""
    who = f"{scope.kind} {scope.name!r}"
    limit = scope.limit(kind)
    if kind in BUDGET_KINDS:
        _, _, to_day, to_month = periods(now)
        period = "daily" if kind == "daily_tokens" else "monthly"
        return Refusal("insufficient_quota",
                       f"You exceeded the {period} token budget of {who} ({limit} tokens). "
                       "It renews at the start of the next UTC "
                       f"{'day' if period == 'daily' else 'month'}.",
                       to_day if period == "daily" else to_month)
    what = {"rpm": f"{limit} requests per minute", "tpm": f"{limit} tokens per minute",
            "max_concurrent": f"{limit} concurrent requests"}[kind]
    return Refusal("rate_limit_exceeded", f"Rate limit reached for {who}: {what}. "
                   f"Please try again in {reset_text(retry_s)}.", max(1, math.ceil(retry_s)))


def reset_text(seconds: float) -> str:
    """A duration as OpenAI writes it in ``x-ratelimit-reset-*``: ``20ms``, ``1s``,
    ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    whole = math.ceil(seconds) if seconds - int(seconds) > 0.001 else int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def rate_headers(scopes: list[Scope], states: list[ScopeState]) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers from the tightest scope of each dimension."""
    headers: dict[str, str] = {}
    for dim, kind in (("requests", "rpm"), ("tokens", "tpm")):
        best: tuple[int, int, float] | None = None
        for scope, state in zip(scopes, states, strict=True):
            limit = scope.limit(kind)
            remaining = (state.requests_remaining if kind == "rpm" else state.tokens_remaining)
            if limit is None or remaining is None:
                continue
            reset = state.requests_reset_s if kind == "rpm" else state.tokens_reset_s
            if best is None or remaining < best[1]:
                best = (limit, remaining, reset)
        if best is not None:
            headers[f"x-ratelimit-limit-{dim}"] = str(best[0])
            headers[f"x-ratelimit-remaining-{dim}"] = str(max(0, best[1]))
            headers[f"x-ratelimit-reset-{dim}"] = reset_text(best[2])
    return headers
