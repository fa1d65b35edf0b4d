"""Adaptive pacing: how many requests of a class may wait at a backend, tuned from what
its /metrics show.

The gate (``policies/gates.py``) lets a class send ``allowance - waiting`` more requests
per snapshot. A fixed allowance (``max_waiting``) is right for one backend, model and load
and wrong for the next: too small and the batch runs short of work, too large and new
requests wait behind a queue that TTFT and TPOT pay for. This controller moves the
allowance per (backend, class) with every snapshot, additive increase and multiplicative
decrease (AIMD, as TCP congestion control does):

- lower it (halve, not below ``floor``) when the backend degrades: the recent TPOT reaches
  ``TPOT_MARGIN`` of the class's ``max_tpot_ms`` (the fixed gate shuts at 100 %), the
  recent TTFT exceeds the class's ``ttft_slo_ms``, or the waiting queue has grown past
  twice the ceiling (other replicas or classes overfill it);
- raise it (by ``STEP``, not above ``ceiling`` = the class's ``max_waiting``) while the
  targets hold and the batch has room: fewer requests run than the most seen running, or
  nothing waits;
- otherwise hold.

The allowance caps what may *wait* at vLLM. When the batch has free slots (nothing waits,
fewer run than the most seen, KV below ``KV_ROOM``) requests sent now go straight into the
running batch, so the snapshot's burst may also fill up to ``ceiling`` of those slots (the
``bonus``, the gate's ``free_slots``): the gate's dispatch rate is otherwise capped at
``max_waiting`` per snapshot, which leaves a fast backend's batch short between two
scrapes. A snapshot with a degraded backend gets no bonus. The gate counts every request
that started since the snapshot against the free slots first (``policies/gates.py``
``Gate.admits``), so once they are filled, requests sent by the gate wait at vLLM only up
to the allowance: adaptive pacing queues no more at vLLM than fixed pacing would.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.gates import BackendSnapshot

# Why the allowance last changed (or "start" before any change).
PACING_REASONS = ("start", "headroom", "tpot", "ttft", "waiting")
TPOT_MARGIN = 0.8  # back off at 80 % of the TPOT limit, before the gate shuts
STEP = 1.0  # additive increase per snapshot
DECREASE = 0.5  # multiplicative decrease
KV_ROOM = 0.9  # free batch slots count only while KV usage is below this


@dataclass(frozen=True, slots=True)
class PacingTargets:
    ceiling: int  # the class's max_waiting
    max_tpot_s: float
    ttft_slo_s: float | None = None  # None: no TTFT objective
    floor: int = 1


@dataclass(frozen=True, slots=True)
class Pacing:
    allowance: float
    reason: str = "start"
    peak_running: int = 0  # the most requests seen running at once (the batch's size)
    bonus: int = 0  # free batch slots this snapshot's burst may fill too

    @classmethod
    def start(cls, targets: PacingTargets) -> Pacing:
        return cls(float(targets.ceiling))

    @property
    def max_waiting(self) -> int:
        """The gate's ``max_waiting`` (its ``free_slots`` are the ``bonus``)."""
        return int(self.allowance)


def adjust(
    pacing: Pacing, snap: BackendSnapshot, ttft_s: float | None, targets: PacingTargets
) -> Pacing:
    """The allowance after one snapshot (``ttft_s``: the backend's recent mean TTFT)."""
    peak = max(pacing.peak_running, snap.running)
    floor = min(targets.floor, targets.ceiling)
    reason = _degraded(snap, ttft_s, targets)
    if reason is not None:
        lowered = max(float(floor), pacing.allowance * DECREASE)
        return Pacing(lowered, reason, peak)
    bonus = 0
    if snap.waiting == 0 and snap.kv_usage < KV_ROOM:
        bonus = min(peak - snap.running, targets.ceiling)
    has_room = snap.running < peak or snap.waiting == 0
    if has_room and pacing.allowance < targets.ceiling:
        raised = min(float(targets.ceiling), pacing.allowance + STEP)
        return Pacing(raised, "headroom", peak, bonus)
    return Pacing(pacing.allowance, pacing.reason, peak, bonus)


def _degraded(snap: BackendSnapshot, ttft_s: float | None, t: PacingTargets) -> str | None:
    if snap.tpot_s is not None and snap.tpot_s >= TPOT_MARGIN * t.max_tpot_s:
        return "tpot"
    if t.ttft_slo_s is not None and ttft_s is not None and ttft_s > t.ttft_slo_s:
        return "ttft"
    if snap.waiting > 2 * t.ceiling:
        return "waiting"
    return None
