"""Which backend of a model takes the next request: the least loaded open one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    waiting: int
    running: int
    sent_since_snapshot: int
    open: bool

    @property
    def load(self) -> int:
        return self.waiting + self.sent_since_snapshot + self.running


def by_load(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Open candidates, least loaded first (name breaks ties for determinism)."""
    return sorted((c for c in candidates if c.open), key=lambda c: (c.load, c.name))
