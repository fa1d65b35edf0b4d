"""Differential spec of the dispatch decision, ``dispatch_for`` in
``gateway/storage/lua/lib/dispatch.lua``, as the product runs it (``dispatch.lua`` through
``Store.dispatch_with``, from the arguments the dispatcher builds, ``dispatch_args``),
against its plain-data composition, ``policies/dispatch.py`` Dispatch: hypothesis draws
a backend (its gate's burst, free slots and occupancy bound, the grants a decision may
make, the class's prefill-token limit and backfill window, the locality settings) and a
workload of enqueues (some held by a second replica that stops beating), dispatches as
time passes, first tokens (``started.lua``), settles and cancels; the store runs it on
Redis, the twin in Python, and each decision's grants (rank, owner, charged prompt
tokens, what the prefix index held, the reason), the depth left, and the final scores
and queues must agree.

The runner is the fairness spec's (``tests/store/test_lua_fairness_spec.py``), which
holds the same path to the fairness rule with open gates."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.store.test_lua_fairness_spec import (
    BACKENDS,
    MEMBERS,
    SESSIONS,
    chains,
    credits,
    quarters,
    run,
)

GATES = st.fixed_dictionaries({
    "limit": st.integers(0, 4), "free_slots": st.integers(0, 2),
    "max_inflight": st.sampled_from([0, 0, 2, 5]), "want": st.integers(1, 3),
    "prefill_limit": st.sampled_from([0, 0, 300, 800]),
    "backfill_s": st.sampled_from([0.0, 1.0, 5.0]),
})
DECISIONS = st.tuples(BACKENDS, GATES).map(lambda d: {**d[0], **d[1]})
ENQUEUE = st.tuples(st.just("enqueue"), st.sampled_from(MEMBERS), quarters, quarters,
                    st.one_of(st.none(), st.integers(1, 4).map(float)), st.integers(0, 900),
                    chains, st.sampled_from(SESSIONS), credits, credits,
                    st.sampled_from(["r1", "r1", "r2"]))
DISPATCH_OP = st.tuples(st.just("dispatch"), st.sampled_from([None, 0.5, 3.0, 6.0]))
OPS = st.one_of(ENQUEUE, DISPATCH_OP, DISPATCH_OP,
                st.tuples(st.just("start"), st.integers(0, 50)),
                st.tuples(st.just("settle"), st.integers(0, 50), quarters, quarters),
                st.tuples(st.just("cancel"), st.integers(0, 50)))
WORKLOADS = st.tuples(st.lists(ENQUEUE, min_size=2, max_size=16),
                      st.lists(OPS, max_size=30)).map(lambda w: w[0] + w[1])
STRICT = {"min": 0, "max": 0, "slack": 0.0, "compared": 1, "lookahead": 1, "index": set(),
          "others": [], "max_imbalance": 0, "max_queued": 6, "sessions": False}


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(DECISIONS, WORKLOADS)
@example(  # the prefill gate holds a long prompt; a short one backfills, then it stops
    backend={**STRICT, "limit": 5, "free_slots": 0, "max_inflight": 0, "want": 3,
             "prefill_limit": 500, "backfill_s": 1.0},
    ops=[("enqueue", ("A", "a1"), 1.0, 1.0, None, 400, [], "", 0.0, 0.0, "r1"),
         ("enqueue", ("B", "b1"), 1.0, 1.0, None, 300, [], "", 0.0, 0.0, "r1"),
         ("enqueue", ("C", "c1"), 1.0, 1.0, None, 50, [], "", 0.0, 0.0, "r1"),
         ("dispatch", None), ("dispatch", 3.0)])
@example(  # the backfill window closes at its bound: a newcomer that fits no longer passes
    backend={**STRICT, "limit": 5, "free_slots": 0, "max_inflight": 0, "want": 3,
             "prefill_limit": 500, "backfill_s": 1.0},
    ops=[("enqueue", ("A", "a1"), 1.0, 1.0, None, 100, [], "", 0.0, 0.0, "r1"),
         ("enqueue", ("B", "b1"), 1.0, 1.0, None, 450, [], "", 0.0, 0.0, "r1"),
         ("enqueue", ("C", "c1"), 1.0, 1.0, None, 50, [], "", 0.0, 0.0, "r1"),
         ("dispatch", None),
         ("enqueue", ("A", "a2"), 1.0, 1.0, None, 50, [], "", 0.0, 0.0, "r1"),
         ("dispatch", 1.0)])
@example(  # a start moves a request from the sent to the started count: its free slot
    backend={**STRICT, "limit": 2, "free_slots": 1, "max_inflight": 0, "want": 3,
             "prefill_limit": 0, "backfill_s": 0.0},
    ops=[("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "", 0.0, 0.0, "r1"),
         ("enqueue", ("B", "b1"), 1.0, 1.0, None, 0, [], "", 0.0, 0.0, "r1"),
         ("enqueue", ("C", "c1"), 1.0, 1.0, None, 0, [], "", 0.0, 0.0, "r1"),
         ("dispatch", None), ("start", 0), ("dispatch", None), ("start", 1),
         ("start", 1), ("settle", 0, 1.0, 1.0), ("dispatch", None)])
@example(  # a request whose replica stopped beating is dropped at its turn, uncharged
    backend={**STRICT, "limit": 2, "free_slots": 0, "max_inflight": 0, "want": 2,
             "prefill_limit": 0, "backfill_s": 0.0},
    ops=[("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "", 0.0, 0.0, "r2"),
         ("enqueue", ("B", "b1"), 1.0, 1.0, None, 0, [], "", 0.0, 0.0, "r1"),
         ("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "", 0.0, 0.0, "r1"),
         ("dispatch", 11.0), ("dispatch", None)])
@example(  # a full burst is passed while fewer than the occupancy bound are in flight
    backend={**STRICT, "limit": 1, "free_slots": 0, "max_inflight": 2, "want": 3,
             "prefill_limit": 0, "backfill_s": 0.0},
    ops=[("enqueue", ("A", "a1"), 1.0, 1.0, None, 0, [], "", 0.0, 0.0, "r1"),
         ("enqueue", ("B", "b1"), 1.0, 1.0, None, 0, [], "", 0.0, 0.0, "r2"),
         ("enqueue", ("C", "c1"), 1.0, 1.0, None, 0, [], "", 0.0, 0.0, "r1"),
         ("dispatch", None), ("settle", 0, 1.0, 1.0), ("dispatch", 3.0)])
def test_dispatch_for_decides_as_policies_dispatch(
        redis_url: str, backend: dict[str, Any], ops: list[tuple[Any, ...]]) -> None:
    asyncio.run(run(redis_url, backend, ops))
