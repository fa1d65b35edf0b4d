"""Sessions, the third level of ``policies/fairness.py`` TwoLevel, on plain data: a
user's turns against other users do not depend on how many sessions it splits its
requests into, and its backlogged sessions take its turns in turn."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from policies.fairness import TwoLevel


def served(sessions_of_a: int, a_count: int, b_count: int, a_cost: float, b_cost: float,
           steps: int) -> tuple[list[str], Counter[str]]:
    """The users served in order, and a's requests served per session."""
    model = TwoLevel(by_session=True)
    for i in range(a_count):
        model.enqueue("a", "a", a_cost, a_cost, f"a{i}", session=f"s{i % sessions_of_a}")
    for i in range(b_count):
        model.enqueue("b", "b", b_cost, b_cost, f"b{i}", session="")
    users, per_session = [], Counter[str]()
    for _ in range(steps):
        pick = model.pick()
        if pick is None:
            break
        model.serve(pick)
        users.append(pick.user)
        if pick.user == "a":
            per_session[str(pick.session)] += 1
    return users, per_session


@given(st.integers(1, 50), st.integers(1, 120), st.integers(1, 120),
       st.sampled_from([1.0, 2.5, 10.0]), st.sampled_from([1.0, 4.0]), st.integers(1, 200))
def test_a_users_turns_do_not_depend_on_its_session_count(
        sessions: int, a_count: int, b_count: int, a_cost: float, b_cost: float,
        steps: int) -> None:
    split, _ = served(sessions, a_count, b_count, a_cost, b_cost, steps)
    one, _ = served(1, a_count, b_count, a_cost, b_cost, steps)
    assert split == one, f"{sessions} sessions: {split}; one session: {one}"


@given(st.integers(2, 50), st.integers(1, 400))
def test_backlogged_sessions_take_the_users_turns_in_turn(sessions: int, steps: int) -> None:
    # every session stays backlogged (10 requests each, at most 400 steps of 2 users)
    _, per_session = served(sessions, 10 * sessions + 400, 400, 1.0, 1.0, steps)
    counts = [per_session.get(f"s{i}", 0) for i in range(sessions)]
    assert max(counts) - min(counts) <= 1, counts


def test_sessions_off_keeps_one_queue_per_user() -> None:
    model = TwoLevel()
    model.enqueue("a", "a", 1.0, 1.0, "x", session=None)
    pick = model.pick()
    assert pick is not None and pick.session is None, pick
    assert model.sessions == {} and model.session_queues == {}, model
