"""Fairness among tenants and users of one (model, class) queue: what each request costs.

The Redis scripts (``gateway/storage/lua``) are a generic virtual-time engine: each active user
has a score, the smallest score is served next, a dispatch adds the request's
``dispatch_cost`` to its user's score, a settle adds ``settle_charge``, and a user who
becomes active is lifted to the smallest active score so it cannot bank credit while idle.
A policy only says what those costs are:

- :class:`RoundRobin`: per request, 1 / key weight at dispatch, nothing at settle.
  Backlogged users take turns (weighted by their keys).
- :class:`Vtc`: Virtual Token Counter (Sheng et al., OSDI 2024), on what the GPU
  computes: *uncached* prompt tokens × ``w_in`` plus output tokens × ``w_out``, divided by
  the key weight. At dispatch the prompt estimate less what the backend's prefix index
  predicts cached (:func:`predicted_cost`); at settle the output plus the correction of
  that prediction by what the backend reports (vLLM's ``cached_tokens``).

**Cache-aware cost.** A prompt prefix the backend holds in its prefix cache is not
computed again, so a policy charges only the uncached part (:meth:`FairnessPolicy.service`
is given the uncached prompt tokens). The dispatch cost is stored at enqueue for the whole
estimate, with the policy's :meth:`~FairnessPolicy.cached_credit` (what one predicted
cached prompt token takes off it); the dispatch decision (``lua/lib/dispatch.lua``), which
knows the backend, charges :func:`predicted_cost` with the uncached tokens the backend's
prefix index predicts (``policies/prefill.uncached_tokens``: the same count the prefill gate
adds), and the settle charges the rest: the policy's service of what the backend really
computed less what dispatch charged. Dispatch charge plus settle charge is the service
of the request, whatever the prediction was, so a user whose prompts are cached is
charged what its requests made the GPU compute, and the bounds below hold in that unit.
Optionally (``vtc_kv_weight`` > 0, off by default) VTC also charges at settle the KV cache
a request held, in token-seconds (``policies/cost.kv_token_seconds``): a long context
held for long costs more than its tokens; the bounds then count that term in the largest
request's service and in what in-flight requests leave to their settle.

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

Sessions, an optional third level (setting ``sessions``). Each request of a user belongs
to one of its sessions (a session key; none: the user's default session), and the users'
sessions with a queued request are ordered by session score as users are within a
tenant: a dispatch serves the least-served session of the chosen user, and charges the
session too, the user-level cost (VTC on the same cost as users, at equal weight within
the user). The tenant and user levels are untouched, so a user's share against other
users is the same whatever the number of its sessions; within a backlogged user, its
backlogged sessions share its service within the policy's bound, in user-weighted
service. A session that becomes active is lifted to the smallest active session score of
its user; a user left with nothing queued forgets its session scores (they only order its
own sessions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from policies.cost import TokenCost
from policies.locality import LocalityView, best_cached, within_slack
from policies.prefill import Pool


class FairnessPolicy(Protocol):
    @property
    def name(self) -> str: ...

    def dispatch_cost(self, prompt_tokens: int, weight: float) -> float:
        """Added to the user's score when the request is dispatched, for
        ``prompt_tokens`` prompt tokens to compute (none predicted cached)."""

    def cached_credit(self, weight: float) -> float:
        """What each prompt token predicted cached takes off the dispatch cost: for any
        ``cached`` ≤ ``p``, ``dispatch_cost(p - cached, w) == dispatch_cost(p, w) -
        cached * cached_credit(w)`` (the dispatch cost is affine in the prompt tokens:
        the scripts charge :func:`predicted_cost` without knowing the policy)."""

    def settle_charge(self, prompt_tokens: int, charged_prompt: int, output_tokens: int,
                      weight: float, kv_token_s: float = 0.0) -> float:
        """Added when it settles: real usage (``kv_token_s``: the KV cache it held,
        ``policies/cost.kv_token_seconds``), less what dispatch charged."""

    def service(self, prompt_tokens: int, output_tokens: int, weight: float,
                kv_token_s: float = 0.0) -> float:
        """Weighted service of one finished request, in the policy's unit."""

    def bound(self, max_request_service: float, in_flight: int,
              max_unsettled_service: float) -> float:
        """The policy's fairness bound for two backlogged users."""


@dataclass(frozen=True, slots=True)
class RoundRobin:
    name: str = "round_robin"

    def dispatch_cost(self, prompt_tokens: int, weight: float) -> float:
        return 1.0 / weight

    def cached_credit(self, weight: float) -> float:
        return 0.0

    def settle_charge(self, prompt_tokens: int, charged_prompt: int, output_tokens: int,
                      weight: float, kv_token_s: float = 0.0) -> float:
        return 0.0

    def service(self, prompt_tokens: int, output_tokens: int, weight: float,
                kv_token_s: float = 0.0) -> float:
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

    def cached_credit(self, weight: float) -> float:
        return self.cost.w_in / weight

    def settle_charge(self, prompt_tokens: int, charged_prompt: int, output_tokens: int,
                      weight: float, kv_token_s: float = 0.0) -> float:
        return self.cost.of(prompt_tokens - charged_prompt, output_tokens, weight, kv_token_s)

    def service(self, prompt_tokens: int, output_tokens: int, weight: float,
                kv_token_s: float = 0.0) -> float:
        return self.cost.of(prompt_tokens, output_tokens, weight, kv_token_s)

    def bound(self, max_request_service: float, in_flight: int,
              max_unsettled_service: float) -> float:
        # VTC's 2·U, plus the output of requests dispatched but not yet settled
        return 2 * max_request_service + in_flight * max_unsettled_service


def predicted_cost(cost: float, credit: float, prompt_tokens: int, uncached: int) -> float:
    """The dispatch cost charged for a request stored with ``cost`` (its whole estimate of
    ``prompt_tokens`` uncached) and ``credit`` (:meth:`FairnessPolicy.cached_credit`) when
    the backend's prefix index predicts ``uncached`` of them to compute: ``predicted_cost``
    in ``lua/_lib.lua``. Equal to the policy's dispatch cost of ``uncached`` tokens."""
    return cost - credit * max(0, prompt_tokens - uncached)


def charged_prompt(prompt_tokens: int, predicted_uncached: int | None) -> int:
    """The prompt tokens dispatch charged: what the backend's prefix index predicted
    uncached (None: not known where it was granted, the whole estimate)."""
    return prompt_tokens if predicted_uncached is None else predicted_uncached


def with_locality(bound: float, slack: float) -> float:
    """A policy's fairness bound when locality may serve users within ``slack`` of the
    least-served one first."""
    return bound + slack


def tenant_of(key_user: str, key_tenant: str | None, key_weight: float,
              tenants: Mapping[str, float]) -> tuple[str, float]:
    """(tenant, weight at the tenant level) of a request sent with a key of ``key_user``
    and ``key_weight`` naming ``key_tenant``, given the configured tenant weights; the
    request's user is the key's, or one of its trusted end users (``user/end_user``).

    A key naming a tenant: that tenant at its configured weight (1 when it is not
    listed). A key naming none: the tenant named after the key's user, at its configured
    weight if listed, else the key's weight, so without tenants every key's user is a
    tenant of one user weighing what it weighed before. A key's trusted end users are
    users of the key's tenant either way: an app minting a new end user per request
    shares its tenant's service among them, it does not take a tenant's share for each
    (a key's owner vouches for its end users, it cannot multiply its own share)."""
    if key_tenant:
        return key_tenant, tenants.get(key_tenant, 1.0)
    return key_user, tenants.get(key_user, key_weight)


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


RANGE_SCAN = 64
"""Users looked at, in fairness order, for a request a backend's prompt range (or a
backfill's room) takes when there is no slack."""


@dataclass(frozen=True, slots=True)
class Queued:
    """A queued request as the two-level engine sees it."""

    request_id: str
    cost: float  # added to its user's score at dispatch (the whole estimate uncached)
    tenant_cost: float  # added to its tenant's
    deadline: float | None = None  # first-token deadline (unix s): EDF in its user's queue
    prompt_tokens: int = 0  # estimated
    credit: float = 0.0  # taken off ``cost`` per prompt token predicted cached
    tenant_credit: float = 0.0  # and off ``tenant_cost``

    def charged(self, uncached: int | None) -> tuple[float, float]:
        """(user-level, tenant-level) dispatch cost when the backend's index predicts
        ``uncached`` prompt tokens to compute (None: not read, the whole estimate)."""
        if uncached is None:
            return self.cost, self.tenant_cost
        return (predicted_cost(self.cost, self.credit, self.prompt_tokens, uncached),
                predicted_cost(self.tenant_cost, self.tenant_credit, self.prompt_tokens,
                               uncached))


@dataclass(frozen=True, slots=True)
class Pick:
    """The request a dispatch serves: its tenant, user and id, and how many leading
    blocks of its prompt the backend's prefix index holds when locality compared it
    (None: strict fairness order, not read)."""

    tenant: str
    user: str
    request_id: str
    held_blocks: int | None = None
    session: str | None = None  # the user's session it came from (None: sessions off)


def edf_position(deadlines: Sequence[float | None], deadline: float | None) -> int:
    """Where a request with ``deadline`` joins its user's queue, given the deadlines of
    the requests already in it, in order: earliest deadline first. It goes ahead of the
    user's own requests with a later deadline or none (those keep their order), behind
    those with an earlier or equal one; without a deadline, at the end. So a queue is its
    deadline requests by deadline, then the rest in arrival order."""
    position = len(deadlines)
    if deadline is None:
        return position
    for i in range(len(deadlines) - 1, -1, -1):
        d = deadlines[i]
        if d is not None and d <= deadline:
            break
        position = i
    return position


@dataclass(slots=True)
class TwoLevel:
    """The two-level engine of ``gateway/storage/lua`` on plain data, for one class: enqueue
    (EDF within the user's queue, the per-user cap, each level joined at its minimum),
    the pick (``lua/lib/fairness.lua``: strict order, or the locality slack at both
    levels; only what the backend's prompt range and a backfill's room take), the charge
    at dispatch, settle and cancel. Ties go to the smaller name, as in a Redis zset.
    ``by_session``: sessions on, the third level (a user's request comes from its
    least-served session; requests enqueued with a session charge it)."""

    tenants: dict[str, float] = field(default_factory=dict)  # active tenant -> score
    saved_tenants: dict[str, float] = field(default_factory=dict)
    users: dict[str, dict[str, float]] = field(default_factory=dict)  # tenant -> active
    saved_users: dict[str, dict[str, float]] = field(default_factory=dict)
    floors: dict[str, float] = field(default_factory=dict)  # tenant -> last user's score
    queues: dict[tuple[str, str], list[Queued]] = field(default_factory=dict)
    issued: int = 0  # request ids made up for enqueues that name none
    by_session: bool = False
    # (tenant, user) -> its active sessions' scores, saved ones, requests queued in all
    sessions: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    saved_sessions: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    queued: dict[tuple[str, str], int] = field(default_factory=dict)
    # (tenant, user, session) -> a session's queue; the default session's is the user's
    session_queues: dict[tuple[str, str, str], list[Queued]] = field(default_factory=dict)

    def _queue(self, tenant: str, user: str, session: str | None) -> list[Queued]:
        if session:
            return self.session_queues.setdefault((tenant, user, session), [])
        return self.queues.setdefault((tenant, user), [])

    def session_of(self, tenant: str, user: str) -> str | None:
        """The session a user's next request comes from: its least-served active one,
        else its default session ""; None with sessions off."""
        if not self.by_session:
            return None
        active = self.sessions.get((tenant, user), {})
        return min(active, key=lambda s: (active[s], s)) if active else ""

    def _user_queue(self, tenant: str, user: str) -> list[Queued]:
        return self._queue(tenant, user, self.session_of(tenant, user))

    def enqueue(self, tenant: str, user: str, cost: float, tenant_cost: float,
                request_id: str | None = None, deadline: float | None = None,
                max_queued: int | None = None, session: str | None = None,
                prompt_tokens: int = 0, credit: float = 0.0,
                tenant_credit: float = 0.0) -> int:
        """Queue a request (at its EDF place) and make its user and tenant active, each
        at its saved score lifted to the smallest active score of its level (a user of a
        tenant with no active user: to the tenant's floor, where its last user left);
        with a ``session`` ("" the default one), in that session's queue, the session
        active among its user's likewise. Returns the user's queue length (with a
        session: its requests queued in all its sessions), or -1 when ``max_queued`` are
        already queued. ``credit``, ``tenant_credit``: what each of its ``prompt_tokens``
        predicted cached takes off its costs at dispatch (:meth:`serve`)."""
        queue = self._queue(tenant, user, session)
        count = len(queue) if session is None else self.queued.get((tenant, user), 0)
        if max_queued is not None and count >= max_queued:
            return -1
        if request_id is None:
            self.issued += 1
            request_id = f"{tenant}/{user}/{self.issued}"
        queue.insert(edf_position([q.deadline for q in queue], deadline),
                     Queued(request_id, cost, tenant_cost, deadline, prompt_tokens, credit,
                            tenant_credit))
        if session is not None:
            count = self.queued[(tenant, user)] = count + 1
            active = self.sessions.setdefault((tenant, user), {})
            if session not in active:
                saved = self.saved_sessions.get((tenant, user), {}).get(session, 0.0)
                active[session] = max(saved, min(active.values())) if active else saved
        users = self.users.setdefault(tenant, {})
        if user not in users:
            saved = self.saved_users.get(tenant, {}).get(user, 0.0)
            lift = min(users.values()) if users else self.floors.get(tenant)
            users[user] = saved if lift is None else max(saved, lift)
        if tenant not in self.tenants:
            saved = self.saved_tenants.get(tenant, 0.0)
            lift = min(self.tenants.values()) if self.tenants else None
            self.tenants[tenant] = saved if lift is None else max(saved, lift)
        return len(queue) if session is None else count

    def _tenant_order(self) -> list[str]:
        return sorted(self.tenants, key=lambda t: (self.tenants[t], t))

    def _user_order(self, tenant: str) -> list[str]:
        users = self.users.get(tenant, {})
        return sorted(users, key=lambda u: (users[u], u))

    def pick(self, pool: Pool | None = None, view: LocalityView | None = None,
             room: int | None = None) -> Pick | None:
        """The request one backend serves next, or None.

        Strict order (no slack): the least-served user of the least-served tenant, its
        queue's head; when the backend's prompt range is bounded or a backfill looks for
        ``room``, the first request in fairness order (tenants, their users, each user's
        first ``view.lookahead``, at most :data:`RANGE_SCAN` users) that ``pool`` takes.
        With a slack: among the users within it of their tenant's least-served user, of
        the tenants within it of the least-served tenant (``within_slack``, at most
        ``view.compared`` users), the request among the first ``view.lookahead`` of each
        queue that the backend's index holds longest (``best_cached``), of those the
        range takes and, with ``room``, whose uncached tokens fit in it."""
        pool = pool or Pool()
        view = view or LocalityView()
        if view.slack <= 0:
            if pool.ranged or room is not None:
                return self._first_fitting(pool, view.lookahead, room)
            for tenant in self._tenant_order():
                users = self._user_order(tenant)
                if users:
                    return Pick(tenant, users[0],
                                self._user_queue(tenant, users[0])[0].request_id,
                                session=self.session_of(tenant, users[0]))
                del self.tenants[tenant]  # never left so by the engine
            return None
        levels = [(self.tenants[t], [(self.users[t][u], (t, u)) for u in self._user_order(t)])
                  for t in self._tenant_order()]

        def takes(request: Queued, held: int) -> bool:
            return pool.fits(request.request_id) and (
                room is None or pool.fits(request.request_id, room, held))

        found = best_cached(((who, self._user_queue(*who)[:view.lookahead])
                             for who in within_slack(levels, view.slack, view.compared)),
                            lambda request: view.matched(request.request_id), takes)
        if found is None:
            return None
        (tenant, user), request, held = found
        return Pick(tenant, user, request.request_id, held, self.session_of(tenant, user))

    def _first_fitting(self, pool: Pool, lookahead: int, room: int | None) -> Pick | None:
        left = RANGE_SCAN
        for tenant in self._tenant_order()[:RANGE_SCAN]:
            users = self._user_order(tenant)[:left]
            for user in users:
                for request in self._user_queue(tenant, user)[:lookahead]:
                    if pool.fits(request.request_id, room):
                        return Pick(tenant, user, request.request_id,
                                    session=self.session_of(tenant, user))
            left -= len(users)
            if left <= 0:
                break
        return None

    def serve(self, pick: Pick, uncached: int | None = None, charged: bool = True) -> Queued:
        """Take the picked request out of its queue and charge it: its user's score grows
        by its cost, its tenant's by its tenant cost (with ``uncached``, the prompt tokens
        the backend's prefix index predicts to compute, the :func:`predicted_cost` of
        each); a user left with nothing queued
        leaves (its score saved), and a tenant left without users leaves too, its last
        user's score kept as the tenant's floor; with sessions, its session's score grows
        by its cost too, and a session left with nothing queued leaves its user's.
        ``charged`` False: a request dropped at its turn (its replica died), charged
        nothing."""
        tenant, user = pick.tenant, pick.user
        queue = self._queue(tenant, user, pick.session)
        request = next(q for q in queue if q.request_id == pick.request_id)
        queue.remove(request)
        users = self.users[tenant]
        cost, tenant_cost = request.charged(uncached) if charged else (0.0, 0.0)
        users[user] += cost
        self.tenants[tenant] += tenant_cost
        queued = (bool(queue) if pick.session is None
                  else self._session_left(tenant, user, pick.session, queue, cost))
        if not queued:
            self._leave(tenant, user)
        return request

    def _session_left(self, tenant: str, user: str, session: str, queue: list[Queued],
                      cost: float = 0.0) -> bool:
        """A request of ``session`` left ``queue`` (charged ``cost``): the session leaves
        its user's active sessions when nothing more is queued there, its score saved.
        Whether the user has a request queued still; one without forgets its session
        scores."""
        who = (tenant, user)
        left = self.queued.get(who, 0) - 1
        if left > 0:
            self.queued[who] = left
        else:
            self.queued.pop(who, None)
        active = self.sessions.get(who, {})
        if session in active:
            score = active[session] + cost
            if queue:
                active[session] = score
            else:
                del active[session]
                self.saved_sessions.setdefault(who, {})[session] = score
        if active or self.queues.get(who):
            return True
        self.sessions.pop(who, None)
        self.saved_sessions.pop(who, None)
        self.queued.pop(who, None)
        return False

    def _leave(self, tenant: str, user: str) -> None:
        """An active user with nothing queued leaves, its tenant too when it was the last."""
        users = self.users[tenant]
        score = self.saved_users.setdefault(tenant, {})[user] = users.pop(user)
        if not users:
            self.floors[tenant] = score
            if tenant in self.tenants:
                self.saved_tenants[tenant] = self.tenants.pop(tenant)

    def dispatch(self) -> tuple[str, str] | None:
        """Serve the least-served tenant's least-served user: (tenant, user)."""
        pick = self.pick()
        if pick is None:
            return None
        self.serve(pick)
        return pick.tenant, pick.user

    def settle(self, tenant: str, user: str, charge: float, tenant_charge: float,
               session: str | None = None) -> None:
        """Add a settle's charges to the user's and the tenant's scores, active or
        saved (a zero charge changes nothing), and with a ``session`` the user-level
        charge to the session's while its user has a request queued."""
        if charge and session is not None and user in self.users.get(tenant, {}):
            active = self.sessions.get((tenant, user), {})
            if session in active:
                active[session] += charge
            else:
                saved_sessions = self.saved_sessions.setdefault((tenant, user), {})
                saved_sessions[session] = saved_sessions.get(session, 0.0) + charge
        if charge:
            users = self.users.get(tenant, {})
            if user in users:
                users[user] += charge
            else:
                saved = self.saved_users.setdefault(tenant, {})
                saved[user] = saved.get(user, 0.0) + charge
        if tenant_charge:
            if tenant in self.tenants:
                self.tenants[tenant] += tenant_charge
            else:
                self.saved_tenants[tenant] = (self.saved_tenants.get(tenant, 0.0)
                                              + tenant_charge)

    def cancel(self, tenant: str, user: str, request_id: str,
               session: str | None = None) -> bool:
        """Take a still-queued request out (of its ``session``'s queue, with sessions);
        its user leaves when that was its last (and its tenant when that was its last
        user). False when it is not queued."""
        queue = self._queue(tenant, user, session)
        request = next((q for q in queue if q.request_id == request_id), None)
        if request is None:
            return False
        queue.remove(request)
        queued = (bool(queue) if session is None
                  else self._session_left(tenant, user, session, queue))
        if not queued and user in self.users.get(tenant, {}):
            self._leave(tenant, user)
        return True


POLICIES = ("vtc", "round_robin")


def policy_for(name: str, cost: TokenCost | None = None) -> FairnessPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "vtc":
        return Vtc(cost or TokenCost())
    raise ValueError(f"unknown fairness policy {name!r}")
