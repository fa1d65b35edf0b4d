"""Preemption for fairness end to end, through the ``openai`` SDK: a batch key fills every
slot of a simulated vLLM (``max_num_seqs`` 4) with long generations, then an interactive
newcomer arrives. With preemption on, a batch stream gives its slot back: the newcomer's
first token comes before any batch stream ends, and every batch stream still completes
with exactly its ``max_tokens`` tokens and the text of an unpreempted run (temperature
0). With preemption off, or when the slots are held by interactive streams (never
preempted with the class's fair_preemption off), the newcomer waits until one of them
ends. The per-answer cap holds. A Batch API line is preempted the same way: sent again
later, recorded once. What came first is judged by the simulator's clock
(``EngineTimes``), not by when a client read it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from gateway.http.server import GatewayServer
from loadtest.sim.server import SimServer
from tests.conftest import OpenAIClients
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, until

SLOTS = 4
FILL_TOKENS = 900  # each filler's answer: a few seconds on the simulated H100
NEW_TOKENS = 16


def body(i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"job {i}: write on and on"}]}


async def stream(gw: GatewayServer, key: str, i: int, max_tokens: int) -> tuple[str, int]:
    """One chat stream through the SDK: (its text, its completion tokens)."""
    text, tokens = [], 0
    async with AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0,
                           timeout=120) as oai:
        out = await oai.chat.completions.create(
            **body(i, max_tokens), stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in out:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    text.append(choice.delta.content)
    return "".join(text), tokens


async def reference(sim: SimServer, i: int, max_tokens: int) -> str:
    """An unpreempted answer, straight from a simulator."""
    async with aiohttp.ClientSession() as http, http.post(
            sim.url + "/v1/chat/completions",
            json={**body(i, max_tokens), "ignore_eos": True}) as resp:
        return str((await resp.json())["choices"][0]["message"]["content"])


async def fill(gw: GatewayServer, backend: SimServer, key: str, count: int = SLOTS
               ) -> list[asyncio.Task[tuple[str, int]]]:
    """``count`` long streams of ``key``, running (the gateway's snapshot shows them)."""
    tasks = [asyncio.create_task(stream(gw, key, i, FILL_TOKENS))
             for i in range(count)]
    handle = gw.services.pool.handles["b0"]
    await until(lambda: backend.engine.num_running == count, f"{count} fillers running")
    await until(lambda: handle.last is not None and handle.last.running == count
                and handle.peak_running == count, "a snapshot with every slot running")
    return tasks


@dataclass(frozen=True)
class EngineTimes:
    """When things happened at the engine, by its clock: a client reading a long stream
    on a loaded machine sees its end seconds late, so the order is judged here."""

    newcomers: list[float]  # each newcomer's first token, in the order they arrived
    ends: list[float]  # each filler's answer ending whole (a continuation's end, if moved)

    def message(self) -> str:
        return f"newcomers' first tokens at {self.newcomers}, fillers ended at {self.ends}"


def engine_times(*backends: SimServer) -> EngineTimes:
    records = sorted((r for b in backends for r in b.engine.records.values()),
                     key=lambda r: r.arrival_s)
    newcomers = [r.first_token_s for r in records
                 if r.max_tokens == NEW_TOKENS and r.first_token_s is not None]
    ends = sorted(r.finished_s for r in records if r.max_tokens != NEW_TOKENS
                  and not r.aborted and r.finished_s is not None)
    return EngineTimes(newcomers, ends)


def counter(gw: GatewayServer) -> Callable[[str], float]:
    metrics = gw.services.metrics
    return lambda klass: metrics.moves.preemptions.labels(MODEL, klass)._value.get()


@pytest.mark.timeout(120)
async def test_a_newcomer_preempts_a_batch_stream_that_then_completes_exactly(
        gateway: GatewayFactory, sim: SimFactory) -> None:
    backend, spare = await sim(max_num_seqs=SLOTS), await sim(max_num_seqs=SLOTS)
    gw = await gateway([backend], classes={"interactive": {"preempt_after_ms": 300}})
    want = asyncio.gather(*(reference(spare, i, FILL_TOKENS) for i in range(SLOTS)))
    fillers = await fill(gw, backend, "sk-batch")
    new_text, new_tokens = await stream(gw, "sk-alice", 99, NEW_TOKENS)
    answers = await asyncio.wait_for(asyncio.gather(*fillers), 90)
    at = engine_times(backend)
    assert at.newcomers[0] < at.ends[0], at.message()
    assert new_tokens == NEW_TOKENS, new_text
    for i, ((text, tokens), expected) in enumerate(zip(answers, await want, strict=True)):
        assert tokens == FILL_TOKENS, (i, tokens)
        assert text == expected, (i, len(text), len(expected), text[-60:], expected[-60:])
    preempted = counter(gw)("batch")
    m = gw.services.metrics
    continued = m.moves.continuations.labels("preempt", "continued")._value.get()
    assert preempted >= 1 and continued == preempted, (preempted, continued)
    assert m.moves.recomputed_tokens.labels("preempt")._value.get() > 0
    assert m.moves.continuations.labels("failover", "continued")._value.get() == 0
    async with aiohttp.ClientSession() as http, http.get(gw.url + "/metrics") as resp:
        scraped = await resp.text()
    assert 'fairgate_preemptions_total{model="llama-3.1-8b",priority_class="batch"}' in scraped
    moves = (await gw.services.inspector.state())["moves"]  # the dashboard's panel
    assert moves["continuations"]["preempt"]["continued"] == continued, moves
    assert moves["preempted"] == {f"{MODEL} · batch": preempted}, moves


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("key", "preemption"), [("sk-batch", False), ("sk-bob", True)],
                         ids=["preemption-off", "interactive-fillers-fair-off"])
async def test_without_a_preemptible_victim_the_newcomer_waits_for_a_slot(
        gateway: GatewayFactory, sim: SimFactory, key: str, preemption: bool) -> None:
    """(Interactive streams are preempted for fairness by default since issue 46: with the
    class's fair_preemption off they are never preempted, as before;
    tests/chaos/test_fair_preemption.py has the default.)"""
    backend = await sim(max_num_seqs=SLOTS)
    gw = await gateway([backend], preemption=preemption,
                       classes={"interactive": {"preempt_after_ms": 300,
                                                "fair_preemption": False}})
    fillers = await fill(gw, backend, key)
    _, new_tokens = await stream(gw, "sk-alice", 99, NEW_TOKENS)
    answers = await asyncio.wait_for(asyncio.gather(*fillers), 90)
    at = engine_times(backend)
    assert at.ends[0] < at.newcomers[0], at.message()
    assert new_tokens == NEW_TOKENS and [t for _, t in answers] == [FILL_TOKENS] * SLOTS
    assert counter(gw)("batch") == counter(gw)("interactive") == 0


@pytest.mark.timeout(120)
async def test_one_answer_is_preempted_at_most_max_preemptions_times(
        gateway: GatewayFactory, sim: SimFactory) -> None:
    backend = await sim(max_num_seqs=1)
    gw = await gateway([backend], classes={"interactive": {"preempt_after_ms": 200},
                                           "batch": {"max_preemptions": 1}})
    [filler] = await fill(gw, backend, "sk-batch", count=1)
    await stream(gw, "sk-alice", 98, NEW_TOKENS)  # preempts it: the cap
    # the preempted answer runs again (its continuation has produced a token: not merely
    # queued, where an interactive newcomer would overtake it in the gateway's or the
    # engine's queue); the next newcomer may not take its slot. The continuation is the
    # record with the filler's prompt + max tokens (prompt + generated ids, max_tokens less
    # what was generated), not merely the newest: it may reach the engine before new1.
    def continuation_running() -> bool:
        first, *rest = backend.engine.records.values()
        whole = first.prompt_tokens + first.max_tokens
        return any(r.prompt_tokens + r.max_tokens == whole and r.first_token_s is not None
                   and r.finished_s is None for r in rest)
    await until(continuation_running, "the batch answer running again")
    await stream(gw, "sk-bob", 99, NEW_TOKENS)
    text, tokens = await asyncio.wait_for(filler, 90)
    at = engine_times(backend)
    assert at.newcomers[0] < at.ends[0] < at.newcomers[1], at.message()
    assert tokens == FILL_TOKENS, (tokens, text[-40:])
    assert counter(gw)("batch") == 1


@pytest.mark.timeout(120)
async def test_a_batch_api_line_is_preempted_sent_again_and_recorded_once(
        gateway: GatewayFactory, sim: SimFactory, tmp_path: Path,
        openai_clients: OpenAIClients) -> None:
    backend, spare = await sim(max_num_seqs=SLOTS), await sim(max_num_seqs=SLOTS)
    gw = await gateway([backend], data_dir=tmp_path, batch_poll_s=0.05,
                       classes={"interactive": {"preempt_after_ms": 300}})
    want = asyncio.gather(*(reference(spare, i, FILL_TOKENS) for i in range(SLOTS)))
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {**body(i, FILL_TOKENS), "ignore_eos": True}} for i in range(SLOTS)]
    oai = openai_clients(gw.url, "sk-batch")
    upload = await oai.files.create(
        file=("in.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode()),
        purpose="batch")
    batch = await oai.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
    handle = gw.services.pool.handles["b0"]
    await until(lambda: backend.engine.num_running == SLOTS, "every line running")
    await until(lambda: handle.last is not None and handle.last.running == SLOTS
                and handle.peak_running == SLOTS, "a snapshot with every slot running")
    _, new_tokens = await stream(gw, "sk-alice", 99, NEW_TOKENS)
    counts = (await oai.batches.retrieve(batch.id)).request_counts
    assert new_tokens == NEW_TOKENS and counts is not None and counts.completed == 0, counts
    for _ in range(2400):  # bounded: the lines take a few seconds each
        batch = await oai.batches.retrieve(batch.id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            break
        await asyncio.sleep(0.05)
    assert batch.status == "completed" and batch.output_file_id, batch
    out = [json.loads(row) for row in
           (await oai.files.content(batch.output_file_id)).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == [f"line-{i}" for i in range(SLOTS)], out
    expected = await want
    for row in out:
        i = int(row["custom_id"].split("-")[1])
        answer = row["response"]["body"]
        assert answer["usage"]["completion_tokens"] == FILL_TOKENS, row["custom_id"]
        assert answer["choices"][0]["message"]["content"] == expected[i], row["custom_id"]
    m = gw.services.metrics
    assert counter(gw)("batch") >= 1
    assert m.moves.continuations.labels("preempt", "continued")._value.get() >= 1
    assert m.moves.recomputed_tokens.labels("preempt")._value.get() > 0


@pytest.mark.timeout(120)
async def test_a_stream_another_replica_runs_is_preempted_while_every_gate_is_closed(
        gateway: GatewayFactory, sim: SimFactory) -> None:
    """Replica B runs the batch streams: every slot, and three more waiting in the engine,
    which closes every class's gate, so the interactive newcomer that arrives at replica A
    stays queued there. A's decision sees what B runs and orders a preemption that B
    carries out: the newcomer's first token comes before any batch stream ends, and every
    batch stream completes whole."""
    backend = await sim(max_num_seqs=SLOTS)
    classes = {"interactive": {"preempt_after_ms": 300}, "batch": {"max_waiting": 3}}
    replica_b = await gateway([backend], classes=classes)
    replica_a = await gateway([backend], classes=classes)
    batch = [asyncio.create_task(stream(replica_b, "sk-batch", i, FILL_TOKENS))
             for i in range(SLOTS + 3)]
    handle = replica_a.services.pool.handles["b0"]
    await until(lambda: handle.last is not None and handle.last.running == SLOTS
                and handle.last.waiting == 3 and handle.peak_running == SLOTS,
                "replica A's snapshot: every slot running, 3 waiting (every gate closed)")
    _, new_tokens = await asyncio.wait_for(
        stream(replica_a, "sk-alice", 99, NEW_TOKENS), 90)
    assert new_tokens == NEW_TOKENS, new_tokens
    answers = await asyncio.gather(*batch)
    at = engine_times(backend)
    assert at.newcomers[0] < at.ends[0], at.message()
    assert [t for _, t in answers] == [FILL_TOKENS] * (SLOTS + 3), [t for _, t in answers]
    assert counter(replica_b)("batch") >= 1, counter(replica_b)("batch")


@pytest.mark.timeout(120)
async def test_a_newcomer_sent_to_a_full_backend_preempts_with_no_snapshot_or_heartbeat(
        gateway: GatewayFactory, sim: SimFactory) -> None:
    """On real vLLM the newcomer is sent to the full server (its waiting gate is open)
    and waits there, and the busy server answers /metrics late: the decision must not
    wait for the next snapshot, nor for the heartbeat's pass. Here no snapshot arrives
    (the simulator holds /metrics) and the heartbeat is a minute away: the newcomer's
    class wait (100 ms) alone must bring the preemption."""
    backend = await sim(max_num_seqs=SLOTS)
    gw = await gateway([backend], classes={"interactive": {"preempt_after_ms": 100}},
                       replica_heartbeat_s=60.0, replica_ttl_s=180.0,
                       scrape_timeout_s=90.0, snapshot_stale_s=120.0)
    fillers = await fill(gw, backend, "sk-batch")
    backend.metrics_hold = asyncio.Event()
    # a scrape answered before the hold may still land: the next one waiting on the hold
    # means it has (the scrape loop scrapes one at a time)
    await until(lambda: backend.scrapes_held > 0, "a scrape waiting on the held /metrics")
    handle, dispatcher = gw.services.pool.handles["b0"], gw.services.dispatcher
    snapshot, beats = handle.last, dispatcher.replicas.beats
    try:
        await stream(gw, "sk-alice", 99, NEW_TOKENS)
        seen = (handle.last is snapshot, dispatcher.replicas.beats - beats)
    finally:
        backend.metrics_hold.set()
    answers = await asyncio.wait_for(asyncio.gather(*fillers), 90)
    assert seen == (True, 0), f"(no new snapshot, heartbeats) while it waited: {seen}"
    at = engine_times(backend)
    assert at.newcomers[0] < at.ends[0], at.message()
    assert counter(gw)("batch") >= 1, at.message()
    assert [t for _, t in answers] == [FILL_TOKENS] * SLOTS, [t for _, t in answers]


@pytest.mark.timeout(120)
async def test_a_backend_full_by_its_streams_preempts_before_a_snapshot_shows_it(
        gateway: GatewayFactory, sim: SimFactory) -> None:
    """The busy real server answers /metrics seconds late (seen on vLLM's CPU build: the
    newcomer waited 4.7 s there): the latest snapshot may show the backend idle while its
    slots are all taken. The gateway streams every one of them, so it knows: the
    newcomer's class wait (100 ms) alone must bring the preemption. Here the snapshot
    taken before the fillers came stays the latest (the simulator holds /metrics)."""
    backend = await sim(max_num_seqs=SLOTS)
    gw = await gateway([backend], classes={"interactive": {"preempt_after_ms": 100},
                                           "batch": {"max_waiting": SLOTS}},
                       replica_heartbeat_s=60.0, replica_ttl_s=180.0,
                       scrape_timeout_s=90.0, snapshot_stale_s=120.0)
    handle, running = gw.services.pool.handles["b0"], gw.services.running
    # the batch's size (every slot seen running once), then an idle snapshot, held
    warm = await fill(gw, backend, "sk-bob")
    await asyncio.wait_for(asyncio.gather(*warm), 90)
    await until(lambda: handle.last is not None and handle.last.running == 0,
                "a snapshot of the idle backend")
    backend.metrics_hold = asyncio.Event()
    await until(lambda: backend.scrapes_held > 0, "a scrape waiting on the held /metrics")
    snapshot = handle.last
    try:
        fillers = [asyncio.create_task(stream(gw, "sk-batch", i, FILL_TOKENS))
                   for i in range(SLOTS)]
        await until(lambda: running.streaming("b0") == SLOTS,
                    "every slot streaming through the gateway")
        await stream(gw, "sk-alice", 99, NEW_TOKENS)
        seen = (handle.last is snapshot, snapshot.running if snapshot else None,
                handle.peak_running)
    finally:
        backend.metrics_hold.set()
    answers = await asyncio.wait_for(asyncio.gather(*fillers), 90)
    assert seen == (True, 0, SLOTS), f"(no new snapshot, its running, the batch): {seen}"
    at = engine_times(backend)
    assert at.newcomers[0] < at.ends[SLOTS], at.message()
    assert counter(gw)("batch") >= 1, at.message()
    assert [t for _, t in answers] == [FILL_TOKENS] * SLOTS, [t for _, t in answers]
