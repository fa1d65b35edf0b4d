"""One dispatch decision's call, both ways: the named arguments ``dispatch_for`` in
``lua/lib/dispatch.lua`` reads (:func:`dispatch_args`), the keys the scripts that run it
declare for Redis Cluster, and what it returned, decoded (:func:`dispatched_from`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gateway.storage.keys import ModelKeys
from gateway.storage.records import (
    GRANT_PICKUP_S,
    BackendFit,
    Dispatched,
    Grant,
    Locality,
    Start,
)
from policies.classes import CLASS_ORDER
from policies.gates import Gate
from policies.prefill import TOKENS_PER_BLOCK


def start_keys(model: str, starts: Sequence[Start]) -> list[str]:
    """The keys marking ``starts`` touches, declared for Redis Cluster."""
    k = ModelKeys(model)
    return [key for s in starts for key in (
        k.backend_sent(s.backend), k.backend_snapshot(s.backend), k.request(s.request_id),
        k.backend_prefill(s.backend), k.backend_started(s.backend))]


def leave_keys(k: ModelKeys, request_id: str, backend: str) -> list[str]:
    """The keys a segment leaving ``backend`` touches, declared for Redis Cluster."""
    return [k.request(request_id), k.backend_sent(backend), k.backend_snapshot(backend),
            k.backend_prefill(backend), k.backend_started(backend),
            k.backend_inflight(backend), k.user_inflight]


def starts_arg(starts: Sequence[Start]) -> list[dict[str, Any]]:
    return [{"id": s.request_id, "backend": s.backend, "at": s.at} for s in starts]


def _gate(limit: int | Gate) -> Gate:
    return limit if isinstance(limit, Gate) else Gate(limit)


def _takes(fit: BackendFit) -> dict[str, Any]:
    """What a backend takes, as ``range_takes`` in ``lua/lib/pools.lua`` reads it."""
    span = fit.prompt_range
    return {"min": span.min_tokens, "max": span.max_tokens or 0,
            **({} if fit.adapters is None else {"adapters": sorted(fit.adapters)})}


def dispatch_args(
    model: str, backend: str, limits: Mapping[str, int | Gate], replica: str, now: float,
    replica_ttl_s: float, order: Sequence[str] = CLASS_ORDER, recent_window: int = 100,
    max_grants: int = 1, grant_pickup_s: float = GRANT_PICKUP_S,
    locality: Locality | None = None, fit: BackendFit | None = None,
    sessions: bool = False, seen: float | None = None,
) -> dict[str, Any]:
    """The named arguments of one dispatch decision for ``backend`` (see
    :meth:`QueueStore.dispatch`), as ``dispatch_for`` in ``lua/lib/dispatch.lua`` reads them.
    ``sessions``: each user's requests come from its least-served session (the third
    level, ``policies/fairness.py``). ``seen``: the taken_at of the snapshot ``limits``
    come from (None: the stored one), so that they count what was sent since it
    (``gate_counts`` in ``lua/_lib.lua``)."""
    fit = fit or BackendFit()
    loc = locality or Locality(0.0, 0, 0, 0.0)
    span = fit.prompt_range
    gates = {c: _gate(limits.get(c, 0)) for c in order}
    return {
        "now": now, "replica_ttl_s": replica_ttl_s, "prefix": ModelKeys(model).prefix,
        "replica": replica, "backend": backend, "recent_window": recent_window,
        "max_grants": max_grants, "grant_pickup_s": grant_pickup_s,
        "classes": [{"name": c, "limit": g.limit if g.reason is None else 0,
                     "prefill_limit": fit.prefill_limits.get(c, 0),
                     "free_slots": g.free_slots,
                     "max_inflight": g.max_inflight if g.reason is None else 0}
                    for c, g in gates.items()],
        "locality": {"slack": loc.slack, "candidates": loc.candidates,
                     "index_size": loc.index_size, "index_ttl_s": int(loc.index_ttl_s),
                     "max_imbalance": loc.max_imbalance, "lookahead": loc.lookahead,
                     "others": [b for b in loc.others if b != backend],
                     "fits": {b: _takes(f) for b, f in loc.fits.items() if b != backend}},
        "range": {"min": span.min_tokens, "max": span.max_tokens or 0},
        "block_tokens": TOKENS_PER_BLOCK, "backfill_s": fit.backfill_s,
        **({"sessions": True} if sessions else {}),
        **({} if seen is None else {"seen": seen}),
        **({} if fit.adapters is None else {"adapters": sorted(fit.adapters)}),
    }


def session_keys(k: ModelKeys, klass: str, tenant: str, user: str) -> list[str]:
    """A user's session-level keys (sessions on), declared for Redis Cluster."""
    return [k.sessions(klass, tenant, user), k.session_saved(klass, tenant, user),
            k.user_queued(klass, tenant, user)]


def dispatch_keys(model: str, args: Mapping[str, Any] | None) -> list[str]:
    """The keys a dispatch decision touches, declared for Redis Cluster (all in the
    model's slot; the script derives them, and the queues and requests, from the prefix)."""
    if args is None:
        return []
    k, backend = ModelKeys(model), args["backend"]
    order = [c["name"] for c in args["classes"]]
    return ([k.backend_sent(backend), k.replicas, k.user_inflight, k.depth,
             k.backend_inflight(backend), k.backlogged_since, k.recent,
             k.backend_snapshot(backend), k.drained, k.backend_prefill(backend),
             k.backend_started(backend)]
            + [k.active(c) for c in order] + [k.saved(c) for c in order])


def grants_from(backend: str, found: Iterable[Mapping[str, Any]]) -> list[Grant]:
    """The grants of a decision (``dispatch_for``'s ``grants``, each a named map)."""
    return [Grant(g["id"], g["class"], g["user"], int(g["rank"]), g["owner"], backend,
                  float(g["enqueued_at"]), int(g["held"]), int(g["blocks"]), g["reason"],
                  charged_prompt=int(g["charged"]))
            for g in found]


def backlogged_from(since: Mapping[str, Any]) -> dict[str, float]:
    return {str(c): float(at) for c, at in since.items()}


def dispatched_from(backend: str, raw: Mapping[str, Any],
                    picture: Mapping[str, Any] | None = None) -> Dispatched:
    """What ``dispatch_for`` returned (its named map) for ``backend``; ``picture``: the
    map holding depth, backlogged and recent, when not ``raw`` itself (dispatch.lua)."""
    seen = raw if picture is None else picture
    # an empty Lua table is encoded as an empty JSON object, whatever it held
    return Dispatched(grants_from(backend, raw["grants"] or ()), int(seen["depth"]),
                      backlogged_from(seen["backlogged"] or {}),
                      [str(c) for c in seen["recent"] or ()], backend, bool(raw["stale"]))

