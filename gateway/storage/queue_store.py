"""The queue: enqueue, dispatch, start, settle, cancel, and releasing what dead replicas
held or forgetting idle end users. Each verb is one script call (``lua/``), atomic.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, cast

import redis.asyncio as aioredis

from gateway.core.settings import is_end_user
from gateway.storage.dispatch_call import (
    dispatch_args,
    dispatch_keys,
    dispatched_from,
    leave_keys,
    session_keys,
    start_keys,
    starts_arg,
)
from gateway.storage.keys import ModelKeys
from gateway.storage.records import (
    GRANT_PICKUP_S,
    BackendFit,
    Dispatched,
    Grant,
    Locality,
    QueuedRequest,
    Start,
)
from gateway.storage.scripts import Scripts
from gateway.storage.values import UsageCounts
from policies.classes import CLASS_ORDER
from policies.gates import Gate


class QueueStore:
    """The queue verbs over one Redis client (``decode_responses=True``)."""

    def __init__(self, client: aioredis.Redis, request_ttl_s: Callable[[], float],
                 fleet: Sequence[str] = ()) -> None:
        self.client = client
        # how long a request's hash lives, read at each enqueue (the settings in force)
        self._request_ttl_s = request_ttl_s
        # fairness_scope fleet: the models whose fair-share counters are one (a charge on
        # one of them counts on the others too, ``spread`` in lua/_lib.lua); () per model
        self.fleet = tuple(fleet)
        self._scripts = Scripts(client, ("enqueue", "dispatch", "settle", "cancel", "reap",
                                         "started", "forget"))

    @property
    def request_ttl_s(self) -> float:
        return self._request_ttl_s()

    def _others(self, model: str) -> list[str]:
        """The key prefixes of the fleet's other models (fleet scope; [] per model)."""
        if model not in self.fleet:
            return []
        return [ModelKeys(m).prefix for m in self.fleet if m != model]

    def _spread(self, model: str, args: Mapping[str, Any] | None
                ) -> Mapping[str, Any] | None:
        """Dispatch arguments whose charges also count on the fleet's other models."""
        others = self._others(model)
        return args if args is None or not others else {**args, "fleet": others}

    async def enqueue(self, model: str, req: QueuedRequest, max_queued: int) -> int:
        """Queue length after the push, or -1 when the user's cap is reached."""
        positions, _ = await self.enqueue_many(model, [req], max_queued)
        return positions[0]

    async def enqueue_many(self, model: str, reqs: Sequence[QueuedRequest], max_queued: int,
                           then: Mapping[str, Any] | None = None,
                           starts: Sequence[Start] = (), requeue: bool = False
                           ) -> tuple[list[int], Dispatched | None]:
        """Queue a tick's requests in one call (each: its queue length after the push, or
        -1 when its user's cap is reached) and, with ``then`` (:func:`dispatch_args`),
        dispatch to that backend in the same call. ``starts`` are marked first.
        ``requeue``: requests queued again after a failover, with their first arrival
        time; each goes in only if the store forgot it (0 when it did not), past the cap."""
        k = ModelKeys(model)
        keys = [k.depth, k.backlogged_since, k.replicas]
        requests = []
        for req in reqs:
            tenant = req.tenant_name
            keys += [k.queue(req.klass, req.user, tenant, req.session),
                     k.request(req.request_id), k.active(req.klass), k.saved(req.klass),
                     k.users(req.klass, tenant), k.user_saved(req.klass, tenant),
                     k.user_floor(req.klass)]
            if req.session is not None:
                keys += session_keys(k, req.klass, tenant, req.user)
            if is_end_user(req.user):
                keys.append(k.seen)
            if req.leaves is not None:
                keys += leave_keys(k, *req.leaves)
            # numbers kept as text where the script stores them as given
            requests.append({
                "id": req.request_id, "user": req.user, "class": req.klass,
                "tenant": tenant, "owner": req.owner, "cost": repr(float(req.cost)),
                "tcost": repr(float(req.tenant_charge)), "now": repr(req.enqueued_at),
                "chain": " ".join(req.prefix),
                "deadline": "" if req.deadline_at is None else repr(req.deadline_at),
                "ptok": int(req.prompt_tokens), **({"whole": True} if req.whole else {}),
                **({"hit": repr(float(req.credit)), "thit": repr(float(req.tenant_hit))}
                   if req.prefix and (req.credit or req.tenant_hit) else {}),
                **({"adapter": req.adapter} if req.adapter else {}),
                **({"seen": True} if is_end_user(req.user) else {}),
                **({"session": req.session} if req.session is not None else {}),
                **({"requeue": True} if requeue else {}),
                **({"leaves": {"id": req.leaves[0], "backend": req.leaves[1]}}
                   if req.leaves is not None else {})})
        args: dict[str, Any] = {"prefix": k.prefix, "max_queued": max_queued,
                                "ttl": int(self.request_ttl_s), "requests": requests}
        if starts:
            args["starts"] = starts_arg(starts)
        if then is not None:
            args["dispatch"] = self._spread(model, then)
        keys += start_keys(model, starts) + dispatch_keys(model, then)
        out = await self._scripts.call("enqueue", list(dict.fromkeys(keys)), args)
        return ([int(p) for p in out["positions"] or ()],
                dispatched_from(then["backend"], out["dispatched"]) if then is not None
                else None)

    async def dispatch(
        self, model: str, backend: str, limits: Mapping[str, int | Gate], replica: str,
        now: float, replica_ttl_s: float, order: Sequence[str] = CLASS_ORDER,
        recent_window: int = 100, max_grants: int = 1, grant_pickup_s: float = GRANT_PICKUP_S,
        locality: Locality | None = None, fit: BackendFit | None = None,
        sessions: bool = False,
    ) -> tuple[list[Grant], int]:
        """Atomically pop the fairest requests (at most ``max_grants``) a backend's open
        gates admit, trying the classes in ``order`` with the given per-class limits: the
        least-served tenant's least-served user's oldest request (two levels,
        ``policies/fairness.py``). With ``locality``, among the users within its slack of
        the smallest score at both levels (``policies/locality.py`` within_slack) the one
        whose head prompt is best cached on the backend goes first, and the backend's
        prefix index records what it was sent (``policies/locality.py``). With ``fit``,
        only requests its prompt range takes are considered, and a class dispatches only
        while its prefill-token gate admits the next request (``policies/prefill.py``).
        ``limits`` holds each class's gate (``policies/gates.py`` Gate.admits), or just
        its burst limit.
        Returns the grants and how many requests are still queued for the model."""
        [done] = await self.dispatch_with(model, [dispatch_args(
            model, backend, limits, replica, now, replica_ttl_s, order, recent_window,
            max_grants, grant_pickup_s, locality, fit, sessions)])
        return done.grants, done.depth

    async def dispatch_with(self, model: str, each: Sequence[Mapping[str, Any]],
                            starts: Sequence[Start] = (), until_grant: bool = False
                            ) -> list[Dispatched]:
        """:meth:`dispatch` for several backends in one call, from each one's arguments
        (:func:`dispatch_args`) in the order given, until nothing is queued for the model
        (with ``until_grant``: or after the first backend that granted); ``starts`` are
        marked first. One :class:`Dispatched` per backend tried, in order (each with the
        depth and class service picture after the last decision)."""
        keys = start_keys(model, starts)
        for args in each:
            keys += dispatch_keys(model, args)
        call: dict[str, Any] = {"prefix": ModelKeys(model).prefix,
                                "each": [self._spread(model, args) or args for args in each],
                                "until_grant": until_grant}
        if starts:
            call["starts"] = starts_arg(starts)
        out = await self._scripts.call("dispatch", list(dict.fromkeys(keys)), call)
        return [dispatched_from(args["backend"], decided, out)
                for args, decided in zip(each, out["decided"] or (), strict=False)]

    async def mark_started(self, model: str, grant: Grant, now: float | None = None,
                           then: Mapping[str, Any] | None = None,
                           held: Sequence[Start] = ()) -> Dispatched | None:
        """The backend is running this request (since ``now``, default the clock): it no
        longer counts as waiting there, and took one of the batch's free slots; the
        ``held`` starts of other requests are marked in the same call. With ``then``
        (:func:`dispatch_args` for its backend), a gate slot that frees grants the
        backend's next requests in the same call: what that decision returned (None when
        no slot freed)."""
        starts = [*held, Start(grant.request_id, grant.backend,
                               time.time() if now is None else now)]
        args: dict[str, Any] = {"prefix": ModelKeys(model).prefix, "starts": starts_arg(starts)}
        if then is not None:
            args["dispatch"] = self._spread(model, then)
        keys = start_keys(model, starts) + dispatch_keys(model, then)
        out = await self._scripts.call("started", list(dict.fromkeys(keys)), args)
        return dispatched_from(grant.backend, out["dispatched"]) if "dispatched" in out else None

    async def mark_starts(self, model: str, starts: Sequence[Start]) -> None:
        """Marks starts a replica held back (``lua/started.lua``), on their own."""
        args = {"prefix": ModelKeys(model).prefix, "starts": starts_arg(starts)}
        await self._scripts.call("started", list(dict.fromkeys(start_keys(model, starts))), args)

    async def settle(self, model: str, grant: Grant, charge: float,
                     tenant_charge: float | None = None) -> bool:
        """Release a dispatched request: ``charge`` is added to its user's score in its
        tenant, ``tenant_charge`` (None: ``charge``) to its tenant's (the request's, kept
        in its hash). False when it had been released already."""
        released, _ = await self.settle_and_dispatch(model, grant, charge, tenant_charge)
        return released

    async def settle_and_dispatch(
        self, model: str, grant: Grant, charge: float, tenant_charge: float | None = None,
        usage: UsageCounts | None = None, then: Mapping[str, Any] | None = None,
        starts: Sequence[Start] = (), now: float | None = None,
    ) -> tuple[bool, Dispatched | None]:
        """:meth:`settle`, adding ``usage`` to its day's usage hash
        (``gateway/scheduling/usage.py``),
        and with ``then`` (:func:`dispatch_args` for its backend) the freed slot grants
        the backend's next requests in the same call: (released, what that returned).
        ``starts`` (the request's own among them, perhaps) are marked first. A trusted
        key's end user is seen at ``now`` (default the clock; :meth:`forget_idle`)."""
        k = ModelKeys(model)
        keys = [k.user_inflight, k.backend_inflight(grant.backend), k.active(grant.klass),
                k.saved(grant.klass), k.request(grant.request_id), k.backend_sent(grant.backend),
                k.backend_snapshot(grant.backend), k.backend_prefill(grant.backend),
                k.backend_started(grant.backend)]
        args: dict[str, Any] = {
            "prefix": k.prefix, "id": grant.request_id, "user": grant.user,
            "backend": grant.backend, "charge": charge,
            "tcharge": charge if tenant_charge is None else tenant_charge}
        if others := self._others(model):
            args["fleet"] = others
        if usage is not None:
            keys.append(usage.key)
            args["usage"] = {"key": usage.key, "ttl": usage.ttl_s, "counts": usage.counts}
        if is_end_user(grant.user):
            keys.append(k.seen)
            args["seen"] = time.time() if now is None else now
        if starts:
            args["starts"] = starts_arg(starts)
        if then is not None:
            args["dispatch"] = self._spread(model, then)
        keys += start_keys(model, starts) + dispatch_keys(model, then)
        out = await self._scripts.call("settle", list(dict.fromkeys(keys)), args)
        return bool(out["released"]), (dispatched_from(grant.backend, out["dispatched"])
                                        if "dispatched" in out else None)

    async def cancel(self, model: str, request_id: str, user: str, klass: str,
                     tenant: str | None = None, session: str | None = None) -> bool:
        """Take a queued request out of its user's queue in ``tenant`` (None: the tenant
        and session its hash names, else the user's own), with sessions on its
        ``session``'s queue."""
        k = ModelKeys(model)
        if tenant is None:
            found, session = await cast("Awaitable[list[str | None]]", self.client.hmget(
                k.request(request_id), ["tenant", "session"]))
            tenant = found or user
        keys = [k.queue(klass, user, tenant, session), k.active(klass), k.saved(klass),
                k.request(request_id), k.depth, k.backlogged_since, k.users(klass, tenant),
                k.user_saved(klass, tenant), k.user_floor(klass)]
        args = {"prefix": k.prefix, "id": request_id, "user": user, "class": klass,
                "tenant": tenant}
        if session is not None:
            keys += session_keys(k, klass, tenant, user)
            args["session"] = session
        return bool((await self._scripts.call("cancel", keys, args))["released"])

    async def reap(self, model: str, now: float, replica_ttl_s: float,
                   grant_pickup_s: float = GRANT_PICKUP_S) -> int:
        """Release what dead replicas held (silent for ``replica_ttl_s``, or leaving a
        grant unread for ``grant_pickup_s``); returns the count."""
        k = ModelKeys(model)
        out = await self._scripts.call("reap", [k.replicas, k.user_inflight], {
            "prefix": k.prefix, "now": now, "replica_ttl_s": replica_ttl_s,
            "grant_pickup_s": grant_pickup_s})
        return int(out["released"])

    async def forget_idle(self, model: str, now: float, idle_s: float, limit: int,
                          classes: Sequence[str] = CLASS_ORDER) -> tuple[int, int]:
        """Forget the trusted keys' end users of ``model`` last seen (enqueued or
        settled) ``idle_s`` or longer before ``now``, at most ``limit`` of them, the
        longest idle first (``lua/forget.lua``): (forgotten, kept because a request of
        theirs is queued or in flight, seen again at ``now``)."""
        k = ModelKeys(model)
        keys = [k.seen, k.user_inflight, k.service, k.service_who,
                *(k.saved(c) for c in classes), *(k.user_floor(c) for c in classes)]
        out = await self._scripts.call("forget", keys, {
            "prefix": k.prefix, "now": now, "idle": idle_s, "limit": limit,
            "classes": list(classes)})
        return int(out["forgotten"]), int(out["kept"])
