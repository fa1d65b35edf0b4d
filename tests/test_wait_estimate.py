"""policies/wait_estimate.py on plain data: position, wait estimate, Retry-After, meter."""

from __future__ import annotations

import pytest

from policies.wait_estimate import (
    MIN_SPAN_S,
    RETRY_AFTER_CEILING_S,
    DispatchMeter,
    Ewma,
    UserQueue,
    ahead_in_class,
    estimate_wait_s,
    fits_deadline,
    retry_after_s,
)

# --------------------------------------------------------------------------- ahead_in_class


def test_alone_its_own_queue_is_what_is_ahead() -> None:
    assert ahead_in_class(5.0, 0, 1.0, []) == 0
    assert ahead_in_class(5.0, 3, 1.0, []) == 3


def test_a_user_far_ahead_in_score_waits_for_the_others() -> None:
    # the heavy user (score 10) is behind two light users who have 4 queued each: every
    # one of theirs whose score stays at or below 10 goes first
    others = [UserQueue(score=0.0, queued=4), UserQueue(score=8.0, queued=4)]
    assert ahead_in_class(10.0, 0, 1.0, others) == 4 + 3


def test_a_user_with_less_service_goes_first() -> None:
    others = [UserQueue(score=10.0, queued=50)]
    assert ahead_in_class(0.0, 0, 1.0, others) == 0
    # its 12th request (index 11) reaches score 11: the other user's first 2 are ahead
    assert ahead_in_class(0.0, 11, 1.0, others) == 11 + 2


def test_fair_turns_alternate_between_equal_users() -> None:
    others = [UserQueue(score=0.0, queued=10)]
    # equal scores and costs: requests interleave (a tie counts as ahead)
    assert ahead_in_class(0.0, 0, 2.0, others) == 1
    assert ahead_in_class(0.0, 4, 2.0, others) == 4 + 5


def test_the_cost_scales_the_turns() -> None:
    # the other user is 10 ahead in score: with cost 5 it gets 2 turns, with cost 1 ten
    assert ahead_in_class(10.0, 0, 5.0, [UserQueue(0.0, 100)]) == 3
    assert ahead_in_class(10.0, 0, 1.0, [UserQueue(0.0, 100)]) == 11


def test_zero_cost_still_counts_turns() -> None:
    assert ahead_in_class(0.0, 2, 0.0, [UserQueue(0.0, 9)]) == 2 + 3


def test_empty_user_queues_add_nothing() -> None:
    assert ahead_in_class(5.0, 1, 1.0, [UserQueue(0.0, 0)]) == 1


# --------------------------------------------------------------------------- estimate_wait_s


def test_nothing_ahead_is_dispatched_now_even_unmeasured() -> None:
    assert estimate_wait_s(0, 0, None) == 0.0
    assert estimate_wait_s(0, 0, 4.0) == 0.0


def test_waiting_without_a_measured_rate_is_unknown() -> None:
    assert estimate_wait_s(3, 0, None) is None
    assert estimate_wait_s(0, 2, 0.0) is None


def test_requests_ahead_drain_at_the_rate() -> None:
    assert estimate_wait_s(10, 0, 5.0) == pytest.approx(2.0)


def test_higher_classes_go_first_without_a_floor() -> None:
    assert estimate_wait_s(10, 20, 5.0) == pytest.approx(6.0)


def test_the_floor_serves_the_class_while_higher_backlog_drains() -> None:
    # floor 0.1 owed now, rate 10/s: the class gets 1/s while 90 higher requests take 10 s
    assert estimate_wait_s(5, 90, 10.0, floor=0.1) == pytest.approx(5.0)
    # more ahead than the floor serves in those 10 s: 10 go then, 5 more at the full rate
    assert estimate_wait_s(15, 90, 10.0, floor=0.1) == pytest.approx(10.0 + 0.5)


def test_the_floor_only_starts_once_owed() -> None:
    # owed in 3 s: 30 higher requests go first, then the shared phase
    assert estimate_wait_s(5, 120, 10.0, floor=0.1, floor_in_s=3.0) == pytest.approx(8.0)
    # owed only after the higher backlog is gone: strict order
    assert estimate_wait_s(5, 20, 10.0, floor=0.1, floor_in_s=60.0) == pytest.approx(2.5)


def test_lower_classes_owed_their_floor_slow_the_class() -> None:
    assert estimate_wait_s(9, 0, 10.0, lower_share=0.1) == pytest.approx(1.0)


def test_the_estimate_grows_with_what_is_ahead() -> None:
    waits = [estimate_wait_s(n, 7, 3.0, floor=0.05, floor_in_s=1.0) or 0.0
             for n in range(50)]
    assert all(w > 0 for w in waits)
    assert waits == sorted(waits)


# --------------------------------------------------------------------------- retry_after_s


def test_retry_after_rounds_the_estimate_up_within_bounds() -> None:
    assert retry_after_s(2.1, floor_s=1) == 3
    assert retry_after_s(0.2, floor_s=1) == 1
    assert retry_after_s(10_000.0, floor_s=1) == RETRY_AFTER_CEILING_S
    assert retry_after_s(None, floor_s=2) == 2
    assert retry_after_s(float("inf"), floor_s=1) == 1


# --------------------------------------------------------------------------- DispatchMeter


def test_the_meter_measures_nothing_before_an_event() -> None:
    meter = DispatchMeter(window_s=10.0)
    assert meter.rate("m", 0.0) is None
    assert meter.total(["a", "b"], 0.0) is None


def test_the_meter_counts_events_in_its_window() -> None:
    meter = DispatchMeter(window_s=10.0)
    for i in range(40):  # 4 per second for 10 s
        meter.record("a", 100.0 + i * 0.25)
    assert meter.rate("a", 110.0) == pytest.approx(4.0, rel=0.05)
    # the window moves: half the events have left it 5 s later
    assert meter.rate("a", 115.0) == pytest.approx(19 / 10)  # 105.25 … 109.75
    assert meter.rate("a", 121.0) is None


def test_a_young_meter_divides_by_its_age_not_the_window() -> None:
    meter = DispatchMeter(window_s=10.0)
    for i in range(6):
        meter.record("a", 50.0 + i * 0.5)
    assert meter.rate("a", 53.0) == pytest.approx(6 / 3.0)
    # a burst in a moment is not an infinite rate
    burst = DispatchMeter(window_s=10.0)
    for _ in range(5):
        burst.record("a", 1.0)
    assert burst.rate("a", 1.0) == pytest.approx(5 / MIN_SPAN_S)


def test_the_meter_sums_keys() -> None:
    meter = DispatchMeter(window_s=10.0)
    for i in range(10):
        meter.record(("m", "interactive"), float(i))
        meter.record(("m", "batch"), float(i))
    # at t=9 the meter is 9 s old: 10 events of each class over 9 s
    assert meter.total([("m", "interactive"), ("m", "batch"), ("m", "default")],
                       9.0) == pytest.approx(20 / 9)


def test_ewma_starts_at_the_first_observation_and_moves_a_fifth_each_time() -> None:
    e = Ewma()
    assert e.value is None
    e.add(1.0)
    assert e.value == 1.0
    e.add(2.0)
    assert e.value == pytest.approx(1.2)


def test_a_deadline_fits_only_with_the_margin_for_later_overtakers() -> None:
    assert fits_deadline(0.8, 1.0)
    assert not fits_deadline(0.81, 1.0)


def test_idle_bound_is_one_event_over_the_time_watched() -> None:
    meter = DispatchMeter(window_s=10.0)
    assert meter.idle_bound(100.0, 100.5) is None  # watched less than MIN_SPAN_S
    assert meter.idle_bound(100.0, 102.0) == pytest.approx(0.5)
    assert meter.idle_bound(100.0, 200.0) == pytest.approx(0.1)  # at most the window
