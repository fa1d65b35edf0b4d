"""The read model: what operators see, for the admin API, the dashboard and ``/metrics``.

One place derives queue and backend state, from Redis (shared by every replica) and from
this replica's pool (its scrapes, gates and dispatch rates). Gates are read from each
backend handle, where they were computed once per snapshot; the requests in transit to a
backend (sent since its snapshot, or not yet registered by it) use up the burst allowance.
Service shares are every replica's (a decayed zset in Redis, fed by ``gateway/ops/history.py``),
with this replica's own view beside them; the last 15 minutes are every process's too
(``History``, kept in Redis).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from gateway.backends.handle import BackendHandle
from gateway.backends.scrape import BackendPool
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ApiKey, ReadsSettings, SettingsHolder
from gateway.ops.history import History
from gateway.scheduling.quotas import Quotas
from gateway.scheduling.running import RunningStreams
from gateway.scheduling.usage import UsageLedger, group
from gateway.storage.records import QueuedUser
from gateway.storage.store import Store
from policies.classes import CLASS_ORDER
from policies.gates import queued_for_a_slot
from policies.share_ratio import ShareRatios, share_ratios

USERS_SCANNED = 1000  # per (model, class): bounds the Redis reads of one state request
TOP_USERS = 20


class Inspector(ReadsSettings):
    def __init__(self, settings: SettingsHolder, store: Store, pool: BackendPool,
                 metrics: GatewayMetrics, replica_id: str, history: History,
                 running: RunningStreams | None = None) -> None:
        self.holder = settings
        self.running = running  # this process's dispatched, unsettled requests
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.replica_id = replica_id
        self.history = history  # its loop: services.py

    async def queues(self, model: str, now: float,
                     queued: list[QueuedUser] | None = None) -> dict[str, dict[str, Any]]:
        """Per class: depth, oldest wait, and the users with the most queued requests
        (``queued``: the queued users already read)."""
        depth = await self.store.reads.depths(model)
        classes: dict[str, dict[str, Any]] = {
            c: {"depth": depth[c], "oldest_wait_s": None, "active_users": 0, "users": []}
            for c in CLASS_ORDER}
        if queued is None:
            queued = await self.store.reads.queued_users(model, USERS_SCANNED)
        for q in queued:
            wait = None if q.oldest_enqueued_at is None else now - q.oldest_enqueued_at
            entry = classes[q.klass]
            entry["active_users"] += 1
            entry["users"].append({"user": q.user, "queued": q.queued, "score": q.score,
                                   "oldest_wait_s": wait,
                                   "oldest_request_id": q.oldest_request_id})
            if wait is not None and (entry["oldest_wait_s"] is None
                                     or wait > entry["oldest_wait_s"]):
                entry["oldest_wait_s"] = wait
        for entry in classes.values():
            entry["users"].sort(key=lambda u: (-u["queued"], u["score"]))
            del entry["users"][TOP_USERS:]
        return classes

    async def share_ratios(self, model: str, queued: list[QueuedUser]) -> ShareRatios:
        """Each backlogged tenant's and user's served share against its weight's, from
        the service every replica fed into Redis (``policies/share_ratio.py``). The
        backlogged are the users queued in the most urgent class with a queue: strict
        class order owes a lower class nothing (its starvation floor aside)."""
        top = next((c for c in CLASS_ORDER if any(q.klass == c for q in queued)), None)
        return share_ratios(await self.store.shares.service_accounts(model),
                            {q.user for q in queued if q.klass == top})

    async def backends(self, model: str, now: float) -> list[dict[str, Any]]:
        handles = self.pool.for_model(model)
        states = await self.store.fleet.backend_states(model, [h.name for h in handles])
        migrate = await self.store.fleet.migrate_times(model)
        out = []
        for h in handles:
            st = states[h.name]
            in_transit = st.sent_since_snapshot + st.unseen
            started = st.started_since_snapshot
            gates = h.badge_gates(st, now, self.settings.fleet.snapshot_stale_s)
            queued = None if st.snapshot is None else queued_for_a_slot(st.snapshot,
                                                                         h.peak_running)
            span = h.fit.prompt_range
            out.append({
                "name": h.name, "url": h.config.url, "model": model, "healthy": h.healthy,
                # config, admin or dns; leaving: removed, drained until nothing runs there
                "origin": h.origin, "leaving_since": h.leaving_since,
                "pool": h.config.pool,
                "prompt_tokens": {"min": span.min_tokens, "max": span.max_tokens},
                "prefill": {"pending_tokens": st.pending_prefill_tokens,
                            "limits": dict(h.fit.prefill_limits)},
                "drained": h.drained, "accepts_priority": h.accepts_priority,
                # a drain with migrate: when running answers move off it (unix s)
                "migrate_at": migrate.get(h.name),
                # this process's requests running there (every replica's: inflight)
                "running": 0 if self.running is None else self.running.count(h.name),
                "snapshot": None if st.snapshot is None else {
                    "waiting": st.snapshot.waiting, "running": st.snapshot.running,
                    # of those waiting: beyond the batch's free slots (the rest entered a
                    # free slot and start at the next engine step)
                    "waiting_queued": queued, "peak_running": h.peak_running,
                    "kv_usage": st.snapshot.kv_usage,
                    "tpot_ms": None if st.snapshot.tpot_s is None else st.snapshot.tpot_s * 1000,
                    "age_s": now - st.snapshot.taken_at_s},
                "sent_since_snapshot": st.sent_since_snapshot, "in_transit": in_transit,
                "started_since_snapshot": started,
                "inflight": st.inflight,
                "gates": {c: {"open": g.reason is None, "limit": g.limit, "reason": g.reason,
                              "free_slots": g.free_slots, "max_inflight": g.max_inflight}
                          for c, g in gates.items()},
                "pacing": {c: {"allowance": p.allowance, "free_slots": p.bonus,
                               "reason": p.reason} for c, p in h.pacing.items()},
                "dispatch_rate_per_s": self.metrics.dispatch.rate(h.name),
                "prefix_cache": {
                    "hit_ratio": h.prefix_hit_ratio,  # vLLM's counters, recent window
                    "predicted_hit_ratio": self.metrics.dispatch.predicted_hit_ratio(
                        h.name, self.settings.pacing.tpot_window_s),  # the prefix index's
                },
                "dispatch_reasons": dict(self.metrics.dispatch.decision_counts.get(h.name, {})),
                "lora": self._lora(h),
            })
        return out

    def _lora(self, h: BackendHandle) -> dict[str, Any] | None:
        """Its LoRA adapters (docs/adapters.md): resident (available there), active (with
        live requests, by vLLM's gauge) and its slots; None: its model has none."""
        fit = self.pool.fit(h)
        if fit.adapters is None and h.card.lora is None:
            return None
        return {"resident": sorted(self.pool.adapters_on(h)),
                "active": sorted(h.card.lora.active) if h.card.lora else [],
                "slots": h.card.lora.max_lora if h.card.lora else None}

    async def backend(self, name: str) -> dict[str, Any]:
        model = self.pool.handles[name].config.model
        return next(b for b in await self.backends(model, time.time()) if b["name"] == name)

    async def state(self) -> dict[str, Any]:
        now = time.time()
        models = {}
        await self.history.flush_service()  # this replica's latest service counts at once
        for model in self.settings.models():
            shares = self.metrics.usage.shares.get(model)
            share_list = [] if shares is None else [
                {"user": u, "share": s} for u, s in shares.shares(time.monotonic()).items()]
            everyone = await self.store.shares.service_shares(model)
            inflight = await self.store.reads.user_inflight(model)
            queued = await self.store.reads.queued_users(model, USERS_SCANNED)
            ratios = await self.share_ratios(model, queued)
            models[model] = {
                "queues": await self.queues(model, now, queued),
                "backends": await self.backends(model, now),
                "service_shares": [{"user": u, "share": s}
                                   for u, s in list(everyone.items())[:TOP_USERS]],
                "replica_service_shares": share_list[:TOP_USERS],
                "share_ratios": {"tenants": _top(ratios.tenants), "users": _top(ratios.users)},
                "inflight_by_user": dict(sorted(inflight.items(),
                                                key=lambda kv: -kv[1])[:TOP_USERS]),
            }
        return {"replica_id": self.replica_id, "time": now,
                "fairness": self.settings.fairness.policy,
                "models": models, "history": await self.history.view(),
                "moves": {**self.metrics.moves.view(),
                          "preempted_users": self.metrics.usage.preempted_view()}}

    async def refresh_queue_metrics(self) -> None:
        """Gauges read from Redis at scrape time: queue depth and oldest wait, and the
        share ratios (with this replica's latest service added first)."""
        now = time.time()
        await self.history.flush_service()
        for model in self.settings.models():
            queued = await self.store.reads.queued_users(model, USERS_SCANNED)
            for klass, entry in (await self.queues(model, now, queued)).items():
                self.metrics.queue.depth.labels(model, klass).set(entry["depth"])
                self.metrics.queue.oldest_wait.labels(model, klass).set(
                    entry["oldest_wait_s"] or 0.0)
            ratios = await self.share_ratios(model, queued)
            self.metrics.usage.set_share_ratios(model, ratios.tenants, ratios.users)


def _top(ratios: dict[str, float]) -> dict[str, float]:
    """The ``TOP_USERS`` farthest from fair, farthest first."""
    return dict(sorted(ratios.items(), key=lambda kv: -abs(kv[1] - 1.0))[:TOP_USERS])


async def usage_today(usage: UsageLedger, quotas: Quotas, tenants: Iterable[str],
                      top: int = TOP_USERS) -> dict[str, Any]:
    """The dashboard's usage panel: today's (UTC) top tenants and users by tokens, and
    the budgets of the configured tenants that have one, with what they used."""
    today = datetime.now(UTC).date()
    rows = await usage.rows(today, today)
    budgets = []
    for tenant in sorted(tenants):
        for scope in await quotas.view(ApiKey(key="", user=tenant, tenant=tenant, weight=1.0)):
            for period in ("daily_tokens", "monthly_tokens"):
                if period in scope["limits"]:
                    budgets.append({"tenant": tenant, "period": period.split("_")[0],
                                    "used": scope[f"{period}_used"],
                                    "limit": scope["limits"][period]})
    return {"day": today.isoformat(), "tenants": group(rows, ["tenant"])[:top],
            "users": group(rows, ["tenant", "user"])[:top], "budgets": budgets}
