"""The pure step planner, driven one step at a time."""

from __future__ import annotations

import itertools

from loadtest.sim.scheduler import Scheduler, SchedulerLimits
from loadtest.sim.sequence import Sequence

_arrival = itertools.count()


def seq(request_id: str, prompt: int, output: int, priority: int = 0) -> Sequence:
    return Sequence(request_id, priority, float(next(_arrival)), prompt, output)


def step(sched: Scheduler) -> dict[str, int]:
    """Plan and apply one step; return tokens scheduled per request."""
    plan = sched.schedule()
    sched.update(plan)
    return {c.seq.request_id: c.num_tokens for c in plan.chunks}


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> int:
    for n in range(max_steps):
        if not sched.has_work():
            return n
        step(sched)
    raise AssertionError("scheduler did not drain")


def test_chunked_prefill_shares_budget_with_decodes() -> None:
    sched = Scheduler(SchedulerLimits(max_num_batched_tokens=512))
    decoders = [seq(f"d{i}", 10, 100) for i in range(3)]
    for d in decoders:
        sched.add(d)
    assert step(sched) == {"d0": 10, "d1": 10, "d2": 10}
    long = seq("long", 2000, 5)
    sched.add(long)
    chunks = []
    for _ in range(4):
        before = {d.request_id: d.output_tokens for d in decoders}
        scheduled = step(sched)
        # Running decodes come first and get exactly one token each step.
        assert [scheduled[d.request_id] for d in decoders] == [1, 1, 1]
        assert all(d.output_tokens == before[d.request_id] + 1 for d in decoders)
        assert sum(scheduled.values()) <= 512
        chunks.append(scheduled["long"])
    assert chunks == [509, 509, 509, 473]
    assert long.output_tokens == 1  # first token after the 4th chunk
    assert step(sched)["long"] == 1  # then it decodes


def test_max_num_seqs_caps_running() -> None:
    sched = Scheduler(SchedulerLimits(max_num_seqs=4))
    for i in range(10):
        sched.add(seq(f"r{i}", 8, 3))
    seen_max = 0
    while sched.has_work():
        step(sched)
        seen_max = max(seen_max, len(sched.running))
        assert len(sched.running) <= 4
    assert seen_max == 4


def admission_order(policy: str) -> list[str]:
    sched = Scheduler(SchedulerLimits(max_num_seqs=1, policy=policy))
    for name, priority in [("a", 5), ("b", 1), ("c", 0), ("d", 1), ("e", 0)]:
        sched.add(seq(name, 8, 2, priority))
    order: list[str] = []
    while sched.has_work():
        plan = sched.schedule()
        order += [c.seq.request_id for c in plan.chunks if c.first_schedule]
        sched.update(plan)
    return order


def test_priority_policy_orders_by_priority_then_arrival() -> None:
    assert admission_order("priority") == ["c", "e", "b", "d", "a"]


def test_fcfs_ignores_priority() -> None:
    assert admission_order("fcfs") == ["a", "b", "c", "d", "e"]


def kv_pressure(policy: str) -> tuple[Scheduler, list[Sequence], list[str]]:
    """Three requests fill all 6 blocks; the next decode step needs a 7th."""
    sched = Scheduler(SchedulerLimits(policy=policy, kv_blocks=6, block_size=16))
    reqs = [seq("a", 32, 40, priority=0), seq("b", 32, 40, priority=5), seq("c", 32, 40, 1)]
    for r in reqs:
        sched.add(r)
    step(sched)
    assert sched.free_blocks == 0
    plan = sched.schedule()
    sched.update(plan)
    return sched, reqs, [p.request_id for p in plan.preempted]


def test_priority_preemption_picks_largest_priority_and_all_complete() -> None:
    sched, reqs, preempted = kv_pressure("priority")
    assert preempted == ["b"]
    victim = reqs[1]
    assert victim.num_computed == 0 and victim.num_blocks == 0
    assert sched.waiting.ordered() == [victim]
    run_to_completion(sched)
    assert [r.output_tokens for r in reqs] == [40, 40, 40]
    assert victim.num_preemptions >= 1
    assert sched.free_blocks == 6


def test_fcfs_preemption_picks_latest_arrival_and_all_complete() -> None:
    sched, reqs, preempted = kv_pressure("fcfs")
    assert preempted == ["c"]
    assert sched.waiting.ordered()[0] is reqs[2]
    run_to_completion(sched)
    assert [r.output_tokens for r in reqs] == [40, 40, 40]
    assert sched.free_blocks == 6


def test_preempted_request_recomputes_prompt_and_output() -> None:
    sched, reqs, _ = kv_pressure("fcfs")
    victim = reqs[2]
    assert victim.output_tokens == 1
    while True:
        plan = sched.schedule()
        if plan.tokens_for("c"):
            break
        sched.update(plan)
    # Readmitted with a prefill of its prompt plus the token it generated before.
    assert plan.tokens_for("c") == 32 + 1
    sched.update(plan)
    assert victim.output_tokens == 2


def test_no_waiting_admission_in_a_step_that_preempted() -> None:
    sched, _, preempted = kv_pressure("fcfs")
    assert preempted
    assert len(sched.running) == 2


def test_abort_frees_blocks_everywhere() -> None:
    sched = Scheduler(SchedulerLimits(max_num_seqs=1, kv_blocks=100))
    sched.add(seq("run", 100, 50))
    sched.add(seq("wait", 100, 50))
    step(sched)
    assert sched.free_blocks == 100 - 7
    assert sched.abort("run") is not None
    assert sched.abort("wait") is not None
    assert sched.free_blocks == 100
    assert not sched.has_work()
    assert sched.abort("run") is None


def test_abort_during_step_is_ignored_by_update() -> None:
    sched = Scheduler(SchedulerLimits())
    r = seq("x", 16, 5)
    sched.add(r)
    plan = sched.schedule()
    sched.abort("x")
    assert sched.update(plan) == []
    assert r.output_tokens == 0
