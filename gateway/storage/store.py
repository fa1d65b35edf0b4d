"""The Redis store: fairgate's queue verbs, each one atomic (a Lua script) where it
changes shared state, and the reads operators need. Keys come from ``gateway/storage/keys.py``;
Redis errors arrive already mapped by the client (``gateway/storage/redis_client.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, NamedTuple, cast

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from gateway.core.errors import StoreUnavailable
from gateway.core.settings import is_end_user
from gateway.storage.keys import HISTORY_INDEX, ModelKeys, history_key, lua_prelude
from gateway.storage.values import GRANT, PREEMPT, PREFILL, UsageCounts, lua_values
from policies.classes import CLASS_ORDER
from policies.fairness import predicted_cost
from policies.gates import BackendSnapshot, Gate
from policies.prefill import TOKENS_PER_BLOCK, PromptRange
from policies.share_ratio import Account


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    request_id: str
    user: str
    klass: str
    owner: str
    cost: float  # the fairness policy's dispatch cost, at the user level
    enqueued_at: float
    prefix: tuple[str, ...] = ()  # the prompt's block-hash chain (policies/locality.py)
    tenant: str = ""  # "": the tenant named after the user
    tenant_cost: float | None = None  # the dispatch cost at the tenant level (None: cost)
    deadline_at: float | None = None  # first-token deadline (unix s): EDF in its user's queue
    prompt_tokens: int = 0  # estimated: where it fits, and the prefill-token gate
    whole: bool = False  # a whole answer (not streamed): it never reports a first token
    session: str | None = None  # sessions on: its session ("" the user's default); None: off
    adapter: str | None = None  # the LoRA adapter it names: only backends having it take it
    # taken off cost (tenant_cost) per prompt token the backend's prefix index predicts
    # cached (the policy's cached_credit; kept only with a prefix chain)
    credit: float = 0.0
    tenant_credit: float | None = None  # None: credit
    # a continuation: the (request id, backend) of the segment it continues, which leaves
    # that backend as it is queued (leave_inflight in lua/lib/inflight.lua)
    leaves: tuple[str, str] | None = None

    @property
    def tenant_name(self) -> str:
        return self.tenant or self.user

    @property
    def tenant_charge(self) -> float:
        return self.cost if self.tenant_cost is None else self.tenant_cost

    @property
    def tenant_hit(self) -> float:
        return self.credit if self.tenant_credit is None else self.tenant_credit

    def charged(self, charged_prompt: int | None) -> tuple[float, float]:
        """(user-level, tenant-level) dispatch cost charged when its grant charged
        ``charged_prompt`` prompt tokens (None: the whole estimate)."""
        if charged_prompt is None or not self.prefix:
            return self.cost, self.tenant_charge
        return (predicted_cost(self.cost, self.credit, self.prompt_tokens, charged_prompt),
                predicted_cost(self.tenant_charge, self.tenant_hit, self.prompt_tokens,
                               charged_prompt))


@dataclass(frozen=True, slots=True)
class Who:
    """A user's tenant ("": its own) and weights, as the share ratio reads them (the
    ``service:who`` hash, a JSON array per user)."""

    tenant: str = ""
    weight: float = 1.0
    tenant_weight: float = 1.0

    def encode(self) -> str:
        return json.dumps([self.tenant, self.weight, self.tenant_weight])

    @classmethod
    def decode(cls, text: str | None) -> Who:
        """An entry; a missing or unreadable one (a user served by an older replica)
        reads as weight 1 in its own tenant."""
        try:
            tenant, weight, tenant_weight = json.loads(text or "")
            return cls(str(tenant), float(weight), float(tenant_weight))
        except (ValueError, TypeError):
            return cls()


@dataclass(frozen=True, slots=True)
class Grant:
    request_id: str
    klass: str
    user: str
    rank: int
    owner: str
    backend: str
    enqueued_at: float
    # known where it was dispatched (dispatch.lua), not on a grant read back from Redis:
    matched_blocks: int = 0  # leading blocks of its chain the backend's prefix index held
    prompt_blocks: int = 0  # blocks of its chain (0: no index, routing least_loaded)
    reason: str = "load"  # why it went there: policies.locality.DISPATCH_REASONS
    local: bool = False  # granted by this replica alone while the store was unreachable
    # the prompt tokens its dispatch cost charged (predicted uncached there); None: the
    # whole estimate (granted by this replica alone)
    charged_prompt: int | None = None


@dataclass(frozen=True, slots=True)
class Start:
    """A request's first token on ``backend`` at ``at`` (unix s), as the scripts mark it
    (``start_each`` in ``lua/lib/inflight.lua``)."""

    request_id: str
    backend: str
    at: float


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


def _starts(starts: Sequence[Start]) -> list[dict[str, Any]]:
    return [{"id": s.request_id, "backend": s.backend, "at": s.at} for s in starts]


@dataclass(frozen=True, slots=True)
class Locality:
    """Locality-aware dispatch (``routing: locality``): the fairness slack (service
    units), how many users within it are compared, the bounds of each backend's prefix
    index (block hashes kept, seconds an unused hash lives), and the bounded-load
    affinity (the model's backends, the in-flight imbalance a request waits out)."""

    slack: float
    candidates: int
    index_size: int
    index_ttl_s: float
    max_imbalance: int = 0  # a head whose prefix another backend holds waits for it unless
    others: tuple[str, ...] = ()  # that one has more in flight than this one + this
    lookahead: int = 4  # requests of each user's queue compared (its oldest first)
    # what each of the others takes (its prompt range, its adapters): a request is never
    # left to one that does not take it (one not listed takes any)
    fits: Mapping[str, BackendFit] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BackendFit:
    """What one backend takes, for dispatch.lua (``policies/prefill.py``): its prompt
    range and each class's prefill-token limit (0: none)."""

    prompt_range: PromptRange = field(default_factory=PromptRange)
    prefill_limits: Mapping[str, int] = field(default_factory=dict)
    backfill_s: float = 0.0  # smaller requests may pass one the gate holds this long
    # the LoRA adapters it has (docs/adapters.md); None: its model has none anywhere, so
    # no request names one
    adapters: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class BackendState:
    snapshot: BackendSnapshot | None
    sent_since_snapshot: int
    inflight: int
    unseen: int  # on the way at the snapshot, not yet registered by the server
    pending_prefill_tokens: int = 0  # dispatched, maybe not yet scheduled (uncached tokens)
    started_since_snapshot: int = 0  # first token since the snapshot: in a slot it saw free


class Stored(NamedTuple):
    """What storing a snapshot did (``lua/snapshot.lua``)."""

    stored: bool  # False: an equal or newer snapshot was there
    drained: bool  # an operator drained the backend
    pending: int  # its pending prefill tokens after the trim (0 when not stored)
    version: str  # the snapshot hash's version after it ("0" when not stored)


@dataclass(frozen=True, slots=True)
class LeaseWish:
    """A backend's scrape lease as one process wants it: held (taken or renewed) or given
    up, and the version of its published snapshot the process read last."""

    backend: str
    want: bool
    seen: str = ""


@dataclass(frozen=True, slots=True)
class ScrapeView:
    """One backend as ``lua/scrapers.lua`` saw it for one process."""

    held: bool  # this process holds the scrape lease now
    drained: bool
    inflight: int  # dispatched, unsettled requests at it (all replicas)
    pending_prefill_tokens: int
    published: dict[str, str] | None  # the snapshot hash, when changed since ``seen``
    dispatches: int = 0  # requests ever dispatched to it, by every replica


def _gate(limit: int | Gate) -> Gate:
    return limit if isinstance(limit, Gate) else Gate(limit)


# A replica's grant listener waits on its grant list all the time: a grant unread this long
# means the replica died (scripts: replica_alive in gateway/storage/lua/_lib.lua).
GRANT_PICKUP_S = 2.0


# The library modules (``lua/lib/``), each after the ones it uses.
LIBRARY = ("inflight", "replicas", "pools", "locality", "fairness", "dispatch")


def load_library() -> str:
    """What every script starts with: the generated key functions and value readers
    (``gateway/storage/keys.py``, ``gateway/storage/values.py``), the shared helpers
    (``lua/_lib.lua``)
    and the library modules (``lua/lib/``, :data:`LIBRARY`: the parts of the dispatch
    decision, the in-flight state, the replicas)."""
    lua = resources.files("gateway.storage") / "lua"
    found = {f.name.removesuffix(".lua") for f in (lua / "lib").iterdir()
             if f.name.endswith(".lua")}
    if found != set(LIBRARY):
        raise RuntimeError(f"lua/lib/ holds {sorted(found)}, LIBRARY lists {list(LIBRARY)}")
    return (lua_prelude() + lua_values() + (lua / "_lib.lua").read_text()
            + "".join((lua / "lib" / f"{name}.lua").read_text() for name in LIBRARY))


def load_script(name: str) -> str:
    """A script's text, after :func:`load_library`."""
    return load_library() + (resources.files("gateway.storage") / "lua" / f"{name}.lua").read_text()


@dataclass(frozen=True, slots=True)
class Preempt:
    """An order to preempt a running stream: its segment's id (a continuation's, or the
    original's), the original request's id, the backend it runs on."""

    request_id: str
    original: str
    backend: str


@dataclass(frozen=True, slots=True)
class PreemptView:
    """What ``lua/preempt_view.lua`` read: each backlogged class's next request, and the
    dispatched requests of the live replicas (plain dicts, its JSON)."""

    queued: list[dict[str, Any]]
    inflight: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Dispatched:
    """What a dispatch decision (``dispatch_for`` in ``lua/lib/dispatch.lua``) returned,
    whichever script ran it: the grants, the requests still queued for the model, and the
    class service picture ``policies/starvation.py`` reads."""

    grants: list[Grant]
    depth: int
    backlogged_since: dict[str, float]
    recent: list[str]
    backend: str = ""  # the backend decided for
    # the decision's gates came from a snapshot older than the one before the stored one:
    # it admitted nothing (its process is behind the backend's snapshots)
    stale_view: bool = False


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
    min_share: Sequence[tuple[str, float]] = (),
) -> dict[str, Any]:
    """The named arguments of one dispatch decision for ``backend`` (see
    :meth:`Store.dispatch`), as ``dispatch_for`` in ``lua/lib/dispatch.lua`` reads them.
    ``sessions``: each user's requests come from its least-served session (the third
    level, ``policies/fairness.py``). ``seen``: the taken_at of the snapshot ``limits``
    come from (None: the stored one), so that they count what was sent since it
    (``gate_counts`` in ``lua/_lib.lua``). ``min_share``: the tenants' guaranteed shares,
    (tenant, share) by name, of the last ``recent_window`` dispatches
    (``policies/fairness.py`` owed_tenant)."""
    fit = fit or BackendFit()
    loc = locality or Locality(0.0, 0, 0, 0.0)
    span = fit.prompt_range
    gates = {c: _gate(limits.get(c, 0)) for c in order}
    return {
        "now": now, "replica_ttl": replica_ttl_s, "prefix": ModelKeys(model).prefix,
        "replica": replica, "backend": backend, "recent_kept": recent_window,
        "want": max_grants, "pickup": grant_pickup_s,
        "classes": [{"name": c, "limit": g.limit if g.reason is None else 0,
                     "prefill_limit": fit.prefill_limits.get(c, 0),
                     "free_slots": g.free_slots,
                     "max_inflight": g.max_inflight if g.reason is None else 0}
                    for c, g in gates.items()],
        "locality": {"slack": loc.slack, "compared": loc.candidates,
                     "index_size": loc.index_size, "index_ttl": int(loc.index_ttl_s),
                     "max_imbalance": loc.max_imbalance, "lookahead": loc.lookahead,
                     "others": [b for b in loc.others if b != backend],
                     "fits": {b: _takes(f) for b, f in loc.fits.items() if b != backend}},
        "range": {"min": span.min_tokens, "max": span.max_tokens or 0},
        "block_tokens": TOKENS_PER_BLOCK, "backfill_s": fit.backfill_s,
        **({"sessions": True} if sessions else {}),
        **({} if seen is None else {"seen": seen}),
        **({} if fit.adapters is None else {"adapters": sorted(fit.adapters)}),
        **({"min_share": {"window": recent_window, "tenants": [
            {"tenant": t, "share": s} for t, s in sorted(min_share)]}} if min_share else {}),
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
             k.backend_inflight(backend), k.backlogged_since, k.recent, k.recent_tenants,
             k.backend_snapshot(backend), k.drained, k.backend_prefill(backend),
             k.backend_started(backend)]
            + [k.active(c) for c in order] + [k.saved(c) for c in order])


def _grants(backend: str, found: Sequence[Any], decisions: Sequence[Any]) -> list[Grant]:
    return [Grant(rid, klass, user, int(rank), owner, backend, float(enqueued_at),
                  int(held), int(blocks), reason, charged_prompt=int(charged))
            for (rid, klass, user, rank, owner, enqueued_at, charged), (held, blocks, reason)
            in zip(found, decisions, strict=True)]


def _backlogged(since: Sequence[Any]) -> dict[str, float]:
    return {str(since[i]): float(since[i + 1]) for i in range(0, len(since), 2)}


def _dispatched(backend: str, raw: Sequence[Any]) -> Dispatched:
    found, depth, decisions, since, recent, stale = raw
    return Dispatched(_grants(backend, found, decisions), int(depth), _backlogged(since),
                      [str(c) for c in recent], backend, bool(stale))


@dataclass(frozen=True, slots=True)
class QueuedUser:
    klass: str
    user: str
    score: float
    queued: int
    oldest_request_id: str | None
    oldest_enqueued_at: float | None
    tenant: str = ""  # "": the tenant named after the user (score: the tenant's)


@dataclass(frozen=True, slots=True)
class QueuedSample:
    """One queued request as the pools' demand reads it (``gateway/ops/pools.py``)."""

    klass: str
    prompt_tokens: int  # estimated
    enqueued_at: float
    deadline_at: float | None  # its first-token deadline (unix s), if it has one


class Store:
    """Domain verbs over one Redis client (``decode_responses=True``)."""

    def __init__(self, client: aioredis.Redis, request_ttl_s: float,
                 fleet: Sequence[str] = ()) -> None:
        self.client = client
        self.request_ttl_s = request_ttl_s
        # fairness_scope fleet: the models whose fair-share counters are one (a charge on
        # one of them counts on the others too, ``spread`` in lua/_lib.lua); () per model
        self.fleet = tuple(fleet)
        self._scripts: dict[str, AsyncScript] = {
            name: client.register_script(load_script(name))
            for name in ("enqueue", "dispatch", "settle", "cancel", "snapshot", "reap",
                         "started", "share", "scrapers", "history", "preempt_view",
                         "preempt", "forget")
        }

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

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run a script. redis-py loads a script the server lacks once, then runs it again;
        a Redis that restarts in between (its script cache empty again) answers that second
        run with NOSCRIPT too: load once more, then call it unavailable (a script that
        answers NOSCRIPT did not run, so running it again is safe)."""
        script = self._scripts[name]
        try:
            return await script(keys=list(keys), args=list(args))
        except NoScriptError:
            pass
        try:
            return await script(keys=list(keys), args=list(args))
        except NoScriptError as exc:
            raise StoreUnavailable(f"script {name} not loaded: {exc}") from exc

    async def ping(self) -> bool:
        return bool(await cast("Awaitable[bool]", self.client.ping()))

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
            args["starts"] = _starts(starts)
        if then is not None:
            args["dispatch"] = self._spread(model, then)
        keys += start_keys(model, starts) + dispatch_keys(model, then)
        out = await self._run("enqueue", list(dict.fromkeys(keys)), [json.dumps(args)])
        return ([int(p) for p in out[0]],
                _dispatched(then["backend"], out[1]) if then is not None else None)

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
            call["starts"] = _starts(starts)
        decided, depth, since, recent = await self._run(
            "dispatch", list(dict.fromkeys(keys)), [json.dumps(call)])
        backlogged, classes = _backlogged(since), [str(c) for c in recent]
        return [Dispatched(_grants(args["backend"], found, decisions), int(depth), backlogged,
                           classes, args["backend"], bool(stale))
                for args, (found, decisions, stale) in zip(each, decided, strict=False)]

    async def class_service(self, model: str) -> tuple[dict[str, float], list[str]]:
        """(class → backlogged since, classes of the latest dispatches, newest first)."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(k.backlogged_since)
        pipe.lrange(k.recent, 0, -1)
        since, recent = await pipe.execute()
        return {c: float(t) for c, t in since.items()}, list(recent)

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
        args: dict[str, Any] = {"prefix": ModelKeys(model).prefix, "starts": _starts(starts)}
        if then is not None:
            args["dispatch"] = self._spread(model, then)
        keys = start_keys(model, starts) + dispatch_keys(model, then)
        out = await self._run("started", list(dict.fromkeys(keys)), [json.dumps(args)])
        return _dispatched(grant.backend, out[1]) if len(out) > 1 else None

    async def mark_starts(self, model: str, starts: Sequence[Start]) -> None:
        """Marks starts a replica held back (``lua/started.lua``), on their own."""
        args = {"prefix": ModelKeys(model).prefix, "starts": _starts(starts)}
        await self._run("started", list(dict.fromkeys(start_keys(model, starts))),
                        [json.dumps(args)])

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
            args["starts"] = _starts(starts)
        if then is not None:
            args["dispatch"] = self._spread(model, then)
        keys += start_keys(model, starts) + dispatch_keys(model, then)
        out = await self._run("settle", list(dict.fromkeys(keys)), [json.dumps(args)])
        return bool(out[0]), (_dispatched(grant.backend, out[1]) if len(out) > 1 else None)

    async def reap(self, model: str, now: float, replica_ttl_s: float,
                   grant_pickup_s: float = GRANT_PICKUP_S) -> int:
        """Release what dead replicas held (silent for ``replica_ttl_s``, or leaving a
        grant unread for ``grant_pickup_s``); returns the count."""
        k = ModelKeys(model)
        return int(await self._run("reap", [k.replicas, k.user_inflight],
                                   [now, replica_ttl_s, k.prefix, grant_pickup_s]))

    async def forget_idle(self, model: str, now: float, idle_s: float, limit: int,
                          classes: Sequence[str] = CLASS_ORDER) -> tuple[int, int]:
        """Forget the trusted keys' end users of ``model`` last seen (enqueued or
        settled) ``idle_s`` or longer before ``now``, at most ``limit`` of them, the
        longest idle first (``lua/forget.lua``): (forgotten, kept because a request of
        theirs is queued or in flight, seen again at ``now``)."""
        k = ModelKeys(model)
        keys = [k.seen, k.user_inflight, k.service, k.service_who,
                *(k.saved(c) for c in classes), *(k.user_floor(c) for c in classes)]
        forgotten, kept = await self._run("forget", keys, [json.dumps({
            "prefix": k.prefix, "now": now, "idle": idle_s, "limit": limit,
            "classes": list(classes)})])
        return int(forgotten), int(kept)

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
        args = [request_id, user, klass, tenant, k.prefix]
        if session is not None:
            keys += session_keys(k, klass, tenant, user)
            args.append(session)
        return bool(await self._run("cancel", keys, args))

    async def store_snapshot(self, model: str, backend: str, snap: BackendSnapshot,
                             shared: str = "") -> Stored:
        """Store a snapshot, with what its scraper publishes beside it (``shared``), unless
        a newer one is there."""
        k = ModelKeys(model)
        tpot = "" if snap.tpot_s is None else snap.tpot_s
        args = [snap.taken_at_s, snap.waiting, snap.running, snap.kv_usage, tpot, backend,
                k.prefix, shared]
        keys = [k.backend_snapshot(backend), k.backend_sent(backend), k.backend_inflight(backend),
                k.drained, k.backend_prefill(backend), k.backend_started(backend)]
        stored, drained, pending, version = await self._run("snapshot", keys, args)
        return Stored(bool(stored), bool(drained), int(pending), str(version))

    async def publish_failure(self, model: str, backend: str, failures: int) -> str:
        """Publish that the backend's last ``failures`` scrapes failed (its snapshot stays,
        closed by them); returns the snapshot hash's new version."""
        key = ModelKeys(model).backend_snapshot(backend)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, "failures", str(failures))
        pipe.hincrby(key, "v", 1)
        _, version = await pipe.execute()
        return str(version)

    async def scrape_leases(self, holder: str, ttl_s: float,
                            wanted: Mapping[str, Sequence[LeaseWish]]
                            ) -> dict[str, tuple[int, dict[str, ScrapeView]]]:
        """:meth:`scrape_lease` for every model of ``wanted`` (concurrently)."""
        models = [m for m, wishes in wanted.items() if wishes]
        found = await asyncio.gather(*(self.scrape_lease(holder, ttl_s, m, wanted[m])
                                       for m in models))
        return dict(zip(models, found, strict=True))

    async def scrape_lease(self, holder: str, ttl_s: float, model: str,
                           wishes: Sequence[LeaseWish]) -> tuple[int, dict[str, ScrapeView]]:
        """Take, renew or give up ``holder``'s scrape leases of ``model``'s backends
        (``lua/scrapers.lua``, one call), and read what each backend's scraper published
        since ``seen``: (requests queued for the model, backend -> its view)."""
        k = ModelKeys(model)
        keys = [key for w in wishes for key in (
            k.backend_scraper(w.backend), k.backend_snapshot(w.backend),
            k.backend_inflight(w.backend), k.backend_prefill(w.backend),
            k.backend_dispatches(w.backend))]
        arg = {"holder": holder, "ttl_ms": int(ttl_s * 1000), "backends": [
            {"name": w.backend, "want": w.want, "seen": w.seen} for w in wishes]}
        queued, rows = await self._run("scrapers", [*keys, k.depth, k.drained, k.scrapers],
                                       [json.dumps(arg)])
        return int(queued), {w.backend: ScrapeView(
            bool(held), bool(drained), int(inflight), int(pending),
            None if raw == 0 else dict(zip(raw[::2], raw[1::2], strict=True)), int(dispatches))
            for w, (held, drained, inflight, pending, raw, dispatches)
            in zip(wishes, rows, strict=True)}

    async def add_service(self, model: str, amounts: Mapping[str, float], now: float,
                          half_life_s: float, cap: int, ttl_s: float,
                          who: Mapping[str, Who] | None = None) -> int:
        """Add each user's service to the model's decayed shares (every replica's), and
        record who the users of ``who`` are; returns the number of users kept (at most
        ``cap``)."""
        k = ModelKeys(model)
        args = {"now": now, "half_life": half_life_s, "cap": cap, "ttl": int(ttl_s),
                "amounts": dict(amounts),
                "who": {user: w.encode() for user, w in (who or {}).items()}}
        return int(await self._run("share", [k.service, k.service_epoch, k.service_who],
                                   [json.dumps(args)]))

    async def service_shares(self, model: str) -> dict[str, float]:
        """Each user's share of the model's decayed service across replicas, largest
        first (at most the cap kept by ``add_service``)."""
        raw = await cast("Awaitable[list[tuple[str, float]]]", self.client.zrange(
            ModelKeys(model).service, 0, -1, desc=True, withscores=True))
        total = sum(score for _, score in raw)
        return {} if total <= 0 else {user: score / total for user, score in raw if score > 0}

    async def service_accounts(self, model: str) -> dict[str, Account]:
        """Each user's decayed service across replicas at weight 1 (its score times its
        key's weight), with its tenant and weights (``policies/share_ratio.py``); one
        round trip."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=False)
        pipe.zrange(k.service, 0, -1, withscores=True)
        pipe.hgetall(k.service_who)
        scores, entries = await pipe.execute()
        accounts = {}
        for user, score in scores:
            who = Who.decode(entries.get(user))
            accounts[str(user)] = Account(float(score) * who.weight, who.weight, who.tenant,
                                          who.tenant_weight)
        return accounts

    async def forget_prefixes(self, model: str, backend: str) -> None:
        """Drop a backend's prefix index (it restarted or went away: its cache is gone)."""
        await cast("Awaitable[int]", self.client.delete(ModelKeys(model).backend_prefixes(backend)))

    async def set_drained(self, model: str, backend: str, drained: bool,
                          migrate_at: float | None = None) -> None:
        """Drain (or undrain) a backend for every replica; with ``migrate_at`` (unix s)
        every process moves its running answers off the backend from then on. An undrain,
        or a drain without it, clears a pending migrate."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=True)
        if drained:
            pipe.sadd(k.drained, backend)
        else:
            pipe.srem(k.drained, backend)
        if drained and migrate_at is not None:
            pipe.hset(k.migrate, backend, repr(migrate_at))
        else:
            pipe.hdel(k.migrate, backend)
        await pipe.execute()

    # runtime LoRA loads (gateway/scheduling/adapter_loads.py): one process loads at a
    # time per model, the outcome of each adapter's last load is kept for the others

    async def lock_adapter_loads(self, model: str, holder: str, ttl_s: float) -> bool:
        """Take the model's adapter-load lease for ``holder`` (False: another holds it)."""
        return bool(await cast("Awaitable[bool | None]", self.client.set(
            ModelKeys(model).lora_loading, holder, nx=True, px=max(1, int(ttl_s * 1000)))))

    async def unlock_adapter_loads(self, model: str, holder: str) -> None:
        """Give the lease back, if ``holder`` still has it."""
        key = ModelKeys(model).lora_loading
        if await cast("Awaitable[str | None]", self.client.get(key)) == holder:
            await cast("Awaitable[int]", self.client.delete(key))

    async def adapter_load(self, model: str, adapter: str) -> dict[str, Any] | None:
        """The outcome of the adapter's last load ({backend} or {backend, error,
        status}), while it is kept."""
        raw = await cast("Awaitable[str | None]",
                         self.client.get(ModelKeys(model).lora_load(adapter)))
        if not raw:
            return None
        value = json.loads(raw)
        return value if isinstance(value, dict) else None

    async def record_adapter_load(self, model: str, adapter: str, outcome: Mapping[str, Any],
                                  keep_s: float, loaded_at: float | None = None,
                                  load_s: float = 0.0) -> None:
        """Keep a load's outcome ``keep_s``; a load that succeeded also records when
        (unix s) the adapter came to its backend and how long its load took."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=True)
        pipe.set(k.lora_load(adapter), json.dumps(dict(outcome)),
                 px=max(1, int(keep_s * 1000)))
        if loaded_at is not None:
            pipe.hset(k.backend_lora(str(outcome["backend"])), adapter,
                      f"{loaded_at!r} {load_s!r}")
        await pipe.execute()

    async def record_adapter_unload(self, model: str, backend: str, adapter: str) -> None:
        """The adapter left ``backend``: its load's outcome and time are forgotten."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(k.lora_load(adapter))
        pipe.hdel(k.backend_lora(backend), adapter)
        await pipe.execute()

    async def adapters_loaded_at(self, model: str, backends: Sequence[str]
                                 ) -> dict[str, dict[str, tuple[float, float | None]]]:
        """backend -> adapter -> (when (unix s) the gateway loaded it there, how long the
        load took (s; None: not recorded))."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=False)
        for name in backends:
            pipe.hgetall(k.backend_lora(name))
        raw = await pipe.execute()
        return {name: {str(a): _loaded_at(str(v)) for a, v in found.items()}
                for name, found in zip(backends, raw, strict=True)}

    async def publish_adapter_demand(self, model: str, replica: str,
                                     demand: Mapping[str, tuple[int, float, bool]],
                                     now: float) -> None:
        """This replica's requests waiting per adapter (count, oldest admission (unix s),
        whether it is loading the adapter), as of ``now``; none: its field is removed."""
        key = ModelKeys(model).lora_demand
        if demand:
            await cast("Awaitable[int]", self.client.hset(key, replica, json.dumps(
                {"at": now, "adapters": {a: list(d) for a, d in demand.items()}})))
        else:
            await cast("Awaitable[int]", self.client.hdel(key, replica))

    async def adapter_demand(self, model: str, fresh_after: float, skip: str = ""
                             ) -> dict[str, tuple[int, float, bool]]:
        """Requests waiting per adapter summed over the replicas (but ``skip``) that
        published after ``fresh_after`` (unix s): (count, oldest admission, whether one
        of them is loading it)."""
        raw = await cast("Awaitable[dict[str, str]]",
                         self.client.hgetall(ModelKeys(model).lora_demand))
        out: dict[str, tuple[int, float, bool]] = {}
        for replica, value in raw.items():
            entry = json.loads(value)
            if replica == skip or float(entry.get("at", 0.0)) < fresh_after:
                continue  # a replica gone (or stalled): its demand no longer counts
            for adapter, (count, since, loading) in entry.get("adapters", {}).items():
                had = out.get(adapter, (0, float("inf"), False))
                out[adapter] = (had[0] + int(count), min(had[1], float(since)),
                                had[2] or bool(loading))
        return out

    async def migrate_times(self, model: str) -> dict[str, float]:
        """Drained backends whose running answers move elsewhere, and from when (unix s)."""
        raw = await cast("Awaitable[dict[str, str]]",
                         self.client.hgetall(ModelKeys(model).migrate))
        return {str(name): float(at) for name, at in raw.items()}

    async def backend_states(self, model: str, backends: Sequence[str]) -> dict[str, BackendState]:
        """What Redis holds about each backend (snapshot, sent-since, in flight)."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=False)
        for name in backends:
            pipe.hgetall(k.backend_snapshot(name))
            pipe.zrange(k.backend_sent(name), 0, -1, withscores=True)
            pipe.get(k.backend_inflight(name))
            pipe.hvals(k.backend_prefill(name))
            pipe.zrange(k.backend_started(name), 0, -1, withscores=True)
        raw = await pipe.execute()
        states = {}
        for i, name in enumerate(backends):
            snap, sent, inflight, prefill, started = raw[5 * i: 5 * i + 5]
            # the sets also keep what came since the snapshot before (snapshot.lua)
            taken_at = float(snap.get("taken_at") or 0)
            states[name] = BackendState(snapshot_from(snap),
                                        sum(1 for _, at in sent if at > taken_at),
                                        int(inflight or 0),
                                        int(float(snap.get("unseen") or 0)),
                                        sum(int(float(PREFILL.decode(v)["tokens"]))
                                            for v in prefill),
                                        sum(1 for _, at in started if at > taken_at))
        return states

    async def heartbeat(self, models: Sequence[str], replica: str, now: float,
                        listened: Mapping[str, float] | None = None,
                        live_since: float | None = None) -> int:
        """Mark ``replica`` alive at ``now``; ``listened``: per model, when its grant
        listener last turned (a grant left unread is a dead replica only if that is old
        too, see ``replica_alive`` in ``lua/_lib.lua``). Returns how many replicas beat
        since ``live_since`` (of the first model; 1 without it or without models)."""
        pipe = self.client.pipeline(transaction=False)
        for model in models:
            k = ModelKeys(model)
            pipe.zadd(k.replicas, {replica: now})
            if listened and model in listened:
                pipe.hset(k.listened, replica, str(listened[model]))
        if models and live_since is not None:
            pipe.zcount(ModelKeys(models[0]).replicas, live_since, "+inf")
        replies = await pipe.execute()
        return max(1, int(replies[-1])) if models and live_since is not None else 1

    async def next_order(self, model: str, replica: str, timeout_s: float
                         ) -> tuple[str, str, int, int | None] | Preempt | None:
        """Block until a grant for one of this replica's requests, or an order to preempt
        one of its streams, arrives (or timeout)."""
        k = ModelKeys(model)
        item = await cast("Awaitable[list[str] | None]", self.client.blpop(
            [k.grants(replica), k.preempts(replica)], timeout=timeout_s))
        if item is None:
            return None
        if item[0] == k.preempts(replica):
            order = PREEMPT.decode(item[1])
            return Preempt(order["request_id"], order["original"], order["backend"])
        raw = item[1]
        if raw.count("\t") == len(GRANT.fields) - 2:  # pushed by an older replica
            raw += "\t"
        entry = GRANT.decode(raw)
        # the prompt tokens its dispatch charged (None: not said, the whole estimate)
        charged = int(entry["charged"]) if entry["charged"] else None
        return entry["request_id"], entry["backend"], int(entry["rank"]), charged

    async def preemption_view(self, model: str, classes: Sequence[str],
                              alive_after: float) -> PreemptView:
        """What a preemption decision reads (``lua/preempt_view.lua``)."""
        k = ModelKeys(model)
        raw = json.loads(await self._run("preempt_view", [k.replicas, k.depth], [json.dumps(
            {"prefix": k.prefix, "classes": list(classes), "alive_after": alive_after})]))
        return PreemptView([q for q in raw.get("queued") or [] if isinstance(q, dict)],
                           [r for r in raw.get("inflight") or [] if isinstance(r, dict)])

    async def order_preemption(self, model: str, order: Preempt, now: float,
                               max_preemptions: int, settle_s: float, hold_s: float) -> bool:
        """Order the replica that holds ``order``'s stream to preempt it
        (``lua/preempt.lua``); False when refused (see there)."""
        k = ModelKeys(model)
        return bool(await self._run("preempt", self._preempt_keys(k, order), [json.dumps({
            "prefix": k.prefix, "id": order.request_id, "original": order.original,
            "backend": order.backend, "now": now, "max": max_preemptions,
            "settle_s": settle_s, "hold_ms": max(1, round(hold_s * 1000))})]))

    async def preempt_refused(self, model: str, order: Preempt) -> None:
        """This replica could not move the stream ``order`` named: it is not ordered again,
        and the backend may preempt another at once."""
        k = ModelKeys(model)
        await self._run("preempt", self._preempt_keys(k, order),
                        [json.dumps({"refused": True})])

    @staticmethod
    def _preempt_keys(k: ModelKeys, order: Preempt) -> list[str]:
        return [k.request(order.request_id), k.request(order.original),
                k.backend_preempt(order.backend), k.backend_snapshot(order.backend)]

    async def held_by(self, model: str, replica: str) -> list[tuple[Grant, float]]:
        """The dispatched, unsettled requests whose client ``replica`` holds, by Redis,
        each with its dispatch time."""
        k = ModelKeys(model)
        ids = await cast("Awaitable[set[str]]", self.client.smembers(k.running(replica)))
        pipe = self.client.pipeline(transaction=False)
        for request_id in ids:
            pipe.hgetall(k.request(request_id))
        found = []
        for request_id, raw in zip(ids, await pipe.execute(), strict=True):
            if raw.get("state") == "dispatched":
                found.append((_grant(request_id, raw), float(raw.get("dispatched_at") or 0)))
        return found

    async def dispatched(self, model: str, request_id: str) -> Grant | None:
        """The grant of a dispatched, unsettled request, read back from Redis."""
        k = ModelKeys(model)
        raw = await cast("Awaitable[dict[str, str]]", self.client.hgetall(k.request(request_id)))
        if raw.get("state") != "dispatched":
            return None
        return _grant(request_id, raw)

    async def request_fields(self, model: str, request_id: str) -> dict[str, str]:
        """A queued or running request's hash (empty when there is none)."""
        return await cast("Awaitable[dict[str, str]]",
                          self.client.hgetall(ModelKeys(model).request(request_id)))

    async def queued_users(self, model: str, per_class: int) -> list[QueuedUser]:
        """The first ``per_class`` active users of each class, in the first ``per_class``
        active tenants, with their queue heads; each with its tenant's score."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=False)
        for klass in CLASS_ORDER:
            pipe.zrange(k.active(klass), 0, per_class - 1, withscores=True)
        actives = await pipe.execute()
        tenants = [(klass, str(tenant), float(score))
                   for klass, members in zip(CLASS_ORDER, actives, strict=True)
                   for tenant, score in members]
        pipe = self.client.pipeline(transaction=False)
        for klass, tenant, _ in tenants:
            pipe.zrange(k.users(klass, tenant), 0, per_class - 1)
        members = await pipe.execute()
        pairs = [(klass, str(user), score, tenant)
                 for (klass, tenant, score), users in zip(tenants, members, strict=True)
                 for user in users]
        pipe = self.client.pipeline(transaction=False)
        for klass, user, _, tenant in pairs:
            pipe.llen(k.queue(klass, user, tenant))
            pipe.lindex(k.queue(klass, user, tenant), 0)
        heads = await pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        for i in range(len(pairs)):
            pipe.hget(k.request(str(heads[2 * i + 1] or "")), "enqueued_at")
        enqueued = await pipe.execute()
        return [QueuedUser(klass, user, score, int(heads[2 * i]), heads[2 * i + 1],
                           float(enqueued[i]) if enqueued[i] else None,
                           "" if tenant == user else tenant)
                for i, (klass, user, score, tenant) in enumerate(pairs)]

    async def queued_sample(self, model: str, per_class: int) -> list[QueuedSample]:
        """Up to ``per_class`` queued requests of each class, spread over the queues of
        its first active tenants and users (a sample: the caller scales it to the
        class's depth)."""
        users = await self.queued_users(model, per_class)
        k = ModelKeys(model)
        per_user = {c: max(1, per_class // max(1, sum(u.klass == c for u in users)))
                    for c in CLASS_ORDER}
        pipe = self.client.pipeline(transaction=False)
        for u in users:
            pipe.lrange(k.queue(u.klass, u.user, u.tenant or u.user), 0, per_user[u.klass] - 1)
        queues = await pipe.execute()
        picked: list[tuple[str, str]] = []
        taken = dict.fromkeys(CLASS_ORDER, 0)
        for u, ids in zip(users, queues, strict=True):
            for request_id in ids[:per_class - taken[u.klass]]:
                picked.append((u.klass, str(request_id)))
            taken[u.klass] = min(per_class, taken[u.klass] + len(ids))
        pipe = self.client.pipeline(transaction=False)
        for _, request_id in picked:
            pipe.hmget(k.request(request_id), ["ptok", "enqueued_at", "deadline"])
        rows = await pipe.execute()
        return [QueuedSample(klass, int(float(ptok or 0)), float(at),
                             float(deadline) if deadline else None)
                for (klass, _), (ptok, at, deadline) in zip(picked, rows, strict=True)
                if at is not None]

    async def queue_place(self, model: str, klass: str, user: str,
                          request_id: str | None, tenant: str | None = None
                          ) -> tuple[float | None, int | None]:
        """(the score of the user's tenant among its class's active tenants, the request's
        index in its user's queue, or without ``request_id`` the queue's length); None when
        absent. For the wait estimate. ``tenant`` None: the request's (its hash), else the
        user's own."""
        k = ModelKeys(model)
        session = None
        if tenant is None and request_id is not None:
            tenant, session = await cast("Awaitable[list[str | None]]", self.client.hmget(
                k.request(request_id), ["tenant", "session"]))
        tenant = tenant or user
        pipe = self.client.pipeline(transaction=False)
        pipe.zscore(k.active(klass), tenant)
        if request_id is None:
            pipe.llen(k.queue(klass, user, tenant))
        else:  # its index in its session's queue, with sessions on
            pipe.lpos(k.queue(klass, user, tenant, session), request_id)
        score, index = await pipe.execute()
        return (None if score is None else float(score)), (None if index is None else int(index))

    async def request_exists(self, model: str, request_id: str) -> bool:
        return bool(await self.client.exists(ModelKeys(model).request(request_id)))

    async def depths(self, model: str) -> dict[str, int]:
        raw = await cast("Awaitable[dict[str, str]]", self.client.hgetall(ModelKeys(model).depth))
        return {c: int(raw.get(c, 0)) for c in CLASS_ORDER}

    async def add_history(self, start_ms: int, sums: Mapping[str, float],
                          maxima: Mapping[str, float], ttl_s: float) -> None:
        """Add one process's counts for the interval that began at ``start_ms`` (unix ms)
        to the dashboard history every process shares (``lua/history.lua``)."""
        await self._run("history", [history_key(start_ms), HISTORY_INDEX], [json.dumps(
            {"start": start_ms, "ttl": ttl_s, "sum": sums, "max": maxima})])

    async def history(self, since_ms: int) -> list[tuple[int, dict[str, float]]]:
        """The shared history's intervals that began at ``since_ms`` or later, oldest
        first: (start in unix ms, its fields)."""
        names = await cast("Awaitable[list[tuple[str, float]]]", self.client.zrangebyscore(
            HISTORY_INDEX, since_ms, "+inf", withscores=True))
        if not names:
            return []
        pipe = self.client.pipeline(transaction=False)
        for name, _ in names:
            pipe.hgetall(name)
        rows = await pipe.execute()
        return [(int(start), {f: float(v) for f, v in raw.items()})
                for (_, start), raw in zip(names, rows, strict=True) if raw]

    async def user_inflight(self, model: str) -> dict[str, int]:
        raw = await cast("Awaitable[dict[str, str]]",
                         self.client.hgetall(ModelKeys(model).user_inflight))
        return {u: int(v) for u, v in raw.items()}


def _grant(request_id: str, raw: Mapping[str, str]) -> Grant:
    charged = raw.get("ctok")
    return Grant(request_id, raw["class"], raw["user"], int(raw["rank"]), raw["owner"],
                 raw["backend"], float(raw["enqueued_at"]),
                 charged_prompt=None if charged is None else int(charged))


def snapshot_from(raw: Mapping[str, str]) -> BackendSnapshot | None:
    """A snapshot hash's numbers (None: no scrape of the backend ever succeeded)."""
    if "taken_at" not in raw:
        return None
    tpot = raw.get("tpot", "")
    return BackendSnapshot(
        waiting=int(float(raw["waiting"])),
        running=int(float(raw["running"])),
        kv_usage=float(raw["kv"]),
        tpot_s=float(tpot) if tpot else None,
        taken_at_s=float(raw["taken_at"]),
    )


def _loaded_at(value: str) -> tuple[float, float | None]:
    """A ``bk:<backend>:lora`` field: "loaded_at load_s" (or "loaded_at", as written
    before the load time was kept)."""
    parts = value.split()
    return float(parts[0]), (float(parts[1]) if len(parts) > 1 else None)
