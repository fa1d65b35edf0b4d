"""Step-timing records and their summary: how far wall-clock steps drift from the model."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple


class StepTiming(NamedTuple):
    """One engine step: modelled and wall-clock durations, batch size, and how late the
    step ended relative to its absolute deadline."""

    modelled_s: float
    actual_s: float
    batch_tokens: int
    num_seqs: int
    late_s: float = 0.0


@dataclass(frozen=True)
class StepStats:
    """Summary of many steps. Ratios are actual/modelled over steps with a nonzero model."""

    num_steps: int
    modelled_total_s: float
    actual_total_s: float
    ratio_p50: float
    ratio_p99: float
    ratio_max: float
    late_p50_s: float
    late_p99_s: float
    max_batch_seqs: int

    @property
    def total_ratio(self) -> float:
        """Sum of actual over sum of modelled step time (1.0 = no drift)."""
        if self.modelled_total_s == 0:
            return float("nan")
        return self.actual_total_s / self.modelled_total_s

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict including ``total_ratio``."""
        return {**asdict(self), "total_ratio": self.total_ratio}


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, int(q * len(sorted_values)))
    return sorted_values[index]


def summarize(steps: Iterable[StepTiming]) -> StepStats:
    """Summarize step timings."""
    items = list(steps)
    ratios = sorted(s.actual_s / s.modelled_s for s in items if s.modelled_s > 0)
    lates = sorted(s.late_s for s in items)
    return StepStats(
        num_steps=len(items),
        modelled_total_s=sum(s.modelled_s for s in items),
        actual_total_s=sum(s.actual_s for s in items),
        ratio_p50=_quantile(ratios, 0.50),
        ratio_p99=_quantile(ratios, 0.99),
        ratio_max=ratios[-1] if ratios else float("nan"),
        late_p50_s=_quantile(lates, 0.50),
        late_p99_s=_quantile(lates, 0.99),
        max_batch_seqs=max((s.num_seqs for s in items), default=0),
    )
