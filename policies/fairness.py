"""Fairness among users of one (model, class) queue.

Both policies keep one score per active user and serve the smallest score next; they
differ only in how a score moves, which is all this module decides. The atomic
bookkeeping runs in Redis (``gateway/lua``), parameterised by :class:`ScoreRule`.

- ``round_robin``: per request. A served user goes to the back (score = max + 1); a new
  user joins at the back.
- ``vtc``: Virtual Token Counter (Sheng et al., OSDI 2024). The score is the user's
  weighted service: prompt tokens × ``w_in`` charged at dispatch, output tokens ×
  ``w_out`` at completion, divided by the user's weight. A user returning from idle is
  lifted to the minimum active score so it cannot bank credit while away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["rotate", "charge"]


@dataclass(frozen=True, slots=True)
class ScoreRule:
    """Parameters the Redis scripts apply; ``mode`` picks the score movement."""

    mode: Mode
    w_in: float = 0.0
    w_out: float = 0.0

    def dispatch_charge(self, prompt_tokens: int, weight: float) -> float:
        return prompt_tokens * self.w_in / weight if self.mode == "charge" else 0.0

    def completion_charge(
        self, prompt_tokens: int, charged_prompt: int, output_tokens: int, weight: float
    ) -> float:
        """Output cost plus the correction of the prompt estimate charged at dispatch."""
        if self.mode != "charge":
            return 0.0
        return ((prompt_tokens - charged_prompt) * self.w_in + output_tokens * self.w_out) / weight


def round_robin() -> ScoreRule:
    return ScoreRule("rotate")


def vtc(w_in: float = 1.0, w_out: float = 2.0) -> ScoreRule:
    return ScoreRule("charge", w_in, w_out)


def rule_for(name: str) -> ScoreRule:
    if name == "round_robin":
        return round_robin()
    if name == "vtc":
        return vtc()
    raise ValueError(f"unknown fairness policy {name!r}")


def join_score(rule: ScoreRule, saved: float | None, active_min: float | None,
               active_max: float | None) -> float:
    """Score of a user becoming active (reference for the enqueue script)."""
    if rule.mode == "rotate":
        return (active_max or 0.0) + 1.0
    own = saved or 0.0
    return own if active_min is None else max(own, active_min)
