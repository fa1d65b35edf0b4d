"""The prompt's block-hash chain and the locality choice, on plain data."""

from __future__ import annotations

from typing import Any

from gateway.proxy.completion_request import parse_body
from gateway.proxy.endpoints import CHAT, COMPLETIONS, RESPONSES
from policies.fairness import Vtc
from policies.locality import (
    BLOCK_CHARS,
    MAX_BLOCKS,
    LocalityView,
    chain,
    choose,
    held_elsewhere,
    matched,
    prefix_chain,
    prompt_text,
    routing_for,
)
from policies.prefill import PromptRange
from policies.request import Prompt

SYSTEM_A = "You are the billing assistant. " * 40
SYSTEM_B = "You are the travel assistant!! " * 40


def typed(body: dict[str, Any]) -> Prompt:
    """The prompt of ``body`` as the edge reads it (the endpoint its shape names)."""
    endpoint = CHAT if "messages" in body else RESPONSES if "input" in body else COMPLETIONS
    return parse_body({"model": "m", **body}, endpoint).prompt


def chat(system: str, *turns: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system},
                         *({"role": "user", "content": t} for t in turns)]}


def test_chain_is_stable_chained_and_counts_full_blocks_only() -> None:
    text = "x" * (3 * BLOCK_CHARS + 10)
    hashes = chain(text)
    assert len(hashes) == 3  # the partial fourth block is not hashed
    assert chain(text) == hashes
    assert len(set(hashes)) == 3  # equal chunks, different hashes: each covers its prefix
    assert chain("y" + text[1:])[1:] != hashes[1:]  # a change early changes every later hash
    assert chain("z" * BLOCK_CHARS * (MAX_BLOCKS + 5)).__len__() == MAX_BLOCKS


def test_sessions_share_their_system_prompt_prefix() -> None:
    first = prefix_chain(typed(chat(SYSTEM_A, "What is my balance?")))
    later = prefix_chain(typed(chat(SYSTEM_A, "What is my balance?", "And last month's?")))
    other = prefix_chain(typed(chat(SYSTEM_B, "What is my balance?")))
    assert len(first) >= 4
    assert later[:len(first)] == first
    assert matched(later, set(first)) == len(first)
    assert matched(other, set(first)) == 0


def test_prompt_text_of_each_body_shape() -> None:
    assert prompt_text(typed({"prompt": "hello"})) == "hello"
    assert prompt_text(typed({"prompt": ["a", "b"]})) == "ab"
    assert prompt_text(typed({"input": "doc", "instructions": "sum: "})) == "sum: doc"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(typed(parts)).endswith("hi")
    assert prompt_text(typed({"prompt": [1, 2]})) == prompt_text(typed({"prompt": [1, 2, 3]}))[:4]
    assert len(prompt_text(typed({"prompt": "q" * 100_000}))) == BLOCK_CHARS * MAX_BLOCKS


CACHED = {"h1", "h2", "h3"}
Users = list[tuple[float, list[tuple[str, ...]]]]


def test_slack_zero_is_strict_fairness_order() -> None:
    users: Users = [(10.0, [("n1",), ("h1",)]), (10.5, [("h1", "h2")])]
    assert choose(users, CACHED, slack=0.0, candidates=8) == (0, 0)


def test_within_the_slack_the_longest_cached_prefix_wins() -> None:
    users: Users = [(10.0, [("n1",)]), (12.0, [("h1",)]), (13.0, [("h1", "h2", "h3")]),
             (14.0, [("h1", "h2")])]
    assert choose(users, CACHED, slack=5.0, candidates=8) == (2, 0)


def test_a_users_later_request_may_pass_its_older_one() -> None:
    users: Users = [(10.0, [("n1",), ("h1", "h2")]), (11.0, [("h1",)])]
    assert choose(users, CACHED, slack=5.0, candidates=8) == (0, 1)


def test_ties_go_to_the_fairness_order() -> None:
    users: Users = [(10.0, [("h1", "x")]), (11.0, [("h1", "y")]), (12.0, [()])]
    assert choose(users, CACHED, slack=5.0, candidates=8) == (0, 0)
    users = [(10.0, [("n",)]), (11.0, [("h1",), ("h1",)]), (12.0, [("h1",)])]
    assert choose(users, CACHED, slack=5.0, candidates=8) == (1, 0)


def test_a_user_further_than_the_slack_behind_is_never_overtaken() -> None:
    # the least-served user (score 10) has nothing cached; one beyond the slack has all
    users: Users = [(10.0, [("n1",)]), (15.01, [("h1", "h2", "h3")])]
    assert choose(users, CACHED, slack=5.0, candidates=8) == (0, 0)
    assert choose(users, CACHED, slack=5.01, candidates=8) == (1, 0)


def test_only_the_first_candidates_are_compared() -> None:
    users: Users = [(10.0, [()]), (10.0, [()]), (10.0, [("h1",)])]
    assert choose(users, CACHED, slack=5.0, candidates=2) == (0, 0)
    assert choose(users, CACHED, slack=5.0, candidates=3) == (2, 0)


def test_backlogged_users_all_cached_stay_within_bound_plus_slack() -> None:
    """Serving by ``choose`` with every prompt cached on the backend (so locality always
    prefers user "hot") keeps the service gap within the policy's bound plus the slack."""
    vtc, slack, cost = Vtc(), 3000.0, 500.0
    scores = {"hot": 0.0, "cold": 0.0, "warm": 0.0}
    chains = {"hot": ("h1", "h2", "h3"), "warm": ("h1",), "cold": ("n",)}
    bound = vtc.bound(cost, 0, 0.0) + slack
    served = {u: 0.0 for u in scores}
    for _ in range(300):
        order = sorted(scores, key=lambda u: (scores[u], u))
        chosen = choose([(scores[u], [chains[u]]) for u in order], CACHED, slack, 8)
        assert chosen is not None
        pick = order[chosen[0]]
        scores[pick] += cost
        served[pick] += cost
        assert max(served.values()) - min(served.values()) <= bound
    assert served["hot"] > served["cold"]  # locality did bend the order, within the bound


def test_a_head_held_by_a_not_busier_backend_is_left_to_it() -> None:
    other = {"o1"}
    assert held_elsewhere(("o1", "o2"), [(other, 5)], load=2, max_imbalance=4)
    assert not held_elsewhere(("o1", "o2"), [(other, 7)], load=2, max_imbalance=4)  # busier
    assert not held_elsewhere(("x1",), [(other, 0)], load=2, max_imbalance=4)
    assert not held_elsewhere((), [(other, 0)], load=2, max_imbalance=4)

    def elsewhere(hashes: object) -> bool:
        return hashes == ("o1",)

    # the least-served head lives on another backend: the next one within the slack goes
    users: Users = [(10.0, [("o1",)]), (11.0, [("n1",)])]
    assert choose(users, CACHED, slack=5.0, candidates=8, elsewhere=elsewhere) == (1, 0)
    # only such requests within the slack: this backend takes none now
    users = [(10.0, [("o1",)]), (16.0, [("n1",)])]
    assert choose(users, CACHED, slack=5.0, candidates=8, elsewhere=elsewhere) is None
    # strict order (slack 0) ignores locality altogether
    assert choose(users, CACHED, slack=0.0, candidates=8, elsewhere=elsewhere) == (0, 0)


def test_auto_routes_by_locality_where_there_is_a_choice() -> None:
    assert routing_for("auto", 0) == routing_for("auto", 1) == "least_loaded"
    assert routing_for("auto", 2) == routing_for("auto", 5) == "locality"
    for configured in ("least_loaded", "locality"):  # as configured, whatever the count
        assert {routing_for(configured, n) for n in (1, 2, 3)} == {configured}


def test_a_head_is_never_left_to_a_backend_that_does_not_take_it() -> None:
    """Length pools: the long pool holds the shared system prompt's first block, but a
    short request is the short pool's; a backend outside its range is never waited for."""
    long_range = PromptRange(8193, None)
    tokens = {"short-q": 300, "long-q": 9000}
    view = LocalityView(slack=10.0, compared=4, chains={"short-q": ("sys",), "long-q": ("sys",)},
                        others=[({"sys"}, 0)], load=0, max_imbalance=2,
                        other_takes=lambda _, rid: long_range.admits(tokens[rid]))
    assert view.matched("short-q") == (0, False), view.matched("short-q")
    assert view.matched("long-q") == (0, True), view.matched("long-q")
