"""The dispatch decision's inputs and what a decision returned
(the rule itself: ``policies/dispatch_plan.py``; the script: ``lua/dispatch.lua``).

:meth:`Planner.plan` reads what a decision needs at a moment (the class service picture,
each backend's gates and load, the adapter placement, locality's candidates) and
:meth:`Planner.dispatch_args` turns it into the arguments of one backend's decision. Any
call to the store may carry one (an enqueue, a start, a settle, the dispatch loop's pass);
:meth:`Planner.granted` takes in what it returned, whichever call made it: this replica's
grants go to their clients (``gateway/scheduling/grants.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.backends.handle import BackendHandle
from gateway.backends.scrape import BackendPool
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, Settings, SettingsHolder
from gateway.scheduling.grants import Signals, Waiters
from gateway.scheduling.preemption import Preemptor
from gateway.storage.dispatch_call import dispatch_args
from gateway.storage.read_store import ReadStore
from gateway.storage.records import BackendFit, Dispatched, Locality
from policies.adapters import AdapterHost
from policies.adapters import takes as adapter_takes
from policies.dispatch_plan import BackendView, dispatch_order
from policies.gates import Gate
from policies.locality import routing_for
from policies.starvation import FloorPolicy, owed_class


@dataclass(frozen=True, slots=True)
class Plan:
    """One model's dispatch inputs at ``now``: the class order (a starved class owed its
    floor first), how many grants one decision may make, each backend's gates, and its
    open backends, least loaded first."""

    now: float
    owed: str | None
    order: list[str]
    burst: int
    gates: dict[str, dict[str, Gate]]
    open: list[str]
    handles: dict[str, BackendHandle]
    locality: Locality | None
    # the LoRA adapters each open backend takes in this pass (policies/adapters.py);
    # None: the model has no adapters
    adapters: Mapping[str, frozenset[str]] | None = None
    # the snapshot each backend's gates come from (taken_at, unix s; None: none yet)
    seen: Mapping[str, float | None] = dataclasses.field(default_factory=dict)


class Planner(ReadsSettings):
    """Each model's decision inputs, and what the latest decision said: the depth still
    queued, the class service picture, the decisions on their way."""

    def __init__(self, settings: SettingsHolder, reads: ReadStore, pool: BackendPool,
                 metrics: GatewayMetrics, replica_id: str, preemptor: Preemptor,
                 waiters: Waiters, signals: Signals) -> None:
        self.holder = settings
        self.reads = reads
        self.pool = pool
        self.metrics = metrics
        self.replica_id = replica_id
        self.preemptor = preemptor
        self.waiters = waiters
        self.signals = signals
        self.queued: dict[str, int] = {}  # model → depth seen by the latest dispatch
        self._class_view: dict[str, tuple[float, dict[str, float], list[str]]] = {}
        # decisions on their way to Redis, by (model, backend): while one is, a settle or a
        # start does not fold another in but wakes the dispatch loop, which takes every
        # slot freed meanwhile in one decision (under load, folds would each make one)
        self._deciding: dict[tuple[str, str], int] = {}
        self.floors: FloorPolicy
        self.locality: Locality | None
        self._derive(settings.current)
        settings.on_swap(self._derive)

    def _derive(self, settings: Settings) -> None:
        """The starvation floors and the locality rule of these settings."""
        self.floors = FloorPolicy(settings.class_floors, settings.starvation_after_s,
                                  settings.starvation_window)
        self.locality = (Locality(settings.locality_slack, settings.locality_candidates,
                                  settings.prefix_index_size, settings.prefix_index_ttl_s,
                                  settings.locality_max_imbalance)
                         if settings.routing != "least_loaded" else None)

    def nothing_queued(self, model: str) -> bool:
        """The latest decision for the model left nothing queued (on any replica)."""
        return self.queued.get(model, 1) == 0

    def deciding(self, model: str, backend: str) -> bool:
        return bool(self._deciding.get((model, backend)))

    async def plan(self, model: str, now: float) -> Plan:
        """The inputs of the model's dispatch decisions at ``now`` (``policies/``: the
        starvation floor, the gates, the borrowing, the backend order)."""
        since, recent = await self._class_service(model, now)
        owed = owed_class(self.floors, since, recent, now)
        handles = {h.name: h for h in self.pool.for_model(model)}  # stable across awaits
        views, seen = [], {}
        for h in handles.values():
            snap = h.last if h.healthy else None
            seen[h.name] = h.gates_seen
            views.append(BackendView(
                h.name, h.gates_at(now, self.settings.snapshot_stale_s),
                snap.waiting if snap else 0, snap.running if snap else 0,
                h.sent_since_snapshot))
        decided = dispatch_order(views, owed, {c: cfg.max_waiting
                                               for c, cfg in self.settings.classes.items()})
        adapters = self._adapter_placement([handles[name] for name in decided.open])
        locality = None  # least_loaded: configured, or auto with one backend
        if (self.locality is not None
                and routing_for(self.settings.routing, len(handles)) == "locality"):
            # a request is never left for a backend that is down (its prefix index would
            # hold a killed backend's continuations until they time out), nor for one
            # that does not take it (another length pool, an adapter it lacks)
            locality = dataclasses.replace(self.locality, others=decided.reachable, fits={
                name: self._fit(handles[name], adapters) for name in decided.reachable})
        return Plan(now, owed, decided.order, decided.burst, decided.gates, decided.open,
                    handles, locality, adapters, seen)

    def _adapter_placement(self, open_: list[BackendHandle]
                           ) -> Mapping[str, frozenset[str]] | None:
        """Which adapters each open backend takes: where each is resident first
        (``policies/adapters.py``); None when the model has no adapters."""
        if not open_ or self.pool.fit(open_[0]).adapters is None:
            return None
        return adapter_takes([AdapterHost(
            h.name, self.pool.adapters_on(h),
            frozenset(h.card.lora.active) if h.card.lora else frozenset(),
            h.card.lora.max_lora if h.card.lora else None) for h in open_])

    def _fit(self, handle: BackendHandle, adapters: Mapping[str, frozenset[str]] | None
             ) -> BackendFit:
        """What a backend takes: its prompt range, and the adapters the placement gives
        it (``adapters``, :meth:`_adapter_placement`; those it has when not placed)."""
        fit = self.pool.fit(handle)
        if fit.adapters is not None and adapters is not None and handle.name in adapters:
            fit = dataclasses.replace(fit, adapters=adapters[handle.name])
        return fit

    def dispatch_args(self, model: str, plan: Plan, backend: str) -> dict[str, Any]:
        fit = self._fit(plan.handles[backend], plan.adapters)
        return dispatch_args(model, backend, plan.gates[backend], self.replica_id, plan.now,
                             self.settings.replica_ttl_s, plan.order, self.floors.window,
                             plan.burst, locality=plan.locality, fit=fit,
                             sessions=self.settings.sessions, seen=plan.seen.get(backend))

    async def fold(self, model: str, backend: str
                   ) -> tuple[Plan | None, dict[str, Any] | None]:
        """The decision a started or settled request on ``backend`` folds in: none while
        nothing is known to be queued for the model, while another decision for the backend
        is on its way (the caller wakes the dispatch loop), or when the backend is not
        open."""
        if self.nothing_queued(model) or self.deciding(model, backend):
            return None, None
        plan = await self.plan(model, time.time())
        if backend not in plan.open:
            return plan, None
        return plan, self.dispatch_args(model, plan, backend)

    @contextlib.contextmanager
    def decision(self, model: str, backend: str | None) -> Iterator[None]:
        """A call that carries a decision for ``backend`` (None: none) is on its way."""
        if backend is None:
            yield
            return
        key = (model, backend)
        self._deciding[key] = self._deciding.get(key, 0) + 1
        try:
            yield
        finally:
            if self._deciding[key] == 1:
                del self._deciding[key]
            else:
                self._deciding[key] -= 1

    def granted(self, model: str, plan: Plan, done: Dispatched) -> bool:
        """Take in what a decision returned, whichever call made it: deliver this
        replica's grants (the others went to their replicas' grant lists), note what is
        still queued and the class service picture. True when the decision must be made
        again at once (a starved class is served one request at a time)."""
        self.queued[model] = done.depth
        self._class_view[model] = (plan.now, done.backlogged_since, done.recent)
        if done.stale_view:
            self.metrics.child(self.metrics.dispatch.stale_view, model, done.backend).inc()
        if done.grants and self.preemptor.soon(model, time.monotonic()):
            self.signals.wake_freed()  # a grant may wait on a full backend: check it
        for grant in done.grants:
            handle = plan.handles.get(grant.backend)
            if handle is not None:
                handle.sent_since_snapshot += 1
            self.metrics.child(self.metrics.dispatch.dispatches, model, grant.backend,
                               grant.klass).inc()
            self.metrics.dispatch.on_decision(model, grant.backend, grant.reason,
                                              grant.matched_blocks, grant.prompt_blocks)
            if grant.owner == self.replica_id:
                self.waiters.deliver(model, grant.request_id, grant.backend, grant.rank,
                                     grant.charged_prompt)
        if done.grants and plan.owed is not None:
            self._class_view.pop(model, None)
            return True
        return False

    async def _class_service(self, model: str, now: float
                             ) -> tuple[dict[str, float], list[str]]:
        """Backlog times and recent classes, as the latest decision returned them, read
        again when older than a scrape interval."""
        cached = self._class_view.get(model)
        if cached is None or now - cached[0] > self.settings.scrape_interval_s:
            since, recent = await self.reads.class_service(model)
            cached = self._class_view[model] = (now, since, recent)
        return cached[1], cached[2]
