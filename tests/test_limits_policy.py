"""policies/limits.py: the pure rules of limits and budgets, with plain data."""

from __future__ import annotations

import calendar

import pytest

from policies.limits import (
    Scope,
    ScopeState,
    bucket_level,
    periods,
    rate_headers,
    refill_s,
    refusal,
    reset_text,
)


@pytest.mark.parametrize(("seconds", "text"), [
    (0.02, "20ms"), (0.0, "0ms"), (1, "1s"), (1.2, "2s"), (59, "59s"), (60, "1m0s"),
    (360, "6m0s"), (3723, "1h2m3s")])
def test_reset_text_as_openai_writes_it(seconds: float, text: str) -> None:
    assert reset_text(seconds) == text


def test_bucket_refills_over_a_minute_and_caps() -> None:
    assert bucket_level(None, None, 60, 100.0) == 60
    assert bucket_level(0.0, 100.0, 60, 110.0) == pytest.approx(10.0)
    assert bucket_level(-30.0, 100.0, 60, 110.0) == pytest.approx(-20.0)  # overspent
    assert bucket_level(50.0, 100.0, 60, 1000.0) == 60
    assert refill_s(0.0, 1.0, 60) == pytest.approx(1.0)
    assert refill_s(5.0, 1.0, 60) == 0.0


def test_periods_are_utc_days_and_months() -> None:
    now = calendar.timegm((2026, 12, 31, 23, 59, 30))
    day, month, to_day, to_month = periods(now)
    assert (day, month, to_day, to_month) == ("d20261231", "m202612", 30, 30)
    day, month, to_day, to_month = periods(calendar.timegm((2026, 2, 10, 0, 0, 0)))
    assert (day, month, to_day) == ("d20260210", "m202602", 86400)
    assert to_month == 19 * 86400


def test_refusals_name_the_scope_and_code() -> None:
    scope = Scope("tenant", "research", "t", rpm=10, daily_tokens=1000)
    rate = refusal(scope, "rpm", 2.5, 0.0)
    assert rate.code == "rate_limit_exceeded" and rate.retry_after_s == 3
    assert "tenant 'research'" in rate.message and "10 requests per minute" in rate.message
    budget = refusal(scope, "daily_tokens", 0.0, calendar.timegm((2026, 5, 1, 12, 0, 0)))
    assert budget.code == "insufficient_quota" and budget.retry_after_s == 12 * 3600
    assert refusal(scope, "max_concurrent", 0.0, 0.0).retry_after_s == 1


def test_headers_follow_the_tightest_scope() -> None:
    key = Scope("key", "k1", "k:k1", rpm=100, tpm=1000)
    tenant = Scope("tenant", "t", "t", rpm=10)
    headers = rate_headers([key, tenant], [
        ScopeState(requests_remaining=50, requests_reset_s=30, tokens_remaining=900,
                   tokens_reset_s=6),
        ScopeState(requests_remaining=3, requests_reset_s=42)])
    assert headers == {
        "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "42s", "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "900", "x-ratelimit-reset-tokens": "6s"}
    assert rate_headers([Scope("key", "k", "k:k", daily_tokens=5)], [ScopeState()]) == {}
    # an overspent token bucket shows 0 remaining, never a negative number
    overspent = rate_headers([key], [ScopeState(1, 0.5, -40, 3)])
    assert overspent["x-ratelimit-remaining-tokens"] == "0"
