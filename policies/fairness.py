"""Fairness among users of one (model, class) queue: what each request costs its user.

The Redis scripts (``gateway/lua``) are a generic virtual-time engine: each active user
has a score, the smallest score is served next, a dispatch adds the request's
``dispatch_cost`` to its user's score, a settle adds ``settle_charge``, and a user who
becomes active is lifted to the smallest active score so it cannot bank credit while idle.
A policy only says what those costs are:

- :class:`RoundRobin`: per request, 1 / key weight at dispatch, nothing at settle.
  Backlogged users take turns (weighted by their keys).
- :class:`Vtc`: Virtual Token Counter (Sheng et al., OSDI 2024). The prompt estimate ×
  ``w_in`` at dispatch; at settle the output tokens × ``w_out`` plus the correction of the
  prompt estimate by the real count; all divided by the key weight.

Each policy states its fairness bound (:meth:`FairnessPolicy.bound`): the largest gap in
weighted service between two continuously backlogged users, given the largest cost of one
request and how many requests may be in flight (charged only when they settle).

With ``routing: locality`` (``policies/locality.py``) a backend may serve, instead of the
least-served user, another whose score is at most ``locality_slack`` above the smallest
active score (the one whose prompt prefix it has cached), as D²LPM does (Cao et al.,
"Locality-aware Fair Scheduling in LLM Serving", 2025). A user more than the slack above
the minimum is never served before the least-served user, so every bound below grows by
the slack at most (:func:`with_locality`); ``locality_slack: 0`` is the strict order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from policies.cost import TokenCost


class FairnessPolicy(Protocol):
    @property
    def name(self) -> str: ...

    def dispatch_cost(self, prompt_tokens: int, weight: float) -> float:
        """Added to the user's score when the request is dispatched."""

    def settle_charge(self, prompt_tokens: int, charged_prompt: int, output_tokens: int,
                      weight: float) -> float:
        """Added when it settles: real usage, less what dispatch charged."""

    def service(self, prompt_tokens: int, output_tokens: int, weight: float) -> float:
        """Weighted service of one finished request, in the policy's unit."""

    def bound(self, max_request_service: float, in_flight: int,
              max_unsettled_service: float) -> float:
        """The policy's fairness bound for two backlogged users."""


@dataclass(frozen=True, slots=True)
class RoundRobin:
    name: str = "round_robin"

    def dispatch_cost(self, prompt_tokens: int, weight: float) -> float:
        return 1.0 / weight

    def settle_charge(self, prompt_tokens: int, charged_prompt: int, output_tokens: int,
                      weight: float) -> float:
        return 0.0

    def service(self, prompt_tokens: int, output_tokens: int, weight: float) -> float:
        return 1.0 / weight

    def bound(self, max_request_service: float, in_flight: int,
              max_unsettled_service: float) -> float:
        return 2 * max_request_service  # everything is charged at dispatch


@dataclass(frozen=True, slots=True)
class Vtc:
    cost: TokenCost = field(default_factory=TokenCost)
    name: str = "vtc"

    def dispatch_cost(self, prompt_tokens: int, weight: float) -> float:
        return self.cost.of(prompt_tokens, 0, weight)

    def settle_charge(self, prompt_tokens: int, charged_prompt: int, output_tokens: int,
                      weight: float) -> float:
        return self.cost.of(prompt_tokens - charged_prompt, output_tokens, weight)

    def service(self, prompt_tokens: int, output_tokens: int, weight: float) -> float:
        return self.cost.of(prompt_tokens, output_tokens, weight)

    def bound(self, max_request_service: float, in_flight: int,
              max_unsettled_service: float) -> float:
        # VTC's 2·U, plus the output of requests dispatched but not yet settled
        return 2 * max_request_service + in_flight * max_unsettled_service


def with_locality(bound: float, slack: float) -> float:
    """A policy's fairness bound when locality may serve users within ``slack`` of the
    least-served one first."""
    return bound + slack


POLICIES = ("vtc", "round_robin")


def policy_for(name: str, cost: TokenCost | None = None) -> FairnessPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "vtc":
        return Vtc(cost or TokenCost())
    raise ValueError(f"unknown fairness policy {name!r}")
