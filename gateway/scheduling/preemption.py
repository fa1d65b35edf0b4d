"""Preemption for fairness, decided by any replica and carried out by the one that holds
the stream (the rule: ``policies/preemption.py``; docs/scheduling.md).

The dispatch loop asks :meth:`Preemptor.check` after each pass over a model. While no
backend of the model is full by this replica's view of the snapshots (or nothing waits:
nothing queued, no request waiting in a full backend's snapshot, nothing this replica sent
to one since), that costs no Redis call. Otherwise one script reads what the rule needs
(``lua/preempt_view.lua``: each backlogged class's next request, and every dispatched
request the live replicas hold, with their users' fairness scores), the rule picks at
most one victim, and a second script orders it (``lua/preempt.lua``): at most
``max_preemptions`` times per answer, and on one backend not again before a snapshot
taken a scrape interval after the last order (the freed slot is then free or taken in
what every replica sees), so one preemption frees one slot for one waiting request.
While something waits on a full backend without a decision yet (not waited long enough, or
read less than a scrape interval ago), the check is due again at the earliest moment the
rule could decide otherwise (:meth:`Preemptor.recheck_in`): the dispatch loop comes back
then, with no other event, so a newcomer sent to a full backend preempts after its
class's ``preempt_after_ms`` and not when something else happens to wake the loop.

The order travels to the replica that holds the stream through its preemption list,
which its grant listener reads with its grants; that replica moves the stream
(``RunningStreams.move(request_id, "preempt")``): the backend connection closes (vLLM
aborts the request and frees its KV) and the answer's continuation waits at the head of
its user's queue, to resume from its token ids. A stream it cannot move is marked so and
the backend's hold is lifted at once; one still within its class's grace (its exact tokens
are known only there) is refused without the mark.

Each replica keeps the recompute budget of the preemptions it orders
(:meth:`Preemptor.allowance`): what they send again against a part of the tokens its own
streams served (``RunningStreams.served``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from gateway.backends.handle import BackendHandle
from gateway.backends.scrape import BackendPool
from gateway.core.errors import StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.proxy.moving import PREEMPT
from gateway.scheduling.running import RunningEntry, RunningStreams
from gateway.storage.preempt_store import PreemptStore
from gateway.storage.records import Preempt, PreemptView
from gateway.storage.values import original_id
from policies.classes import CLASS_ORDER
from policies.preemption import (
    BackendLoad,
    Preemption,
    PreemptRule,
    Running,
    Waiting,
    choose,
    is_full,
    next_decision_in,
    recompute_allowance,
)

log = structlog.get_logger("fairgate.preemption")
HOLD_FLOOR_S = 2.0  # a backend's hold outlives a replica that never answers its order
VIEW_TENANTS = 16  # of each backlogged class, the first tenants whose next request waits


class Preemptor(ReadsSettings):
    def __init__(self, settings: SettingsHolder, store: PreemptStore, pool: BackendPool,
                 metrics: GatewayMetrics, streams: RunningStreams | None = None) -> None:
        self.holder = settings
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.streams = streams  # this process's (None: none to move, as in a bare test rig)
        self._checked: dict[str, float] = {}  # model → monotonic time of its last read
        self._due: dict[str, float] = {}  # model → monotonic time its check is due again
        self._background: set[asyncio.Task[None]] = set()
        # model → tokens the preemptions this replica ordered send again (estimated at
        # the order): the recompute budget's spending, against what its streams served
        self._recomputed: dict[str, float] = {}

    def allowance(self, model: str) -> float:
        """Tokens a preemption this replica orders for ``model`` may recompute now
        (``recompute_allowance``): each replica spends against what its own streams
        served, so the fleet's preemptions stay within the ratio of the fleet's tokens
        (plus a burst per replica)."""
        fairness = self.settings.fairness
        served = 0 if self.streams is None else self.streams.served(model)
        left = recompute_allowance(served, self._recomputed.get(model, 0.0),
                                   fairness.preempt_recompute_ratio,
                                   fairness.preempt_recompute_burst_tokens)
        self.metrics.moves.recompute_allowance.labels(model).set(left)
        return left

    def rules(self) -> dict[str, PreemptRule]:
        return {c: cfg.preempt_rule() for c, cfg in self.settings.classes.items()}

    def loads(self, model: str, now: float) -> list[BackendLoad]:
        """The model's backends that take work now, as their snapshots show them, each
        running at least the answers this process streams from it: a snapshot of a busy
        backend may be seconds old (its ``/metrics`` answers late), while the streams'
        first tokens say at once that every slot is taken."""
        stale = self.settings.fleet.snapshot_stale_s
        return [BackendLoad(h.name, max(h.last.running, self._streaming(h.name)),
                            h.peak_running, h.last.kv_usage)
                for h in self.pool.for_model(model) if h.last is not None
                and h.gates_at(now, stale)[CLASS_ORDER[0]].reason not in ("stale", "drained")]

    def _streaming(self, backend: str) -> int:
        return 0 if self.streams is None else self.streams.streaming(backend)

    def full(self, model: str, now: float) -> list[BackendLoad]:
        """The model's backends that run all they can, for some class (none when
        preemption is off)."""
        if not self.settings.fairness.preemption:
            return []
        limits = {r.max_kv_usage for r in self.rules().values()}
        return [ld for ld in self.loads(model, now) if any(is_full(ld, kv) for kv in limits)]

    def recheck_in(self, moment: float) -> float | None:
        """Seconds until some model's check is due again (0: now), None when none is."""
        return max(0.0, min(self._due.values()) - moment) if self._due else None

    def soon(self, model: str, moment: float) -> bool:
        """Requests of ``model`` were just granted, by whichever call (an enqueue, a
        start or a settle grants too, not only the dispatch loop): one may wait on a full
        backend, so its check is due now. False when preemption is off."""
        if not self.settings.fairness.preemption:
            return False
        self._due[model] = min(moment, self._due.get(model, moment))
        return True

    def due(self, model: str, moment: float) -> bool:
        return self._due.get(model, float("inf")) <= moment

    def _waits(self, model: str, full: list[BackendLoad], queued: int) -> bool:
        """Might a request wait for one of the ``full`` backends' slots? ``queued``: the
        model's requests the latest decision left queued."""
        handles = {h.name: h for h in self.pool.for_model(model)}
        return queued > 0 or any(
            (h := handles.get(ld.name)) is not None and h.last is not None
            and (h.last.waiting > 0 or h.sent_since_snapshot > 0) for ld in full)

    async def check(self, model: str, full: list[BackendLoad], queued: int) -> bool:
        """Order one preemption for ``model`` when the rule finds one; True when ordered.
        ``full``: its full backends (:meth:`full`, now); ``queued``: the requests the
        latest decision left queued for the model."""
        settings = self.settings
        if not full or not self._waits(model, full, queued):
            self._due.pop(model, None)
            return False
        moment = time.monotonic()
        if moment - self._checked.get(model, 0.0) < settings.fleet.scrape_interval_s:
            self._due[model] = self._checked[model] + settings.fleet.scrape_interval_s
            return False
        self._checked[model] = moment
        self._due[model] = moment + settings.fleet.scrape_interval_s  # if this read fails
        now = time.time()
        handles = {h.name: h for h in self.pool.for_model(model)}
        view = await self.store.preemption_view(model, CLASS_ORDER,
                                                now - settings.replicas.replica_ttl_s,
                                                VIEW_TENANTS)
        waiting, running = plain(view, now, handles, self._exact())
        rules = self.rules()
        chosen = choose(waiting, running, self.loads(model, now), rules,
                        settings.fairness.preempt_fair_gap, self.allowance(model),
                        {name: t.weight for name, t in settings.tenants.items()})
        again = next_decision_in(waiting, rules, {ld.name for ld in full})
        if again is None:
            self._due.pop(model, None)
        else:  # not before the next read is allowed
            self._due[model] = moment + max(again, settings.fleet.scrape_interval_s)
        if chosen is None:
            return False
        return await self._order(model, chosen, now, rules)

    async def _order(self, model: str, chosen: Preemption, now: float,
                     rules: dict[str, PreemptRule]) -> bool:
        victim = chosen.victim
        order = Preempt(victim.request_id, original_id(victim.request_id)[0], victim.backend)
        settings = self.settings
        ordered = await self.store.order_preemption(
            model, order, now, rules[victim.klass].max_preemptions,
            settings.fleet.scrape_interval_s,
            max(HOLD_FLOOR_S, 2 * settings.fleet.snapshot_stale_s))
        if ordered:
            self._recomputed[model] = self._recomputed.get(model, 0.0) + victim.resend
            log.info("preemption_ordered", model=model, request_id=order.original,
                     backend=victim.backend, victim_class=victim.klass, victim_user=victim.user,
                     waiting_class=chosen.waiter.klass, waiting_user=chosen.waiter.user,
                     waited_s=round(chosen.waiter.waited_s, 3), resend_tokens=victim.resend)
        return ordered

    def carry_out(self, model: str, order: Preempt) -> None:
        """This replica holds the stream ``order`` names: move it (the listener's call),
        unless it is still within its class's grace (its exact tokens are known only
        here: the decision estimated them)."""
        entry = self._entry(order)  # before the move: it may settle at once
        klass = "" if entry is None else entry.klass
        rule = self.rules().get(klass)
        if (entry is not None and entry.streamed and rule is not None
                and entry.generated < rule.min_tokens):
            log.info("preemption_refused", model=model, request_id=order.original,
                     backend=order.backend, generated=entry.generated, reason="grace")
            self._spawn(self._refused(model, order, grace=True))
            return
        tokens = 0 if self.streams is None else self.streams.tokens(order.original)
        if self.streams is not None and self.streams.move(order.original, PREEMPT):
            user = "" if entry is None else entry.user
            self.metrics.moves.preemptions.labels(model, klass).inc()
            self.metrics.moves.preempted_tokens.labels(model, klass).inc(tokens)
            self.metrics.usage.on_preempted(model, user, klass, tokens)
            log.info("preempted", model=model, request_id=order.original, backend=order.backend,
                     user=user, resend_tokens=tokens)
            return
        log.info("preemption_refused", model=model, request_id=order.original,
                 backend=order.backend)
        self._spawn(self._refused(model, order))

    def _exact(self) -> dict[str, int]:
        """The tokens generated so far of the streams this process holds (by original
        request id): exact, where the decision otherwise estimates."""
        if self.streams is None:
            return {}
        return {e.request_id: e.generated for e in self.streams.entries() if e.streamed}

    def _entry(self, order: Preempt) -> RunningEntry | None:
        for entry in self.streams.entries() if self.streams is not None else ():
            if entry.request_id == order.original:
                return entry
        return None

    async def _refused(self, model: str, order: Preempt, grace: bool = False) -> None:
        try:
            await self.store.preempt_refused(model, order, grace)
        except StoreUnavailable:
            pass  # the backend's hold expires on its own

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def plain(view: PreemptView, now: float, handles: dict[str, BackendHandle],
          exact: dict[str, int] | None = None) -> tuple[list[Waiting], list[Running]]:
    """The rule's inputs from what Redis holds: each backlogged class's next request and
    each dispatched request that has not streamed yet wait; the current segment of each
    streaming answer runs (a continued answer's older segments, and one that left its
    backend while its continuation waits, are left out), with its tokens so far:
    ``exact`` for the streams this process holds (the answer's, by original id), else
    estimated from its time on the backend and the backend's recent TPOT (vLLM's batch
    decodes one token per running request per step)."""
    waiting = [Waiting(q["class"], q["user"], max(0.0, now - float(q["enqueued_at"])),
                       None, _number(q.get("score")), str(q.get("tenant") or ""))
               for q in view.queued]
    latest: dict[str, int] = {}  # original → the number of its latest segment
    preempted: dict[str, int] = {}
    for r in view.inflight:
        original, number = original_id(str(r["id"]))
        latest[original] = max(number, latest.get(original, 0))
        if number == 0:
            preempted[original] = int(r.get("preempted") or 0)
        if r.get("left"):  # its answer continues elsewhere: neither waits nor runs here
            continue
        if not r.get("started"):
            waiting.append(Waiting(r["class"], r["user"],
                                   max(0.0, now - float(r["enqueued_at"])), r["backend"],
                                   _number(r.get("score")), str(r.get("tenant") or "")))
    running = []
    for r in view.inflight:
        original, number = original_id(str(r["id"]))
        if (not r.get("started") or r.get("unmovable") or r.get("left")
                or number != latest[original]):
            continue
        handle = handles.get(r["backend"])
        tpot = handle.last.tpot_s if handle is not None and handle.last is not None else None
        elapsed = max(0.0, now - float(r["dispatched_at"]))
        generated = int(elapsed / tpot) if tpot else int(elapsed * 1000)
        if exact and original in exact:  # this process streams it: counted, not guessed
            generated = exact[original]  # the answer's (a continuation's resend: more)
        running.append(Running(str(r["id"]), r["backend"], r["class"], r["user"],
                               float(r.get("score") or 0.0), generated,
                               preempted.get(original, 0), int(r.get("ptok") or 0),
                               str(r.get("tenant") or "")))
    return waiting, running


def _number(value: Any) -> float | None:
    return None if value is None else float(value)
