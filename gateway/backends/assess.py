"""The classes' gate policies and pacing targets of the settings in force, and what a
snapshot makes of them: each class's gate and its pacing after it."""

from __future__ import annotations

import dataclasses
import math

from gateway.core.settings import Settings
from policies.classes import CLASS_ORDER
from policies.gates import BackendSnapshot, Gate, GatePolicy, evaluate_gate
from policies.pacing import Pacing, PacingTargets, adjust


class ClassGates:
    """Derived again from each settings swap (:meth:`derive`)."""

    def __init__(self, settings: Settings) -> None:
        self.policies: dict[str, GatePolicy] = {}
        self.pacing_targets: dict[str, PacingTargets] | None = None
        self.derive(settings)

    def derive(self, settings: Settings) -> None:
        self.policies = {c: settings.classes[c].gate() for c in CLASS_ORDER}
        self.pacing_targets = ({c: settings.classes[c].pacing_targets() for c in CLASS_ORDER}
                               if settings.pacing == "adaptive" else None)

    def initial_pacing(self) -> dict[str, Pacing]:
        return {c: Pacing(float(p.max_waiting)) for c, p in self.policies.items()}

    def capped(self, pacing: dict[str, Pacing]) -> dict[str, Pacing]:
        """``pacing`` under each class's ``max_waiting`` now (a lowered one caps at once)."""
        return {c: dataclasses.replace(
            p, allowance=min(p.allowance, float(self.policies[c].max_waiting)))
            for c, p in pacing.items()}

    def assess(self, pacing: dict[str, Pacing], snap: BackendSnapshot, ttft_s: float | None,
               peak: int) -> tuple[dict[str, Gate], dict[str, Pacing]]:
        """Each class's gate by this snapshot, and its pacing after it: the class's gate
        policy with the batch as seen so far, its ``max_waiting`` moved by adaptive
        pacing."""
        gates, after = {}, dict(pacing)
        for cls, base in self.policies.items():
            policy = dataclasses.replace(base, batch=peak)
            if self.pacing_targets is not None:
                p = after[cls] = adjust(pacing[cls], snap, ttft_s, self.pacing_targets[cls])
                policy = dataclasses.replace(policy, max_waiting=p.max_waiting,
                                             free_slots=p.bonus)
            gates[cls] = evaluate_gate(snap, policy, snap.taken_at_s, math.inf)
        return gates, after
