"""Dispatch gates: may a backend take more work of a class right now?

A gate is computed from the backend's latest /metrics snapshot, and the class may send
one more request to the backend while either of two bounds admits it:

- **The snapshot's burst** (``limit``): the requests that may be on their way beyond what
  the snapshot shows. ``max_waiting - waiting`` is what may *wait* at vLLM; the
  ``free_slots`` (adaptive pacing's bonus, ``policies/pacing.py``) are batch slots the
  snapshot saw free, which requests sent now enter at once. A request counts against it
  while it is on its way (dispatched, no first token yet); once it streams it no longer
  waits, but it took a slot: the requests that started since the snapshot use up the free
  slots first. Without that, each request that filled a free slot and started would hand
  its place to one more, and vLLM's queue would reach the whole limit.
- **Occupancy** (``max_inflight``): the batch's size (the most requests seen running at
  once) plus ``max_waiting``. The gateway counts exactly the requests it has in flight at
  the backend, whatever the age of the snapshot: with no more than that in flight, a full
  batch has at most ``max_waiting`` of them waiting behind it. This bound does not go stale
  when the backend's /metrics answers late (a 2-core CPU vLLM answers a scrape in 0.5-1 s
  while it streams: the burst then waits for a snapshot that shows a queue long gone, and
  the batch runs empty between two scrapes).

Either bound keeps the promise that requests sent by the gate wait at most
``max_waiting`` behind a full batch (traffic from other clients of the backend aside).

What is on its way counts only what can still wait at vLLM: a request whose first token
the gateway relayed was scheduled, whatever the last scrape said (:func:`still_unseen`).
Without that bound, in front of a backend that answers faster than it is scraped (an
instant one, a fast GPU on short answers), the requests vLLM had finished while the
gateway still relayed them read as "unseen" in every snapshot and held the burst shut:
the requests queued in the gateway, not at vLLM.
Zero for both means closed, and ``reason`` says why; a reason other than "waiting" closes
both (drained, stale, TPOT, KV).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from policies.classes import DEFAULT_CLASS

# Why a gate is closed. "in_transit": open by the snapshot, but the requests already sent
# since it (or not yet registered by the server) use up the burst allowance.
# "prefill_tokens": the backend's pending prefill fills the class's prefill-token limit
# (policies/prefill.py; applied per request by gateway/storage/lua/dispatch.lua).
GATE_REASONS = ("waiting", "in_transit", "tpot", "kv", "stale", "drained", "prefill_tokens")


@dataclass(frozen=True, slots=True)
class GatePolicy:
    max_waiting: int = DEFAULT_CLASS.max_waiting
    max_tpot_ms: float = DEFAULT_CLASS.max_tpot_ms
    max_kv_usage: float | None = DEFAULT_CLASS.max_kv_usage
    free_slots: int = 0  # free batch slots the burst may fill too (adaptive pacing)
    batch: int = 0  # the most requests seen running at once (0: unknown, no occupancy bound)


@dataclass(frozen=True, slots=True)
class BackendSnapshot:
    """What one scrape of a backend's /metrics said (summed over engines)."""

    waiting: int
    running: int
    kv_usage: float
    tpot_s: float | None  # recent mean time per output token; None when no data
    taken_at_s: float  # wall-clock time the scrape started


@dataclass(frozen=True, slots=True)
class Gate:
    limit: int  # the snapshot's burst
    reason: str | None = None  # one of GATE_REASONS when closed
    free_slots: int = 0  # the part of ``limit`` that is free batch slots, not waiting room
    max_inflight: int = 0  # occupancy: requests in flight at the backend allowed (0: none)

    @property
    def open(self) -> bool:
        return self.reason is None and (self.limit > 0 or self.max_inflight > 0)

    def used(self, in_transit: int, started: int) -> int:
        """How much of ``limit`` is taken: the requests on their way, plus those that
        started since the snapshot, as far as they filled its free slots."""
        return in_transit + min(started, self.free_slots)

    def admits(self, in_transit: int, started: int = 0, inflight: int | None = None) -> bool:
        """May one more request go? ``inflight``: the requests at the backend now (None:
        unknown). gateway/storage/lua/dispatch.lua applies the same rule."""
        if self.reason is not None:
            return False
        if self.used(in_transit, started) < self.limit:
            return True
        return inflight is not None and inflight < self.max_inflight

    def after(self, in_transit: int, started: int = 0, inflight: int | None = None) -> Gate:
        """The gate once ``in_transit`` requests (``started`` ones, ``inflight`` in all)
        count against it: closed by "in_transit" when neither bound admits one more."""
        if self.reason is not None or self.admits(in_transit, started, inflight):
            return self
        return Gate(self.limit, "in_transit", self.free_slots, self.max_inflight)


def evaluate_gate(
    snapshot: BackendSnapshot | None,
    policy: GatePolicy,
    now_s: float,
    stale_after_s: float,
    drained: bool = False,
) -> Gate:
    """The gate of one (backend, class): the burst ``max_waiting - waiting`` plus the free
    slots, and the occupancy bound ``batch + max_waiting``, when healthy."""
    if drained:
        return Gate(0, "drained")
    if snapshot is None or now_s - snapshot.taken_at_s > stale_after_s:
        return Gate(0, "stale")
    if snapshot.tpot_s is not None and snapshot.tpot_s * 1000.0 >= policy.max_tpot_ms:
        return Gate(0, "tpot")
    if policy.max_kv_usage is not None and snapshot.kv_usage >= policy.max_kv_usage:
        return Gate(0, "kv")
    limit = max(0, policy.max_waiting + policy.free_slots - snapshot.waiting)
    max_inflight = policy.batch + policy.max_waiting if policy.batch > 0 else 0
    if limit <= 0 and max_inflight <= 0:
        return Gate(0, "waiting")
    return Gate(limit, None, policy.free_slots if limit else 0, max_inflight)


# closed for these, a backend takes no work until its scrapes succeed again (it died, or
# its snapshot went stale) or its drain ends; closed for the others, it is busy and
# reopens as its requests run
DOWN_REASONS = frozenset(("stale", "drained"))


def down(gates: Mapping[str, Gate]) -> bool:
    """Whether a backend's gates (one per class) are all closed because it is down: then
    no request is left waiting for it (locality's affinity)."""
    return bool(gates) and all(g.reason in DOWN_REASONS for g in gates.values())


def wider(own: Gate, lent: Gate) -> Gate:
    """The gate a class dispatches by when it may borrow ``lent`` (a starved class, the top
    class's gate): the more open of the two, its own on a tie."""
    if not lent.open:
        return own
    if not own.open or (lent.limit, lent.max_inflight) > (own.limit, own.max_inflight):
        return lent
    return own


def still_unseen(unseen: int, unstarted_before: int) -> int:
    """Of a snapshot's ``unseen`` (requests in flight its scrape did not see, less those
    sent after it began: ``gateway/storage/lua/snapshot.lua``), those that may still wait
    at vLLM: no more than the requests sent before the snapshot that have not streamed a
    first token yet (``unstarted_before``). The count it was taken from also holds
    requests vLLM finished before the scrape while the gateway still relayed or settled
    them, and those that started since; neither waits. (``gate_counts`` in
    ``gateway/storage/lua/_lib.lua`` applies the same rule.)"""
    return max(0, min(unseen, unstarted_before))


def queued_for_a_slot(snapshot: BackendSnapshot, peak_running: int) -> int:
    """Of the requests the snapshot shows waiting, those beyond the batch's free slots
    (``peak_running``, the most seen running, less those running): they wait for a running
    request to finish. The others entered a free slot and start at the next engine step."""
    free = max(0, peak_running - snapshot.running)
    return max(0, snapshot.waiting - free)


def share(gate: Gate, replicas: int) -> Gate:
    """This replica's part of ``gate`` when ``replicas`` replicas pace the backend each on
    its own (degraded mode, ``gateway/scheduling/local.py``: no shared count of what is on
    its way): 1/N of the burst and of the occupancy, rounded up, so N replicas together
    overshoot the whole gate by less than N requests on each bound. A closed gate stays
    closed; one replica (or none known) keeps the whole gate."""
    if gate.reason is not None or replicas <= 1:
        return gate
    limit = -(-gate.limit // replicas)
    return Gate(limit, None, min(gate.free_slots, limit), -(-gate.max_inflight // replicas))
