"""The ``priority`` number forwarded to vLLM (lower = scheduled sooner).

class base (``policies/classes.py``) + the request's rank among its user's outstanding
requests for the model. Ranks are capped below the gap between class bases so class
always dominates.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def vllm_priority(class_base: int, rank: int, class_gap: int = 1000) -> int:
    return class_base + min(max(rank, 0), class_gap - 1)


@dataclass(slots=True)
class InFlight:
    """A model's requests in flight as ``gateway/storage/lua/lib/inflight.lua`` counts them: a
    grant's rank is how many of its user's requests are already in flight (on any
    backend); the backend counts its own, and its sent-since-snapshot set holds each
    granted request until it is released (or a snapshot saw it)."""

    per_user: dict[str, int] = field(default_factory=dict)
    on_backend: int = 0
    sent: set[str] = field(default_factory=set)

    def grant(self, request_id: str, user: str) -> tuple[int, int]:
        """(the request's rank, the backend's requests in flight with it)."""
        rank = self.per_user.get(user, 0)
        self.per_user[user] = rank + 1
        self.on_backend += 1
        self.sent.add(request_id)
        return rank, self.on_backend

    def release(self, request_id: str, user: str) -> bool:
        """Out of both counts (never below zero); True when it was still in the sent set."""
        left = self.per_user.pop(user, 0) - 1
        if left > 0:
            self.per_user[user] = left
        self.on_backend = max(0, self.on_backend - 1)
        if request_id in self.sent:
            self.sent.remove(request_id)
            return True
        return False
