"""``gateway.scheduling.admission.Admission.admitted`` on a real Redis with a hand-driven
Dispatcher.

The :class:`~gateway.scheduling.admission.Ticket` it yields is the relay's listener: what it hears
(usage, first token, end) must reach the settle charge, the metrics and the gate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.core.errors import BackendRemoved
from gateway.proxy.completion_request import parse_body
from gateway.proxy.endpoints import CHAT
from gateway.scheduling.admission import Admission, Ticket
from gateway.services import build_admission
from gateway.storage.keys import ModelKeys
from gateway.storage.records import Grant, QueuedRequest
from policies.cost import TokenCost, estimate_prompt_tokens
from policies.fairness import Vtc
from tests.gateway.conftest import MODEL
from tests.gateway.test_dispatcher import REPLICA, Rig, make_rig, queue, set_backend

USER, KLASS, WEIGHT = "alice", "interactive", 2.0
BODY: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 400}]}
PROMPT_EST = estimate_prompt_tokens(parse_body(BODY, CHAT).prompt)
PROMPT, OUTPUT = 100, 10
K = ModelKeys(MODEL)


@dataclass
class Setup:
    rig: Rig
    policy: Vtc
    admission: Admission

    def admitted(self, request_id: str = "r1") -> Any:
        return self.admission.admitted(MODEL, USER, KLASS, WEIGHT,
                                       parse_body(BODY, CHAT),
                                       request_id=request_id)

    def dispatch_when_queued(self) -> asyncio.Task[bool]:
        """Dispatch once, as soon as the next request is queued."""
        self.rig.woken.clear()

        async def run() -> bool:
            await self.rig.woken.wait()
            return await self.rig.dispatcher.dispatch_once(MODEL)

        return asyncio.create_task(run())

    def sample(self, name: str, **labels: str) -> float:
        value = self.rig.metrics.registry.get_sample_value(name, {"model": MODEL, **labels})
        return value or 0.0


@pytest.fixture
async def setup(redis: aioredis.Redis, redis_url: str) -> AsyncIterator[Setup]:
    async with aiohttp.ClientSession() as session:
        rig = make_rig(redis_url, session, fairness="vtc", vtc_input_weight=1.0,
                       vtc_output_weight=2.0)
        await rig.store.replicas.heartbeat([MODEL], REPLICA, time.time())
        await set_backend(rig, "b0", waiting=0, running=0)
        fairness = rig.settings.fairness
        policy = Vtc(TokenCost(fairness.vtc_input_weight, fairness.vtc_output_weight))
        admission = build_admission(rig.pool.holder, rig.dispatcher, rig.pool, policy,
                                    rig.metrics, REPLICA)
        try:
            yield Setup(rig, policy, admission)
        finally:
            await rig.close()


def expected_score(policy: Vtc) -> float:
    score = (policy.dispatch_cost(PROMPT_EST, WEIGHT)
             + policy.settle_charge(PROMPT, PROMPT_EST, OUTPUT, WEIGHT))
    # (104 × 1) / 2 at dispatch, then ((100 − 104) × 1 + 10 × 2) / 2 at settle
    assert (PROMPT_EST, score) == (104, 60.0)
    return score


async def test_ticket_usage_feeds_the_settle_charge(setup: Setup) -> None:
    rig, store = setup.rig, setup.rig.store
    driver = setup.dispatch_when_queued()
    async with setup.admitted() as ticket:
        await driver
        assert (ticket.grant.request_id, ticket.grant.backend) == ("r1", "b0")
        assert ticket.backend is rig.pool.handles["b0"]
        assert ticket.priority == rig.settings.classes[KLASS].priority_base  # rank 0
        assert await store.reads.user_inflight(MODEL) == {USER: 1}
        ticket.usage(PROMPT, OUTPUT)
        ticket.end(True)
    assert await store.reads.user_inflight(MODEL) == {}
    assert await store.reads.request_fields(MODEL, "r1") == {}  # settled
    # alice's queue emptied at dispatch: her score waits in the saved hash
    saved = await store.client.hget(K.saved(KLASS), USER)
    assert float(saved) == pytest.approx(expected_score(setup.policy))


async def test_settle_charge_reaches_an_active_user(setup: Setup) -> None:
    store = setup.rig.store
    driver = setup.dispatch_when_queued()
    async with setup.admitted() as ticket:
        await driver
        # alice queues again while r1 runs: she is active when r1 settles
        await store.queue.enqueue(MODEL, QueuedRequest("r2", USER, KLASS, REPLICA, 0.0,
                                                 time.time()), 10)
        ticket.usage(PROMPT, OUTPUT)
    score = await store.client.zscore(K.active(KLASS), USER)
    assert score == pytest.approx(expected_score(setup.policy))


async def test_without_usage_the_estimate_is_charged(setup: Setup) -> None:
    """No usage reported (the backend failed): the prompt estimate stands, no output."""
    driver = setup.dispatch_when_queued()
    async with setup.admitted():
        await driver
    saved = await setup.rig.store.client.hget(K.saved(KLASS), USER)
    assert float(saved) == pytest.approx(setup.policy.dispatch_cost(PROMPT_EST, WEIGHT))
    assert setup.sample("fairgate_tokens_total", kind="prompt") == 0.0


async def test_metrics_are_recorded_when_the_body_is_cancelled(setup: Setup) -> None:
    entered = asyncio.Event()

    async def client() -> None:
        async with setup.admitted() as ticket:
            ticket.usage(PROMPT, OUTPUT)
            entered.set()
            await asyncio.Event().wait()  # the client hangs up while the answer streams

    driver = setup.dispatch_when_queued()
    task = asyncio.create_task(client())
    await driver
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert setup.sample("fairgate_user_tokens_total", user=USER, kind="prompt") == PROMPT
    assert setup.sample("fairgate_user_tokens_total", user=USER, kind="completion") == OUTPUT
    assert setup.sample("fairgate_tokens_total", kind="prompt") == PROMPT
    assert setup.sample("fairgate_tokens_total", kind="completion") == OUTPUT
    assert setup.sample("fairgate_user_service_total", user=USER) == pytest.approx(
        setup.policy.service(PROMPT, OUTPUT, WEIGHT))
    # and the release still ran, charge included
    assert await setup.rig.store.reads.user_inflight(MODEL) == {}
    saved = await setup.rig.store.client.hget(K.saved(KLASS), USER)
    assert float(saved) == pytest.approx(expected_score(setup.policy))


async def test_metrics_are_recorded_when_the_body_raises(setup: Setup) -> None:
    driver = setup.dispatch_when_queued()
    with pytest.raises(asyncio.CancelledError):
        async with setup.admitted() as ticket:
            await driver
            ticket.usage(PROMPT, OUTPUT)
            raise asyncio.CancelledError
    assert setup.sample("fairgate_user_tokens_total", user=USER, kind="completion") == OUTPUT
    assert setup.sample("fairgate_tokens_total", kind="prompt") == PROMPT
    assert await setup.rig.store.reads.user_inflight(MODEL) == {}


async def test_first_token_frees_the_gate_slot_once(setup: Setup,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    rig, store = setup.rig, setup.rig.store
    await set_backend(rig, "b0", waiting=2, running=0)  # room for one request in transit
    calls: list[Grant] = []
    mark_started = store.queue.mark_started

    async def counting(model: str, grant: Grant, now: float | None = None,
                       then: Any = None, held: Any = ()) -> Any:
        calls.append(grant)
        return await mark_started(model, grant, now, then, held)

    monkeypatch.setattr(store.queue, "mark_started", counting)
    sent_key = K.backend_sent("b0")
    driver = setup.dispatch_when_queued()
    async with setup.admitted() as ticket:
        await driver
        assert await store.client.zrange(sent_key, 0, -1) == ["r1"]
        assert "started" not in await store.reads.request_fields(MODEL, "r1")
        # bob queues behind r1, which fills the gate while it is in transit
        bob = await queue(rig, "r2", user="bob")
        await rig.dispatcher.dispatch_once(MODEL)
        assert not bob.delivered

        await ticket.first_token()
        assert [g.request_id for g in calls] == ["r1"]
        assert (await store.reads.request_fields(MODEL, "r1"))["started"] == "1"
        # the slot r1 held is free, and the same call granted it to bob
        assert bob.delivered, "the started call did not grant the queued request"
        assert (await bob.grant()).backend == "b0"

        await ticket.first_token()  # a second call changes nothing
        assert len(calls) == 1
        assert await store.client.zrange(sent_key, 0, -1) == ["r2"]
        ticket.usage(PROMPT, OUTPUT)
    await rig.dispatcher.release(MODEL, await bob.grant(), 0.0)
    assert await store.reads.user_inflight(MODEL) == {}


async def test_a_backend_removed_after_the_dispatch(setup: Setup) -> None:
    """A config reload dropped the backend between the grant and the admission."""
    rig = setup.rig
    rig.woken.clear()

    async def dispatch_then_remove() -> None:
        await rig.woken.wait()
        await rig.dispatcher.dispatch_once(MODEL)
        rig.pool.handles.pop("b0")  # before admitted() resumes with the grant

    driver = asyncio.create_task(dispatch_then_remove())
    body_ran = False
    with pytest.raises(BackendRemoved):
        async with setup.admitted():
            body_ran = True
    await driver
    assert not body_ran
    assert await rig.store.reads.user_inflight(MODEL) == {}  # released at once


def test_ticket_listener_defaults() -> None:
    """A fresh ticket claims nothing: no usage, nothing completed."""
    grant = Grant("r", KLASS, USER, 0, REPLICA, "b0", 0.0)
    ticket = Ticket(MODEL, grant, None, 0, None, None)  # type: ignore[arg-type]
    assert (ticket.prompt_tokens, ticket.completion_tokens, ticket.completed) == (None, 0,
                                                                                  False)
    ticket.usage(0, 5)
    assert (ticket.prompt_tokens, ticket.completion_tokens) == (None, 5)  # 0 = unknown
    ticket.end(True)
    assert ticket.completed
    ticket.tokens_sent(3)  # no timing: nothing to record, must not fail
