"""Dispatch gates: may a backend take more work of a class right now?

A gate is computed from the backend's latest /metrics snapshot. It yields a *limit*:
the number of requests that may be on their way to the backend beyond what that snapshot
shows (the burst allowance). Zero means closed, and ``reason`` says why.
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

    @property
    def open(self) -> bool:
        return self.limit > 0

    def after(self, in_transit: int) -> Gate:
        """The gate once ``in_transit`` requests count against its burst allowance."""
        if self.reason is not None or self.limit > in_transit:
            return self
        return Gate(self.limit, "in_transit")


def evaluate_gate(
    snapshot: BackendSnapshot | None,
    policy: GatePolicy,
    now_s: float,
    stale_after_s: float,
    drained: bool = False,
) -> Gate:
    """The burst limit for one (backend, class): ``max_waiting - waiting`` when healthy."""
    if drained:
        return Gate(0, "drained")
    if snapshot is None or now_s - snapshot.taken_at_s > stale_after_s:
        return Gate(0, "stale")
    if snapshot.tpot_s is not None and snapshot.tpot_s * 1000.0 >= policy.max_tpot_ms:
        return Gate(0, "tpot")
    if policy.max_kv_usage is not None and snapshot.kv_usage >= policy.max_kv_usage:
        return Gate(0, "kv")
    limit = policy.max_waiting - snapshot.waiting
    if limit <= 0:
        return Gate(0, "waiting")
    return Gate(limit)
