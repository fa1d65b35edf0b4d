"""How fair recent service was: each backlogged tenant's and user's share of it against
the share its weight entitles it to (``fairgate_share_ratio``; 1.0 is exactly fair).

Plain data in: per user, its recent service at weight 1 (the fairness policy's unit:
VTC's weighted tokens, or requests under round robin, decayed over a recent window), its
tenant and the two weights (:func:`policies.fairness.tenant_of`); and the users
backlogged now (a request queued). Only the backlogged compete, so only they are owed a
share: a user that asks for less than its share is served all it asks and is not
reported.

- A backlogged tenant's entitled share is its weight over the weights of the backlogged
  tenants; its served share is the service of all its users over the service of all the
  backlogged tenants' users.
- A backlogged user's entitled share is its tenant's times its weight over the weights of
  the tenant's backlogged users; its served share is its service over the same total.
  With no tenant configured a user is its own tenant at its key's weight, and its ratio
  is that tenant's.

The ratio is served share ÷ entitled share. A scheduler that keeps every backlogged pair
within the policy's bound (:meth:`policies.fairness.FairnessPolicy.bound`) drives it to
1 as the window's service grows; scheduling by replica instead of globally shows as a
ratio far from 1 (``docs/reliability.md``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Account:
    """One user's recent service and where its weight comes from."""

    service: float  # at weight 1: what it cost the backends
    weight: float = 1.0  # its key's weight, among its tenant's users
    tenant: str = ""  # "": the tenant named after the user
    tenant_weight: float = 1.0  # its tenant's weight among tenants


@dataclass(frozen=True, slots=True)
class ShareRatios:
    """Served ÷ entitled share of each backlogged tenant (named ones only: a user's own
    tenant is the user) and each backlogged user."""

    tenants: dict[str, float] = field(default_factory=dict)
    users: dict[str, float] = field(default_factory=dict)


def share_ratios(accounts: Mapping[str, Account], backlogged: Iterable[str]) -> ShareRatios:
    """The ratios of the ``backlogged`` users that have an account, and of their tenants.
    Empty when they were served nothing (no share to compare)."""
    competing = sorted(u for u in set(backlogged) if u in accounts)

    def tenant(user: str) -> str:
        return accounts[user].tenant or user

    tenant_weight: dict[str, float] = {}
    members: dict[str, list[str]] = {}
    for user in competing:
        t = tenant(user)
        tenant_weight[t] = max(tenant_weight.get(t, 0.0), accounts[user].tenant_weight)
        members.setdefault(t, []).append(user)
    served: dict[str, float] = dict.fromkeys(tenant_weight, 0.0)
    for user, account in accounts.items():
        if tenant(user) in served:
            served[tenant(user)] += max(account.service, 0.0)
    total = sum(served.values())
    weights = sum(tenant_weight.values())
    if total <= 0 or weights <= 0:
        return ShareRatios()
    entitled = {t: w / weights for t, w in tenant_weight.items()}
    users: dict[str, float] = {}
    for t, names in members.items():
        inner = sum(accounts[u].weight for u in names)
        for u in names:
            share = entitled[t] * accounts[u].weight / inner if inner > 0 else 0.0
            if share > 0:
                users[u] = max(accounts[u].service, 0.0) / total / share
    tenants = {t: served[t] / total / entitled[t] for t in members
               if entitled[t] > 0 and any(accounts[u].tenant for u in members[t])}
    return ShareRatios(tenants, users)
