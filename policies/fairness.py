"""Fairness among tenants and users of one (model, class) queue: what each request costs.

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

Length-aware pools and the prefill-token gate (``policies/prefill.py``) change whose turn
it is only among the requests a backend may take: a backend passes over requests outside
its prompt range (they are fair-ordered among themselves on the backends that take them),
so the bounds hold among the users competing for one pool's backends, not across pools,
whose capacities are separate by design. A request the prefill gate holds may be passed
by smaller ones for ``prefill_backfill_s``; its user's gap grows by at most what the
backends serve in that time.

Hierarchical fair share. The engine runs at two levels: tenants by tenant score, and the
users of each tenant by user score. A dispatch serves the least-served tenant's
least-served user and charges the request twice, with the same policy: its user's score by
the cost at the key's weight, its tenant's by the cost at the tenant's weight
(:func:`tenant_of`). A tenant with a queued request is active; a user or tenant that becomes
active is lifted to the smallest active score of its level (a user of a tenant with no
active user: to the score its tenant's last active user left at), so neither level banks
credit while idle. Backlogged tenants so share service in proportion to tenant weight,
whatever the number of their users, and the users of a tenant its share in proportion to
their weights. Each level is the one-level engine above over its own members, so its
bound (:func:`level_bounds`) is the policy's, in that level's weighted service: two
backlogged tenants, in tenant-weighted service; two backlogged users of one tenant, in
user-weighted service. With no tenants configured every user is its own tenant of the
key's weight: the tenant level is the one-level engine, unchanged. :class:`TwoLevel` is
the plain-data model of the scripts.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def tenant_of(user: str, key_tenant: str | None, key_weight: float,
              tenants: Mapping[str, float]) -> tuple[str, float]:
    """(tenant, weight at the tenant level) of a request of ``user`` (the scheduler's user:
    the key's user, or ``user/end_user`` for a key with trusted end users) sent with a key
    of ``key_weight`` naming ``key_tenant``, given the configured tenant weights.

    A key naming a tenant: that tenant at its configured weight (1 when it is not
    listed); its trusted end users are users of that tenant. A key naming none: the tenant
    named after ``user``, at its configured weight if listed, else the key's weight, so
    without tenants every user (and every trusted end user) is a tenant of one user
    weighing what it weighed before."""
    if key_tenant:
        return key_tenant, tenants.get(key_tenant, 1.0)
    return user, tenants.get(user, key_weight)


def level_bounds(policy: FairnessPolicy, max_tenant_request: float, max_user_request: float,
                 in_flight: int, max_tenant_unsettled: float, max_user_unsettled: float,
                 slack: float = 0.0) -> tuple[float, float]:
    """(the largest gap in tenant-weighted service between two backlogged tenants, the
    largest gap in user-weighted service between two backlogged users of one tenant):
    the policy's bound at each level, from that level's largest weighted request and
    unsettled service (``in_flight`` requests at most), each widened by the locality
    slack (it applies at both levels)."""
    return (with_locality(policy.bound(max_tenant_request, in_flight, max_tenant_unsettled),
                          slack),
            with_locality(policy.bound(max_user_request, in_flight, max_user_unsettled),
                          slack))


@dataclass(slots=True)
class TwoLevel:
    """The two-level engine of ``gateway/lua`` (enqueue, dispatch, settle, cancel) on
    plain data: one class, strict order (no locality slack). Ties go to the smaller name,
    as in a Redis zset."""

    tenants: dict[str, float] = field(default_factory=dict)  # active tenant -> score
    saved_tenants: dict[str, float] = field(default_factory=dict)
    users: dict[str, dict[str, float]] = field(default_factory=dict)  # tenant -> active
    saved_users: dict[str, dict[str, float]] = field(default_factory=dict)
    floors: dict[str, float] = field(default_factory=dict)  # tenant -> last user's score
    queues: dict[tuple[str, str], list[tuple[float, float]]] = field(default_factory=dict)

    def enqueue(self, tenant: str, user: str, cost: float, tenant_cost: float) -> None:
        self.queues.setdefault((tenant, user), []).append((cost, tenant_cost))
        users = self.users.setdefault(tenant, {})
        if user not in users:
            saved = self.saved_users.get(tenant, {}).get(user, 0.0)
            lift = min(users.values()) if users else self.floors.get(tenant)
            users[user] = saved if lift is None else max(saved, lift)
        if tenant not in self.tenants:
            saved = self.saved_tenants.get(tenant, 0.0)
            lift = min(self.tenants.values()) if self.tenants else None
            self.tenants[tenant] = saved if lift is None else max(saved, lift)

    def dispatch(self) -> tuple[str, str] | None:
        """Serve the least-served tenant's least-served user: (tenant, user)."""
        if not self.tenants:
            return None
        tenant = min(self.tenants, key=lambda t: (self.tenants[t], t))
        users = self.users[tenant]
        user = min(users, key=lambda u: (users[u], u))
        queue = self.queues[(tenant, user)]
        cost, tenant_cost = queue.pop(0)
        users[user] += cost
        self.tenants[tenant] += tenant_cost
        if not queue:
            self.saved_users.setdefault(tenant, {})[user] = users.pop(user)
            if not users:
                self.floors[tenant] = self.saved_users[tenant][user]
                self.saved_tenants[tenant] = self.tenants.pop(tenant)
        return tenant, user

    def settle(self, tenant: str, user: str, charge: float, tenant_charge: float) -> None:
        users = self.users.get(tenant, {})
        if user in users:
            users[user] += charge
        else:
            saved = self.saved_users.setdefault(tenant, {})
            saved[user] = saved.get(user, 0.0) + charge
        if tenant in self.tenants:
            self.tenants[tenant] += tenant_charge
        else:
            self.saved_tenants[tenant] = self.saved_tenants.get(tenant, 0.0) + tenant_charge


POLICIES = ("vtc", "round_robin")


def policy_for(name: str, cost: TokenCost | None = None) -> FairnessPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "vtc":
        return Vtc(cost or TokenCost())
    raise ValueError(f"unknown fairness policy {name!r}")
