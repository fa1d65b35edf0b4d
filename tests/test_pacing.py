"""Adaptive pacing on plain data (policies/pacing.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from policies.gates import BackendSnapshot
from policies.pacing import Pacing, PacingTargets, adjust

TARGETS = PacingTargets(ceiling=4, max_tpot_s=0.150, ttft_slo_s=2.0)


def snap(waiting: int = 0, running: int = 8, tpot_s: float | None = 0.05,
         kv: float = 0.5) -> BackendSnapshot:
    return BackendSnapshot(waiting, running, kv, tpot_s, 0.0)


def test_starts_at_the_ceiling() -> None:
    assert Pacing.start(TARGETS) == Pacing(4.0, "start", 0)
    assert Pacing.start(TARGETS).max_waiting == 4


def test_tpot_near_the_limit_halves_the_allowance_down_to_the_floor() -> None:
    p = Pacing.start(TARGETS)
    p = adjust(p, snap(tpot_s=0.120), None, TARGETS)  # 80 % of 150 ms
    assert (p.allowance, p.reason) == (2.0, "tpot")
    p = adjust(p, snap(tpot_s=0.140), None, TARGETS)
    assert (p.allowance, p.max_waiting) == (1.0, 1)
    p = adjust(p, snap(tpot_s=0.200), None, TARGETS)
    assert p.allowance == 1.0  # never below the floor: the class is never shut out
    assert adjust(Pacing.start(TARGETS), snap(tpot_s=0.119), None, TARGETS).reason == "start"


def test_ttft_over_the_slo_halves_only_when_the_class_has_one() -> None:
    p = adjust(Pacing.start(TARGETS), snap(running=8), 2.5, TARGETS)
    assert (p.allowance, p.reason) == (2.0, "ttft")
    no_slo = PacingTargets(ceiling=4, max_tpot_s=0.150)
    assert adjust(Pacing.start(no_slo), snap(), 60.0, no_slo).allowance == 4.0


def test_a_queue_past_twice_the_ceiling_halves() -> None:
    p = adjust(Pacing.start(TARGETS), snap(waiting=9), None, TARGETS)
    assert (p.allowance, p.reason) == (2.0, "waiting")
    assert adjust(Pacing.start(TARGETS), snap(waiting=8), None, TARGETS).allowance == 4.0


def test_recovers_by_one_per_snapshot_while_the_batch_has_room_up_to_the_ceiling() -> None:
    p = Pacing(1.0, "tpot", peak_running=16)
    p = adjust(p, snap(waiting=2, running=12), None, TARGETS)  # room: 12 of 16 run
    assert (p.allowance, p.reason) == (2.0, "headroom")
    p = adjust(p, snap(waiting=0, running=16), None, TARGETS)  # room: nothing waits
    p = adjust(p, snap(waiting=0, running=16), None, TARGETS)
    p = adjust(p, snap(waiting=0, running=16), None, TARGETS)
    assert p.allowance == 4.0  # the ceiling (max_waiting) holds


def test_holds_while_the_batch_is_full_and_requests_wait() -> None:
    p = Pacing(2.0, "tpot", peak_running=16)
    assert adjust(p, snap(waiting=3, running=16), None, TARGETS) == p


def test_remembers_the_largest_batch_seen() -> None:
    p = adjust(Pacing.start(TARGETS), snap(running=20), None, TARGETS)
    p = adjust(p, snap(running=5), None, TARGETS)
    assert p.peak_running == 20


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 64),
                          st.none() | st.floats(0, 1), st.none() | st.floats(0, 10)),
                max_size=60),
       st.integers(1, 8))
def test_the_allowance_stays_between_floor_and_ceiling(
    steps: list[tuple[int, int, float | None, float | None]], ceiling: int
) -> None:
    targets = PacingTargets(ceiling=ceiling, max_tpot_s=0.15, ttft_slo_s=1.0)
    p = Pacing.start(targets)
    for waiting, running, tpot, ttft in steps:
        p = adjust(p, snap(waiting, running, tpot), ttft, targets)
        assert 1 <= int(p.allowance) <= ceiling
        assert 0 <= p.bonus <= ceiling and (p.bonus == 0 or waiting == 0)


def test_free_batch_slots_add_a_bonus_only_while_nothing_waits_and_kv_has_room() -> None:
    p = adjust(Pacing.start(TARGETS), snap(running=20), None, TARGETS)  # batch of 20 seen
    p = adjust(p, snap(running=12), None, TARGETS)
    assert (p.bonus, p.max_waiting) == (4, 8)  # 8 slots free, capped at the ceiling
    assert adjust(p, snap(running=18), None, TARGETS).bonus == 2
    assert adjust(p, snap(waiting=1, running=12), None, TARGETS).bonus == 0
    assert adjust(p, snap(running=12, kv=0.95), None, TARGETS).bonus == 0
    assert adjust(p, snap(running=12, tpot_s=0.130), None, TARGETS).bonus == 0  # degraded
