"""policies/prefill.py on plain data: prompt ranges, the prefill-token gate, and which
dispatched requests a snapshot leaves pending."""

from __future__ import annotations

from policies.prefill import (
    PREFILL_GATE_STEPS,
    TOKENS_PER_BLOCK,
    PromptRange,
    class_limit,
    fitting,
    may_backfill,
    no_fit_message,
    prefill_fits,
    still_pending,
    uncached_tokens,
)


def test_a_range_admits_both_ends_and_nothing_outside() -> None:
    short, long = PromptRange(0, 8192), PromptRange(8193)
    assert short.admits(1) and short.admits(8192) and not short.admits(8193)
    assert long.admits(8193) and long.admits(10**6) and not long.admits(8192)
    assert not PromptRange().bounded and short.bounded and long.bounded
    assert PromptRange().admits(10**9)


def test_fitting_names_the_backends_whose_range_holds_the_prompt() -> None:
    ranges = {"s0": PromptRange(0, 4000), "s1": PromptRange(0, 4000),
              "long": PromptRange(4001, 32000)}
    assert fitting(ranges, 100) == ["s0", "s1"]
    assert fitting(ranges, 4001) == ["long"]
    assert fitting(ranges, 32001) == []


def test_the_refusal_names_every_range() -> None:
    text = no_fit_message("m", 40000, {"a": PromptRange(0, 4000), "b": PromptRange(4001, 32000)})
    assert "about 40000 tokens" in text and "0–4000" in text and "4001–32000" in text


def test_class_limit_defaults_to_steps_of_the_token_budget() -> None:
    assert class_limit(None, 2048) == 2048 * PREFILL_GATE_STEPS
    assert class_limit(5000, 2048) == 5000
    assert class_limit(0, 2048) == 0  # configured off


def test_uncached_tokens_take_off_the_held_blocks_never_below_zero() -> None:
    assert uncached_tokens(1000, 0) == 1000
    assert uncached_tokens(1000, 3) == 1000 - 3 * TOKENS_PER_BLOCK
    assert uncached_tokens(100, 32) == 0


def test_the_gate_holds_work_over_its_limit_but_never_locks_out_a_long_prompt() -> None:
    assert prefill_fits(0, 30_000, 8192)  # nothing pending: even a 30k prompt goes
    assert prefill_fits(4000, 4192, 8192)
    assert not prefill_fits(4000, 4193, 8192)
    assert not prefill_fits(30_000, 10, 8192)  # the 30k prompt holds the next one
    assert prefill_fits(10**6, 10**6, 0)  # limit 0: no gate


def test_a_snapshot_leaves_pending_the_newest_unscheduled_and_everything_after_it() -> None:
    sent = [("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 5.0)]
    assert still_pending(sent, 4.0, 0) == {"d"}  # nothing waits: a, b, c were scheduled
    assert still_pending(sent, 4.0, 1) == {"c", "d"}
    assert still_pending(sent, 4.0, 2) == {"b", "c", "d"}
    assert still_pending(sent, 4.0, 10) == {"a", "b", "c", "d"}
    assert still_pending(sent, 0.5, 0) == {"a", "b", "c", "d"}  # all sent after the scrape


def test_backfill_only_within_the_time_and_the_room() -> None:
    assert may_backfill(0.5, 1.0, room=400, tokens=300)
    assert not may_backfill(0.5, 1.0, room=400, tokens=401)
    assert not may_backfill(1.0, 1.0, room=400, tokens=10)  # held that long: it goes next
    assert not may_backfill(0.0, 0.0, room=400, tokens=10)  # backfill off
