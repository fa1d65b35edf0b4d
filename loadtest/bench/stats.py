"""Percentiles, per-run summaries (``vllm bench serve`` definitions), windows, Jain's index."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from loadtest.bench.client import Result


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (like numpy's default); None for no data."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)


def dist_ms(values: Sequence[float]) -> dict[str, float | None]:
    mean = sum(values) / len(values) if values else None
    return {"mean": ms(mean), "p50": ms(percentile(values, 50)),
            "p90": ms(percentile(values, 90)), "p99": ms(percentile(values, 99))}


def tokens_in(results: Iterable[Result], start: float, end: float) -> int:
    """Output tokens whose frame arrived in [start, end)."""
    return sum(1 for r in results for t in r.token_times if start <= t < end)


def summarize(results: Sequence[Result], window: tuple[float, float] | None = None,
              slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.15) -> dict[str, Any]:
    """Counts, TTFT/TPOT/ITL/E2E distributions, throughput and goodput of one run.

    Throughput counts tokens inside ``window`` (default: first send to last end), so a
    closed-loop run can exclude its warm-up. Goodput: requests/s that met both SLOs.
    """
    ok = [r for r in results if r.ok]
    if window is None:
        start = min((r.sent_s for r in results), default=0.0)
        end = max((r.end_s for r in results), default=0.0)
    else:
        start, end = window
    span = max(end - start, 1e-9)
    in_window = [r for r in ok if start <= r.end_s < end]
    good = [r for r in in_window if (r.ttft or 0.0) <= slo_ttft_s
            and (r.tpot is None or r.tpot <= slo_tpot_s)]
    itls = [x for r in ok for x in r.itls()]
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_sample": next((r.error for r in results if r.error), None),
        "duration_s": round(span, 3),
        "output_tokens": sum(r.output_tokens for r in ok),
        "output_tok_s": round(tokens_in(results, start, end) / span, 2),
        "req_s": round(len(in_window) / span, 2),
        "goodput_req_s": round(len(good) / span, 2),
        "slo": {"ttft_ms": slo_ttft_s * 1000, "tpot_ms": slo_tpot_s * 1000},
        "ttft_ms": dist_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": dist_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": dist_ms(itls),
        "e2e_ms": dist_ms([r.latency for r in ok]),
    }


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index: (Σx)² / (n·Σx²); 1 is perfectly even."""
    if not values:
        return None
    square_sum = sum(v * v for v in values)
    if square_sum == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * square_sum)


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return round(num / den, 3)


def sliding_windows(start: float, end: float, width: float, step: float
                    ) -> list[tuple[float, float]]:
    out = []
    t = start
    while t + width <= end + 1e-9:
        out.append((t, t + width))
        t += step
    return out


def service_by_user(results: Iterable[Result], start: float, end: float,
                    w_in: float, w_out: float, uncached: bool = True) -> dict[str, float]:
    """Weighted token service in [start, end): the prompt counts when its first token
    arrives (prefill done), each output token when its frame arrives. ``uncached``: the
    prompt tokens the backend computed (what fairgate charges: ``policies/cost.py``),
    else all of them."""
    out: dict[str, float] = {}
    for r in results:
        served = 0.0
        if r.first_token_s is not None and start <= r.first_token_s < end:
            prompt = r.prompt_tokens - (r.cached_tokens if uncached else 0)
            served += prompt * w_in
        served += w_out * sum(1 for t in r.token_times if start <= t < end)
        if served:
            out[r.user] = out.get(r.user, 0.0) + served
    return out


def backlogged(results: Iterable[Result], start: float, end: float) -> set[str]:
    """Users with at least one request outstanding at every moment of [start, end)."""
    return _covered([(r.user, r.sent_s, r.end_s) for r in results], start, end)


def queued(results: Iterable[Result], start: float, end: float) -> set[str]:
    """Users with a request waiting in the gateway's queue at every moment of [start,
    end): VTC's "backlogged" (its fairness bound holds between such users). A request
    waited from its sending for its ``X-Fairgate-Queue-Wait-Ms``, or to its end when no
    answer came (the run ended while it was queued)."""
    spans = []
    for r in results:
        if r.queue_wait_s is not None:
            spans.append((r.user, r.sent_s, r.sent_s + r.queue_wait_s))
        elif r.status == 0:
            spans.append((r.user, r.sent_s, r.end_s))
    return _covered(spans, start, end)


def _covered(spans: list[tuple[str, float, float]], start: float, end: float) -> set[str]:
    """The users whose spans leave no gap in [start, end)."""
    by_user: dict[str, list[tuple[float, float]]] = {}
    for user, a, b in spans:
        if a < end and b > start:
            by_user.setdefault(user, []).append((a, b))
    users = set()
    for user, items in by_user.items():
        covered = start
        for a, b in sorted(items):
            if a > covered + 0.05:  # a gap longer than a closed loop's turn-around
                break
            covered = max(covered, b)
        if covered >= end:
            users.add(user)
    return users


def round_all(value: Any, digits: int = 4) -> Any:
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: round_all(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [round_all(v, digits) for v in value]
    return value


Metric = Callable[[Sequence[Result]], float | None]
