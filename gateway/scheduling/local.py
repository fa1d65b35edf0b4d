"""Degraded mode (``store_outage: local``): a replica serves its own clients while the
store is unreachable.

With the default ``store_outage: fail_closed`` a Redis outage answers every queued and new
request 503 until the store is back. With ``local``, the dispatcher hands them here
instead: per model and class, the two-level fair engine of ``policies/fairness.py``
(``TwoLevel``, the plain-data twin of the Lua scripts) orders this replica's requests, and
each backend is paced by this replica's own scrapes with its share of the gate
(``policies/gates.py`` ``share``: 1/N of the burst and of the occupancy, N the live
replicas this replica last saw in the store), since what the other replicas send is no
longer counted in one place.

What it costs, by design: fairness holds among this replica's clients only (each replica
has its own queues and service scores, starting equal at every outage); locality,
starvation floors and prefill-token gates are not applied; quotas already admitted are
kept, and usage is charged when the store answers again only for requests that settle
after that.

When the store answers again (the dispatcher's heartbeat), the requests still queued here
go back to it with their original arrival time, and those granted here run to their end
here: they are never in the store's in-flight counts, and a grant the store still makes
for one of them is released at once (grants are idempotent by request id: the dispatcher
delivers a grant only to a client still waiting for one).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from gateway.backends.scrape import BackendPool
from gateway.storage.records import Grant, QueuedRequest
from policies.classes import CLASS_ORDER
from policies.fairness import Pick, TwoLevel
from policies.gates import share


@dataclass(slots=True)
class LocalWait:
    """A request this replica queues itself, and the future its client awaits."""

    model: str
    request: QueuedRequest
    future: asyncio.Future[Grant]


@dataclass(slots=True)
class _Sent:
    snapshot_at: float  # the backend snapshot these dispatches came after
    count: int = 0


class LocalScheduler:
    """This replica's queues, grants and gate counts while the store is unreachable."""

    def __init__(self, pool: BackendPool, replica_id: str) -> None:
        self.pool = pool
        self.replica_id = replica_id
        self.replicas = 1  # live replicas last seen in the store (the gate's divisor)
        self.waiting: dict[str, LocalWait] = {}
        self.running: dict[str, QueuedRequest] = {}  # granted here, not yet released
        self.served: list[LocalWait] = []  # granted here during this outage
        self._engines: dict[tuple[str, str], TwoLevel] = {}
        self._inflight: Counter[str] = Counter()  # backend -> local grants running
        self._user_inflight: Counter[tuple[str, str]] = Counter()  # (model, user)
        self._sent: dict[str, _Sent] = {}

    def holds(self, request_id: str) -> bool:
        """Is this request queued here?"""
        return request_id in self.waiting

    def queue(self, model: str, request: QueuedRequest, future: asyncio.Future[Grant]) -> None:
        """Queue a request here (a new one, or one the store held when it went away)."""
        if request.request_id in self.waiting or request.request_id in self.running:
            return
        engine = self._engines.setdefault((model, request.klass), TwoLevel())
        engine.enqueue(request.tenant_name, request.user, request.cost, request.tenant_charge,
                       request.request_id, request.deadline_at)
        self.waiting[request.request_id] = LocalWait(model, request, future)

    def cancel(self, request_id: str) -> bool:
        """Take a queued request out (its client left or timed out)."""
        wait = self.waiting.pop(request_id, None)
        if wait is None:
            return False
        r = wait.request
        self._engines[(wait.model, r.klass)].cancel(r.tenant_name, r.user, request_id)
        return True

    def dispatch(self, now: float, stale_after_s: float) -> list[tuple[str, Grant]]:
        """Grant queued requests while this replica's share of a backend's gate admits
        them: classes in order, the fairness order within each, the least loaded open
        backend that takes the request's length first. Returns the grants made, with
        their models."""
        granted = []
        for (model, klass), engine in sorted(self._engines.items(),
                                             key=lambda e: CLASS_ORDER.index(e[0][1])):
            while (pick := engine.pick()) is not None:
                wait = self.waiting.get(pick.request_id)
                if wait is None:  # (a request leaves the engine when it leaves ``waiting``)
                    break
                if wait.future.done():  # its client left: no slot for it
                    self.cancel(pick.request_id)
                    continue
                backend = self._backend_for(model, klass, wait.request, now, stale_after_s)
                if backend is None:
                    break
                granted.append((model, self._grant(engine, pick, wait, backend)))
        return granted

    def _backend_for(self, model: str, klass: str, request: QueuedRequest, now: float,
                     stale_after_s: float) -> str | None:
        candidates = []
        for h in self.pool.for_model(model):
            if h.last is None or not h.fit.prompt_range.admits(request.prompt_tokens):
                continue
            sent = self._sent.get(h.name)
            if sent is None or sent.snapshot_at != h.last.taken_at_s:
                sent = self._sent[h.name] = _Sent(h.last.taken_at_s)
            gate = share(h.gates_at(now, stale_after_s)[klass], self.replicas)
            if gate.admits(sent.count, 0, self._inflight[h.name]):
                candidates.append((self._inflight[h.name], h.name))
        return min(candidates)[1] if candidates else None

    def _grant(self, engine: TwoLevel, pick: Pick, wait: LocalWait, backend: str) -> Grant:
        r = wait.request
        engine.serve(pick)
        del self.waiting[r.request_id]
        self._sent[backend].count += 1
        self._inflight[backend] += 1
        rank = self._user_inflight[(wait.model, r.user)] = (
            self._user_inflight[(wait.model, r.user)] + 1)
        self.running[r.request_id] = r
        self.served.append(wait)
        grant = Grant(r.request_id, r.klass, r.user, rank, self.replica_id, backend,
                      r.enqueued_at, local=True)
        wait.future.set_result(grant)
        return grant

    def release(self, model: str, grant: Grant, charge: float,
                tenant_charge: float | None) -> None:
        """A request granted here ended: its slot frees, and its user and tenant are
        charged here (their scores in the store never saw it)."""
        r = self.running.pop(grant.request_id, None)
        if r is None:
            return
        self._inflight[grant.backend] -= 1
        self._user_inflight[(model, r.user)] -= 1
        engine = self._engines.get((model, r.klass))
        if engine is not None:
            engine.settle(r.tenant_name, r.user, charge,
                          charge if tenant_charge is None else tenant_charge)

    def take_back(self) -> tuple[list[LocalWait], list[LocalWait]]:
        """The store answers again: (still queued here, granted here during the outage).
        The queues empty; requests running here stay counted until they are released."""
        queued, served = list(self.waiting.values()), self.served
        self.waiting, self.served = {}, []
        self._engines.clear()
        self._sent.clear()
        return queued, served
