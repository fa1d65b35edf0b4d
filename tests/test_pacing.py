"""Adaptive pacing on plain data (policies/pacing.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.gates import BackendSnapshot, Gate, GatePolicy, evaluate_gate, still_unseen
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
    assert (p.bonus, p.max_waiting) == (4, 4)  # 8 slots free, capped at the ceiling
    assert adjust(p, snap(running=18), None, TARGETS).bonus == 2
    assert adjust(p, snap(waiting=1, running=12), None, TARGETS).bonus == 0
    assert adjust(p, snap(running=12, kv=0.95), None, TARGETS).bonus == 0
    assert adjust(p, snap(running=12, tpot_s=0.130), None, TARGETS).bonus == 0  # degraded


# -- the gate with pacing against a model of vLLM's batch ---------------------------------
# A plain-data model of one backend and the gate's bookkeeping in Redis, as the scripts keep
# it: "sent" (dispatched since the snapshot, no first token yet), "unseen" (on the way at
# the snapshot), "started" (first token since the snapshot, not settled). vLLM takes
# arrivals into its waiting queue and, at each engine step, moves them into free slots of
# a batch of ``max_num_seqs``, where they stream their first token. With ``relay``, an
# answer vLLM finished stays in flight until the next round (the gateway still relays and
# settles it): vLLM's /metrics no longer count it.


@dataclass
class Req:
    where: str = "net"  # "net" (on its way), "wait" (vLLM's queue), "run", "done" (relayed)
    in_sent: bool = True
    started: bool = False  # first token since the snapshot
    marked: bool = False  # its first token was marked (at any time)


@dataclass
class Model:
    max_num_seqs: int
    targets: PacingTargets
    count_started: bool = True  # False: the rule before the fix (started ones ignored)
    occupancy: bool = True  # False: the snapshot's burst alone
    # the gateway sees a first token only in the round after vLLM scheduled it (the relay's
    # latency), so a scrape can show a request running before its start is marked
    late_starts: bool = False
    # a start of a request sent before the snapshot takes one of its "unseen": the rule
    # before 2026-12-04, wrong for a request that snapshot already showed running
    start_takes_unseen: bool = False
    # an answer vLLM finished is settled only in the next round (the relay's latency)
    relay: bool = False
    # the snapshot's "unseen" counts no more than the requests sent before it without a
    # first token (policies/gates.py still_unseen); False: the rule before 2026-12-07
    cap_unseen: bool = True
    dispatched: int = 0
    unmarked: list[Req] = field(default_factory=list)  # scheduled, start not yet marked
    reqs: dict[int, Req] = field(default_factory=dict)
    unseen: int = 0
    pacing: Pacing | None = None
    gate: Gate = field(default_factory=lambda: Gate(0, "stale"))
    most_waiting_full: int = 0  # vLLM's queue after a step, while the batch was full
    next_id: int = 0

    def count(self, where: str) -> int:
        return sum(1 for r in self.reqs.values() if r.where == where)

    def snapshot(self) -> None:
        waiting, running = self.count("wait"), self.count("run")
        snap = BackendSnapshot(waiting, running, 0.5, None, 0.0)
        self.unseen = len(self.reqs) - waiting - running  # snapshot.lua
        for r in self.reqs.values():
            r.in_sent, r.started = False, False
        self.pacing = adjust(self.pacing or Pacing.start(self.targets), snap, None,
                             self.targets)
        batch = self.pacing.peak_running if self.occupancy else 0
        policy = GatePolicy(self.pacing.max_waiting, 150.0, None, self.pacing.bonus, batch)
        self.gate = evaluate_gate(snap, policy, 0.0, 1.0)

    def full_batch_seen(self) -> None:
        """Start where the free-slot bonus applies: the whole batch was seen running."""
        self.reqs = {i: Req("run", False) for i in range(self.max_num_seqs)}
        self.next_id = self.max_num_seqs
        self.snapshot()

    def in_transit(self) -> int:
        unseen = self.unseen
        if self.cap_unseen:  # gate_counts in lua/_lib.lua
            unseen = still_unseen(unseen, sum(1 for r in self.reqs.values()
                                              if not r.in_sent and not r.marked))
        return sum(1 for r in self.reqs.values() if r.in_sent) + unseen

    def started(self) -> int:
        return sum(1 for r in self.reqs.values() if r.started) if self.count_started else 0

    def dispatch(self) -> None:
        while self.gate.admits(self.in_transit(), self.started(), len(self.reqs)):
            self.reqs[self.next_id] = Req()
            self.next_id += 1
            self.dispatched += 1

    def arrive(self) -> None:
        for r in self.reqs.values():
            if r.where == "net":
                r.where = "wait"
                return

    def step(self) -> None:
        for r in self.reqs.values():
            if r.where == "wait" and self.count("run") < self.max_num_seqs:
                r.where = "run"
                if self.late_starts:
                    self.unmarked.append(r)
                else:
                    self.mark_started(r)
        if self.count("run") == self.max_num_seqs:
            self.most_waiting_full = max(self.most_waiting_full, self.count("wait"))

    def mark_started(self, r: Req) -> None:
        """started.lua: out of "sent" and into "started"; a request sent before the
        snapshot counts on as its "unseen" (or its waiting, or its running) until the
        next snapshot."""
        if r.in_sent:
            r.in_sent = False
        elif self.start_takes_unseen and self.unseen > 0:
            self.unseen -= 1
        r.started = r.marked = True

    def mark_late_starts(self) -> None:
        for r in self.unmarked:
            self.mark_started(r)
        self.unmarked.clear()

    def finish(self) -> None:
        for rid, r in self.reqs.items():
            if r.where == "run" and r not in self.unmarked:
                if self.relay:
                    r.where = "done"
                else:
                    del self.reqs[rid]  # settle.lua: out of the started set too
                return

    def settle_relayed(self) -> None:
        self.reqs = {i: r for i, r in self.reqs.items() if r.where != "done"}


# one round: some running requests finish, maybe a scrape, the gate dispatches, some of
# what is on its way arrives, vLLM runs an engine step
ROUNDS = st.lists(st.tuples(st.integers(0, 4), st.booleans(), st.integers(0, 8)),
                  max_size=40)


def play(m: Model, rounds: list[tuple[int, bool, int]]) -> None:
    for finished, scraped, arrived in rounds:
        m.settle_relayed()
        for _ in range(finished):
            m.finish()
        if scraped:
            m.snapshot()
        m.mark_late_starts()
        m.dispatch()
        for _ in range(arrived):
            m.arrive()
        m.step()


@settings(max_examples=300)
@given(ROUNDS, st.integers(1, 16), st.integers(1, 6), st.booleans())
def test_with_a_full_batch_requests_the_gate_sent_never_wait_past_the_allowance(
    rounds: list[tuple[int, bool, int]], max_num_seqs: int, ceiling: int, relay: bool
) -> None:
    """The pacing promise (policies/pacing.py): the free-slot bonus fills free slots only;
    once the batch is full, vLLM's queue holds at most the allowance (here the ceiling:
    no TPOT, nothing degrades it). Finished answers still relayed change nothing."""
    m = Model(max_num_seqs, PacingTargets(ceiling=ceiling, max_tpot_s=0.15), relay=relay)
    m.full_batch_seen()
    play(m, rounds)
    assert m.most_waiting_full <= ceiling, (
        f"vLLM's queue reached {m.most_waiting_full} with a full batch of {max_num_seqs}, "
        f"allowance {ceiling}; rounds {rounds}")


@settings(max_examples=300)
@given(ROUNDS, st.integers(1, 16), st.integers(1, 6), st.booleans())
def test_a_start_seen_after_the_scrape_that_showed_it_running_loosens_nothing(
    rounds: list[tuple[int, bool, int]], max_num_seqs: int, ceiling: int, relay: bool
) -> None:
    """The gateway marks a start when the first token reaches it, which on a loaded
    machine is after a scrape that already showed the request running. That start must
    not take one of the snapshot's "unseen" (the requests still on their way): it was
    not one of them, and the gate would let one more request wait."""
    m = Model(max_num_seqs, PacingTargets(ceiling=ceiling, max_tpot_s=0.15),
              late_starts=True, relay=relay)
    m.full_batch_seen()
    play(m, rounds)
    assert m.most_waiting_full <= ceiling, (
        f"vLLM's queue reached {m.most_waiting_full} with a full batch of {max_num_seqs}, "
        f"allowance {ceiling}; rounds {rounds}")


def test_the_old_rule_let_late_starts_loosen_the_gate() -> None:
    """The same with the rule before 2026-12-04 (a start took an "unseen"): a batch of
    2, allowance 1; the scrape shows the two sent requests running whose first tokens
    the gateway has not seen, so each reads as still on its way; when the starts arrive
    they take two unseen away, and two more requests wait behind the full batch."""
    def run(takes: bool) -> int:
        m = Model(2, PacingTargets(ceiling=1, max_tpot_s=0.15), late_starts=True,
                  start_takes_unseen=takes)
        m.full_batch_seen()
        play(m, [(2, True, 0), (0, False, 2), (0, True, 0), (0, False, 4)])
        return m.most_waiting_full
    assert run(takes=False) <= 1
    assert run(takes=True) > 1, run(takes=True)


def flood(count_started: bool) -> int:
    """A batch of 8 seen full, 3 of its slots free, a flood at the gate: each request
    arrives and starts (or queues) before the next scrape."""
    m = Model(8, PacingTargets(ceiling=3, max_tpot_s=0.15), count_started, occupancy=False)
    m.full_batch_seen()
    for _ in range(3):
        m.finish()
    m.snapshot()  # 5 running, nothing waits: allowance 3 + 3 free slots
    assert (m.gate.limit, m.gate.free_slots) == (6, 3)
    play(m, [(0, False, 8)] * 4)
    return m.most_waiting_full


def test_requests_that_started_in_free_slots_no_longer_hand_their_place_on() -> None:
    """The cause of vLLM's queue at twice the ceiling: a request sent into a free slot
    started, left the gate's count, and its place went to one more request, which could
    only wait. Counting the requests that started against the free slots holds the queue
    at the allowance."""
    assert flood(count_started=False) == 6  # allowance + free slots: what was measured
    assert flood(count_started=True) == 3


@given(st.lists(st.integers(0, 4), min_size=1, max_size=30), st.integers(2, 16),
       st.integers(1, 6))
def test_the_batch_stays_full_when_the_snapshot_lags(
    finishing: list[int], max_num_seqs: int, ceiling: int
) -> None:
    """A backend whose /metrics answers late (no new snapshot for many engine steps):
    occupancy keeps every finished request's slot refilled from the gate, and vLLM's queue
    at the allowance."""
    m = Model(max_num_seqs, PacingTargets(ceiling=ceiling, max_tpot_s=0.15))
    m.full_batch_seen()
    for finished in finishing:
        play(m, [(finished, False, max_num_seqs + ceiling)])
        running, waiting = m.count("run"), m.count("wait")
        assert running == max_num_seqs and waiting == ceiling, (
            f"batch {running}/{max_num_seqs}, waiting {waiting} (allowance {ceiling}) "
            f"after rounds finishing {finishing}")


def test_without_occupancy_a_lagging_snapshot_lets_the_batch_run_empty() -> None:
    """What the real CPU vLLM showed (its /metrics 0.5-1 s late): the snapshot's burst
    alone sends the allowance, then nothing until a snapshot shows the queue gone."""
    m = Model(8, PacingTargets(ceiling=3, max_tpot_s=0.15), occupancy=False)
    m.full_batch_seen()
    play(m, [(4, False, 11)] * 3)
    assert m.count("run") < 8, m.count("run")


def instant(cap_unseen: bool) -> Model:
    """A backend that answers faster than it is scraped: every request that arrives runs
    and finishes at once, and its answer is relayed and settled in the next round; a
    scrape every round. The batch is never full and vLLM's queue stays empty."""
    m = Model(1024, PacingTargets(ceiling=3, max_tpot_s=0.15), relay=True,
              cap_unseen=cap_unseen)
    m.snapshot()
    for _ in range(10):
        play(m, [(1024, True, 1024)])
        assert m.count("wait") == 0
    return m


def test_answers_still_relayed_do_not_hold_the_gate_shut() -> None:
    """The cause of the queue in the gateway in front of an instant backend: answers vLLM
    finished but the gateway still relayed were in flight and in no /metrics count, so
    each snapshot read them as "unseen", on their way to vLLM's queue, and the burst
    stayed shut until the next scrape. Their first tokens were seen: none of them can
    wait. Counted as such, the gate sends the allowance each round, not every other one
    (a round whose scrape found nothing to relay)."""
    old = instant(cap_unseen=False).dispatched
    assert old == 15, f"the rule before sent {old} in 10 rounds"
    new = instant(cap_unseen=True).dispatched
    assert new == 30, f"sent {new} in 10 rounds, want the allowance 3 in each"
