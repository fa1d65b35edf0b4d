"""Dispatch gates: may a backend take more work of a class right now?

A gate is computed from the backend's latest /metrics snapshot. It yields a *limit*:
the number of requests that may be on their way to the backend beyond what that snapshot
shows (the burst allowance). Zero means closed, and ``reason`` says why.

Two parts make up the limit. ``max_waiting - waiting`` is what may *wait* at vLLM; the
``free_slots`` (adaptive pacing's bonus, ``policies/pacing.py``) are batch slots the
snapshot saw free, which requests sent now enter at once. A request counts against the
limit while it is on its way (dispatched, no first token yet); once it streams it no longer
waits, but it took a slot: the requests that started since the snapshot use up the free
slots first (:meth:`Gate.admits`). Without that, each request that filled a free slot and
started would hand its place to one more, and vLLM's queue would reach the whole limit.
"""

from __future__ import annotations

from dataclasses import dataclass

# Why a gate is closed. "in_transit": open by the snapshot, but the requests already sent
# since it (or not yet registered by the server) use up the burst allowance.
# "prefill_tokens": the backend's pending prefill fills the class's prefill-token limit
# (policies/prefill.py; applied per request by gateway/lua/dispatch.lua).
GATE_REASONS = ("waiting", "in_transit", "tpot", "kv", "stale", "drained", "prefill_tokens")


@dataclass(frozen=True, slots=True)
class GatePolicy:
    max_waiting: int = 3
    max_tpot_ms: float = 150.0
    max_kv_usage: float | None = None
    free_slots: int = 0  # free batch slots the burst may fill too (adaptive pacing)


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
    limit: int
    reason: str | None = None  # one of GATE_REASONS when closed
    free_slots: int = 0  # the part of ``limit`` that is free batch slots, not waiting room

    @property
    def open(self) -> bool:
        return self.limit > 0

    def used(self, in_transit: int, started: int) -> int:
        """How much of ``limit`` is taken: the requests on their way, plus those that
        started since the snapshot, as far as they filled its free slots."""
        return in_transit + min(started, self.free_slots)

    def admits(self, in_transit: int, started: int = 0) -> bool:
        """May one more request go? (gateway/lua/dispatch.lua applies the same rule.)"""
        return self.reason is None and self.used(in_transit, started) < self.limit

    def after(self, in_transit: int, started: int = 0) -> Gate:
        """The gate once ``in_transit`` requests (and ``started`` ones) count against it."""
        if self.reason is not None or self.admits(in_transit, started):
            return self
        return Gate(self.limit, "in_transit", self.free_slots)


def evaluate_gate(
    snapshot: BackendSnapshot | None,
    policy: GatePolicy,
    now_s: float,
    stale_after_s: float,
    drained: bool = False,
) -> Gate:
    """The burst limit for one (backend, class): ``max_waiting - waiting`` when healthy,
    plus the policy's free batch slots."""
    if drained:
        return Gate(0, "drained")
    if snapshot is None or now_s - snapshot.taken_at_s > stale_after_s:
        return Gate(0, "stale")
    if snapshot.tpot_s is not None and snapshot.tpot_s * 1000.0 >= policy.max_tpot_ms:
        return Gate(0, "tpot")
    if policy.max_kv_usage is not None and snapshot.kv_usage >= policy.max_kv_usage:
        return Gate(0, "kv")
    limit = policy.max_waiting + policy.free_slots - snapshot.waiting
    if limit <= 0:
        return Gate(0, "waiting")
    return Gate(limit, free_slots=policy.free_slots)


def queued_for_a_slot(snapshot: BackendSnapshot, peak_running: int) -> int:
    """Of the requests the snapshot shows waiting, those beyond the batch's free slots
    (``peak_running``, the most seen running, less those running): they wait for a running
    request to finish. The others entered a free slot and start at the next engine step."""
    free = max(0, peak_running - snapshot.running)
    return max(0, snapshot.waiting - free)
