"""Limits and budgets of keys and tenants, enforced in Redis across replicas.

The rules are ``policies/limits.py``; this module runs them: one Lua call checks and
charges a request against its key's and its tenant's limits at once
(``lua/quota_admit.lua``: all or nothing, so concurrent requests on any replica never
spend the same budget twice), one corrects the charge when it ends
(``lua/quota_settle.lua``). Concurrency slots carry a lease that this replica's heartbeat
renews while the request runs: a replica that dies frees its slots within
``quota_lease_s``; its token reservations stay charged (never a lost count).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.core.errors import InsufficientQuota, RateLimitExceeded, StoreUnavailable
from gateway.core.settings import ApiKey, ReadsSettings, SettingsHolder, Tenant, UsageLimits
from gateway.storage.keys import quota_budget, quota_keys
from gateway.storage.redis_client import BoundaryRedis
from gateway.storage.scripts import load_script
from policies.limits import (
    KINDS,
    WINDOW_S,
    Scope,
    ScopeState,
    bucket_level,
    periods,
    rate_headers,
    refusal,
)

log = structlog.get_logger("fairgate.quotas")

DAY_TTL_S = 2 * 86400
MONTH_TTL_S = 32 * 86400


@dataclass(slots=True)
class Held:
    """A request's charge against its limits, until it ends."""

    request_id: str
    scopes: list[Scope]
    keys: list[str]
    reserve: int
    headers: dict[str, str] = field(default_factory=dict)


def _scope(kind: str, name: str, redis_scope: str, limits: UsageLimits) -> Scope:
    return Scope(kind, name, redis_scope, **limits.model_dump())


class Quotas(ReadsSettings):
    def __init__(self, client: BoundaryRedis, settings: SettingsHolder) -> None:
        self.client: Any = client  # redis-py's sync/async union types: untyped here
        self.holder = settings
        self._admit = client.register_script(load_script("quota_admit"))
        self._settle = client.register_script(load_script("quota_settle"))
        self.held: dict[str, Held] = {}  # requests holding concurrency slots (heartbeat)

    @property
    def tenants(self) -> dict[str, Tenant]:
        return self.settings.tenants

    @property
    def lease_s(self) -> float:
        return self.settings.quota_lease_s

    def scopes(self, key: ApiKey) -> list[Scope]:
        """The limits a request of ``key`` is checked against: the key's, its tenant's."""
        found = []
        if key.limits is not None and key.limits.any():
            found.append(_scope("key", key.id or key.user, f"k:{key.id or key.user}",
                                key.limits))
        tenant = self.tenants.get(key.tenant_name)
        if tenant is not None and tenant.limits is not None and tenant.limits.any():
            found.append(_scope("tenant", key.tenant_name, "t", tenant.limits))
        return found

    @staticmethod
    def _keys(tenant: str, scopes: list[Scope], now: float) -> list[str]:
        day, month, _, _ = periods(now)
        keys: list[str] = []
        for scope in scopes:
            keys += [*quota_keys(tenant, scope.redis_scope),
                     quota_budget(tenant, scope.redis_scope, day),
                     quota_budget(tenant, scope.redis_scope, month)]
        return keys

    async def admit(self, key: ApiKey, request_id: str, reserve: int) -> Held | None:
        """Charge a request to its limits (None: it has none); 429
        ``rate_limit_exceeded`` or ``insufficient_quota`` when one refuses it."""
        scopes = self.scopes(key)
        if not scopes:
            return None
        now = time.time()
        keys = self._keys(key.tenant_name, scopes, now)
        args: list[Any] = [repr(now), request_id, reserve, self.lease_s, len(scopes)]
        for scope in scopes:
            args += scope.args()
        raw = await self._admit(keys=keys, args=[*args, DAY_TTL_S, MONTH_TTL_S])
        states = [_state(scope, raw[4 + 5 * i: 9 + 5 * i]) for i, scope in enumerate(scopes)]
        headers = rate_headers(scopes, states)
        if int(raw[0]) != 1:
            answer = refusal(scopes[int(raw[1]) - 1], str(raw[2]), int(raw[3]) / 1000, now)
            log.info("limit_refused", scope=scopes[int(raw[1]) - 1].kind, limit=str(raw[2]),
                     code=answer.code)
            error = (InsufficientQuota if answer.code == "insufficient_quota"
                     else RateLimitExceeded)
            raise error(answer.message, retry_after_s=answer.retry_after_s,
                        limit_headers=headers)
        held = Held(request_id, scopes, keys, reserve, headers)
        if any(s.max_concurrent for s in scopes):
            self.held[request_id] = held
        return held

    async def settle(self, held: Held, tokens: int) -> None:
        """The request ended having used ``tokens`` (prompt + completion)."""
        self.held.pop(held.request_id, None)
        args: list[Any] = [repr(time.time()), held.request_id, tokens - held.reserve,
                           len(held.scopes)]
        for scope in held.scopes:
            args += scope.args()
        await self._settle(keys=held.keys, args=args)

    async def run(self) -> None:
        """Renew the leases of this replica's concurrency slots while they run."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            if not self.held:
                continue
            expiry = time.time() + self.lease_s
            async with self.client.pipeline(transaction=False) as pipe:
                for held in list(self.held.values()):
                    for i, scope in enumerate(held.scopes):
                        if scope.max_concurrent:
                            pipe.zadd(held.keys[5 * i + 2], {held.request_id: expiry}, xx=True)
                try:
                    await pipe.execute()
                except StoreUnavailable as exc:
                    log.warning("quota_lease_renewal_failed", error=str(exc))

    async def view(self, key: ApiKey) -> list[dict[str, Any]]:
        """Each scope's limits and what is left of them now (read only)."""
        scopes = self.scopes(key)
        now = time.time()
        keys = self._keys(key.tenant_name, scopes, now)
        _, _, to_day, to_month = periods(now)
        async with self.client.pipeline(transaction=False) as pipe:
            for i in range(len(scopes)):
                rpm, tpm, conc, day, month = keys[5 * i: 5 * i + 5]
                pipe.hmget(rpm, "level", "ts")
                pipe.hmget(tpm, "level", "ts")
                pipe.zcount(conc, now, "+inf")
                pipe.get(day)
                pipe.get(month)
            raw = await pipe.execute()
        out = []
        for i, scope in enumerate(scopes):
            r, t, conc, day, month = raw[5 * i: 5 * i + 5]
            row: dict[str, Any] = {"scope": scope.kind, "name": scope.name,
                                   "limits": {k: scope.limit(k) for k in KINDS
                                              if scope.limit(k) is not None}}
            for kind, pair in (("requests", r), ("tokens", t)):
                cap = scope.rpm if kind == "requests" else scope.tpm
                if cap is not None:
                    level = bucket_level(_float(pair[0]), _float(pair[1]), cap, now)
                    row[f"{kind}_remaining"] = max(0, math.floor(level))
                    row[f"{kind}_reset_s"] = round((cap - level) * WINDOW_S / cap, 3)
            if scope.max_concurrent is not None:
                row["concurrent"] = int(conc)
            for kind, used, reset in (("daily_tokens", day, to_day),
                                      ("monthly_tokens", month, to_month)):
                limit = scope.limit(kind)
                if limit is not None:
                    spent = int(used or 0)
                    row[f"{kind}_used"] = spent
                    row[f"{kind}_remaining"] = max(0, limit - spent)
                    row[f"{kind}_reset_s"] = reset
            out.append(row)
        return out


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _state(scope: Scope, raw: list[Any]) -> ScopeState:
    r, t = raw[0], raw[1]
    conc, day, month = (int(v) for v in raw[2:])
    requests = tokens = None
    requests_reset = tokens_reset = 0.0
    if scope.rpm is not None and r is not None:
        level = int(r) / 1000
        requests, requests_reset = math.floor(level), (scope.rpm - level) * WINDOW_S / scope.rpm
    if scope.tpm is not None and t is not None:
        level = int(t) / 1000
        tokens, tokens_reset = math.floor(level), (scope.tpm - level) * WINDOW_S / scope.tpm
    return ScopeState(
        requests, max(0.0, requests_reset), tokens, max(0.0, tokens_reset),
        conc if conc >= 0 else None,
        scope.daily_tokens - day if scope.daily_tokens is not None and day >= 0 else None,
        scope.monthly_tokens - month if scope.monthly_tokens is not None and month >= 0
        else None)
