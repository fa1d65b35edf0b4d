"""Fair share across models (``fairness_scope: fleet``), on plain data.

Per model (the default scope) each model's queues count only their own service: a tenant
that floods two models gets a full share on each. In fleet scope a tenant's and a user's
service counters span every model: a charge on one model (a dispatch cost, a settle
charge) counts on every other model too, on the scores that model keeps for the same
tenant and user (active or saved), so a tenant using two models gets one share across
both. Each model's charges are multiplied by its cost factor (``cost_factors``, 1.0 when
absent; relative GPU-seconds per token, say), which the gateway folds into the weight the
policy divides by (:func:`fleet_weight`), so a token of an 8x model counts as eight.

**Virtual time stays per model.** Each model keeps its own scores and its own floor:
a tenant (or user) that becomes active on a model is lifted to the smallest active
score *of that model*, as VTC lifts a returning client, and that lift touches no other
model. What spans the fleet is the service charged, not the floor. So:

- while two tenants are backlogged on a model, the gap between their scores there is
  their gap in fleet-wide weighted service (since each joined), and the model serves the
  one with less: a tenant served on another model yields its turn here;
- a tenant new to a model, or back after an idle spell, starts at that model's floor, so
  service it got elsewhere does not count against it there until it is active, and credit
  it did not use elsewhere is not banked either (the lift is never downward);
- a model where a tenant was never seen keeps no score for it (a charge elsewhere does not
  create one): its first request there joins at the floor.

The bound of one model's two backlogged tenants is the per-model bound, in fleet-weighted
service. A model that only one tenant uses serves it at full speed (work conservation);
fleet scope then lowers that tenant's turn on the models it shares. :class:`Fleet` is the
plain-data model of the scripts (``spread`` in ``gateway/storage/lua/_lib.lua``);
``tests/store/test_lua_fleet_spec.py`` holds them to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from policies.fairness import TwoLevel

DEFAULT_COST_FACTOR = 1.0
"""A model's cost factor when ``cost_factors`` does not name it."""


def fleet_weight(weight: float, cost_factor: float) -> float:
    """The weight a request's charges are divided by so that they come out multiplied by
    its model's ``cost_factor`` (the policies charge service ÷ weight)."""
    if not cost_factor > 0:
        raise ValueError(f"a cost factor must be above 0, not {cost_factor!r}")
    return weight / cost_factor


def _known_charge(active: dict[str, float], saved: dict[str, float], member: str,
                  amount: float) -> None:
    if member in active:
        active[member] += amount
    elif member in saved:
        saved[member] += amount


@dataclass(slots=True)
class Fleet:
    """One class's :class:`TwoLevel` engine per model, whose charges also count on the
    other models (``spread`` in ``lua/_lib.lua``). Costs are given already multiplied by
    the model's cost factor, as the gateway stores them."""

    engines: dict[str, TwoLevel] = field(default_factory=dict)

    def engine(self, model: str) -> TwoLevel:
        return self.engines.setdefault(model, TwoLevel())

    def enqueue(self, model: str, tenant: str, user: str, cost: float,
                tenant_cost: float, request_id: str | None = None) -> int:
        """Queue on ``model``, joining its levels at that model's floor."""
        return self.engine(model).enqueue(tenant, user, cost, tenant_cost, request_id)

    def spread(self, model: str, tenant: str, user: str, cost: float,
               tenant_cost: float) -> None:
        """A charge on ``model`` counted on every other model that knows the member."""
        for other, engine in self.engines.items():
            if other == model:
                continue
            if cost:
                _known_charge(engine.users.get(tenant, {}),
                              engine.saved_users.get(tenant, {}), user, cost)
            if tenant_cost:
                _known_charge(engine.tenants, engine.saved_tenants, tenant, tenant_cost)

    def dispatch(self, model: str) -> tuple[str, str] | None:
        """Serve ``model``'s least-served tenant's least-served user; its charge counts
        on the other models too."""
        engine = self.engine(model)
        pick = engine.pick()
        if pick is None:
            return None
        request = engine.serve(pick)
        self.spread(model, pick.tenant, pick.user, request.cost, request.tenant_cost)
        return pick.tenant, pick.user

    def settle(self, model: str, tenant: str, user: str, charge: float,
               tenant_charge: float) -> None:
        self.engine(model).settle(tenant, user, charge, tenant_charge)
        self.spread(model, tenant, user, charge, tenant_charge)


def factor_of(cost_factors: Mapping[str, float], model: str) -> float:
    """A model's cost factor (:data:`DEFAULT_COST_FACTOR` when not listed)."""
    return cost_factors.get(model, DEFAULT_COST_FACTOR)
