"""Resumable streams on real vLLM (CPU, the tiny model), through the ``openai`` SDK.

Mid-stream failover: two servers (the session's and this module's), 12 streams at
temperature 0; this module's server is SIGKILLed (its whole process group) once the
streams have output. Every stream ends with exactly the text of a reference run without
the kill, usage counted once, and ``fairgate_continuations_total{reason="failover"}``
counts the continued ones.

This module's server (8 slots) is started once; the failover test kills it, so it runs
last (a test that needs it afterwards gets it started again).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from gateway.core.settings import Backend
from gateway.http.server import GatewayServer
from gateway.scheduling.running import RunningEntry
from tests.e2e_vllm.conftest import (
    TIMINGS,
    Launched,
    VllmServer,
    _stop,
    launch,
    skip_requested,
    wait_healthy,
)
from tests.gateway.conftest import gateway_settings

pytestmark = pytest.mark.vllm

SLOTS = 8  # --max-num-seqs of this module's server
STREAMS = 12
STREAM_TOKENS = 200
CUT_AFTER = 4  # tokens a stream on the killed server has generated at the kill
RUN_TIMEOUT_S = 180.0
KEYS = ("sk-alice", "sk-bob", "sk-carol")
CPU_SCRAPES: dict[str, Any] = {
    # vLLM's CPU API server answers /metrics slowly while 2 cores are busy: do not call
    # the backend unhealthy or its snapshot stale for that.
    "scrape_interval_s": 0.05, "scrape_timeout_s": 5.0, "snapshot_stale_s": 10.0,
    "unhealthy_after_failures": 20,
}


@dataclass
class ModuleServer:
    """This module's server; started again when a test killed it."""

    launched: Launched
    factory: tuple[Any, Any, pytest.TempPathFactory]

    def get(self) -> VllmServer:
        if self.launched.proc.poll() is not None:
            self.launched = launch(*self.factory, SLOTS)
            wait_healthy(self.launched)
        return self.launched.server

    def kill(self) -> None:
        """SIGKILL the server's whole process group (the API server and its engine), at
        once; :meth:`reap` waits for it."""
        os.killpg(self.launched.proc.pid, signal.SIGKILL)

    async def reap(self) -> None:
        await asyncio.to_thread(self.launched.proc.wait, 30)


@pytest.fixture(scope="module")
def eight_slots(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleServer]:
    if skip_requested():
        pytest.skip("FAIRGATE_SKIP_VLLM=1")
    python = request.getfixturevalue("vllm_python")
    model_dir = request.getfixturevalue("tiny_model_dir")
    module = ModuleServer(launch(python, model_dir, tmp_path_factory, SLOTS),
                          (python, model_dir, tmp_path_factory))
    try:
        request.getfixturevalue("vllm_server")  # the session's starts meanwhile
        wait_healthy(module.launched)
        yield module
    finally:
        _stop(module.launched.proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            module.launched.proc.wait(timeout=10)


@contextlib.asynccontextmanager
async def gateway(redis_url: str, servers: list[VllmServer], **overrides: Any
                  ) -> AsyncIterator[GatewayServer]:
    """A gateway in front of ``servers`` (``cpu0``, ``cpu1``, …), serving their model."""
    settings = gateway_settings(redis_url, [], **{**CPU_SCRAPES, **overrides})
    backends = [Backend(name=f"cpu{i}", url=s.url, model=s.model)
                for i, s in enumerate(servers)]
    gw = GatewayServer(settings.model_copy(update={"backends": backends}))
    await gw.start()
    try:
        for handle in gw.services.pool.handles.values():
            await asyncio.wait_for(handle.scraped.wait(), 60)
        yield gw
    finally:
        await gw.stop()


async def settled(gw: GatewayServer, model: str) -> None:
    """Nothing queued or in flight once every answer is over (bounded wait)."""
    store = gw.services.store
    for _ in range(500):
        if await store.user_inflight(model) == {} and not any(
                (await store.depths(model)).values()):
            return
        await asyncio.sleep(0.01)
    assert await store.user_inflight(model) == {}, "in-flight entries left"
    assert not any((await store.depths(model)).values()), await store.depths(model)


async def gateway_counter(gw: GatewayServer, name: str, **labels: str) -> float:
    """A counter's value as ``/metrics`` shows it (0 when the series is absent)."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(gw.url + "/metrics", timeout=30)).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


# --------------------------------------------------------------------------- streams


@dataclass
class Stream:
    """One streamed answer as the client read it."""

    index: int
    text: str = ""
    chunks: int = 0  # chunks with content
    first_at: float | None = None  # monotonic time of the first content
    ended_at: float | None = None
    finish: str | None = None
    usage: tuple[int, int] | None = None  # (prompt, completion) tokens
    error: str | None = None
    ids: set[str] = field(default_factory=set)


def is_chat(i: int) -> bool:
    return i % 2 == 0


def stream_args(model: str, i: int, max_tokens: int) -> dict[str, Any]:
    args: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                            "extra_body": {"ignore_eos": True}}
    if is_chat(i):
        args["messages"] = [{"role": "user", "content": f"question {i}: why does the queue "
                                                        "move on?"}]
    else:
        args["prompt"] = f"story {i}: the fair queue went on and on"
    return args


async def run_stream(client: openai.AsyncOpenAI, out: Stream, args: dict[str, Any],
                     progressed: asyncio.Event | None = None,
                     on_chunk: Callable[[Stream], None] | None = None) -> Stream:
    """Read one stream to its end (bounded), recording what came; ``progressed`` is set
    and ``on_chunk`` called at each content chunk."""
    chat = "messages" in args
    try:
        async with asyncio.timeout(RUN_TIMEOUT_S):
            create = client.chat.completions.create if chat else client.completions.create
            stream: Any = await create(**args, stream=True,
                                       stream_options={"include_usage": True})
            async for chunk in stream:
                out.ids.add(chunk.id)
                if chunk.usage is not None:
                    out.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                for choice in chunk.choices:
                    piece = choice.delta.content if chat else choice.text
                    if piece:
                        out.text += piece
                        out.chunks += 1
                        if out.first_at is None:
                            out.first_at = time.monotonic()
                        if progressed is not None:
                            progressed.set()
                        if on_chunk is not None:
                            on_chunk(out)
                    if choice.finish_reason is not None:
                        out.finish = choice.finish_reason
    except (openai.APIError, TimeoutError) as exc:
        out.error = repr(exc)
    out.ended_at = time.monotonic()
    if progressed is not None:
        progressed.set()
    return out


@dataclass
class KillMidStream:
    """Kills ``victim`` the moment fairgate has relayed CUT_AFTER (not all) generated
    tokens of a stream running there (by the gateway's own record of its running requests, checked
    at every chunk a client reads: the tiny model's answers take under a second, the
    clients read behind the gateway, no timer would catch them); ``at_kill``: the
    requests on the victim with output then."""

    gw: GatewayServer
    victim: str
    kill: Callable[[], None]
    streams: list[Stream]
    at_kill: list[RunningEntry] | None = None

    def __call__(self, stream: Stream) -> None:
        if self.at_kill is not None:
            return
        there = self.gw.services.running.entries(self.victim)
        if any(CUT_AFTER <= e.generated < STREAM_TOKENS for e in there):
            self.kill()
            self.at_kill = [e for e in there if 0 < e.generated < STREAM_TOKENS]


async def twelve_streams(gw: GatewayServer, model: str,
                         killer: KillMidStream | None = None) -> list[Stream]:
    """STREAMS streams through ``gw``, keys in turn, ``killer`` watching them."""
    clients = [openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=k, max_retries=0)
               for k in KEYS]
    streams = killer.streams if killer is not None else [Stream(i) for i in range(STREAMS)]
    try:
        await asyncio.gather(*(run_stream(clients[i % len(KEYS)], s,
                                          stream_args(model, i, STREAM_TOKENS), None, killer)
                               for i, s in enumerate(streams)))
    finally:
        for c in clients:
            await c.close()
    return streams


def first_difference(a: str, b: str) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


async def test_a_killed_vllm_server_streams_continue_on_the_other(
        eight_slots: ModuleServer, vllm_server: VllmServer, redis: aioredis.Redis,
        redis_url: str) -> None:
    started = time.monotonic()
    servers = [vllm_server, eight_slots.get()]
    model = vllm_server.model
    async with gateway(redis_url, servers) as gw:
        reference = await twelve_streams(gw, model)
        await settled(gw, model)
        killer = KillMidStream(gw, "cpu1", eight_slots.kill,
                               [Stream(i) for i in range(STREAMS)])
        streams = await twelve_streams(gw, model, killer)
        assert killer.at_kill is not None, f"no stream had {CUT_AFTER} tokens from cpu1"
        await eight_slots.reap()
        await settled(gw, model)
        continued = await gateway_counter(gw, "fairgate_continuations_total",
                                          reason="failover", outcome="continued")
        failed = await gateway_counter(gw, "fairgate_continuations_total",
                                       reason="failover", outcome="failed")
        recomputed = await gateway_counter(
            gw, "fairgate_continuation_recomputed_tokens_total", reason="failover")
        paused = [await gateway_counter(gw, f"fairgate_continuation_pause_seconds_{part}",
                                        reason="failover") for part in ("sum", "count")]
    elapsed = time.monotonic() - started
    TIMINGS["failover test"] = elapsed
    completed = sum(s.error is None and s.finish == "length" for s in streams)
    errored = sum(s.error is not None for s in streams)
    print(f"failover on real vLLM: {completed} of {STREAMS} completed, {errored} errored, "
          f"{continued:.0f} continued ({failed:.0f} failed), {recomputed:.0f} tokens sent "
          f"again, mean pause {paused[0] / max(paused[1], 1):.3f} s; "
          f"load {os.getloadavg()[0]:.2f}; {elapsed:.1f} s")
    for want in reference:
        assert want.error is None and want.finish == "length" and want.usage is not None, want
        assert want.usage[1] == STREAM_TOKENS, want
    for got, want in zip(streams, reference, strict=True):
        assert got.error is None, (got.index, got.error)
        assert got.finish == "length", (got.index, got.finish)
        assert got.text == want.text, (
            f"stream {got.index}: {len(got.text)} chars vs the reference's "
            f"{len(want.text)}; first difference at {first_difference(got.text, want.text)}")
        # one answer: one id, its usage once for the whole answer
        assert len(got.ids) == 1, (got.index, got.ids)
        assert got.usage == want.usage, (got.index, got.usage, want.usage)
    # the killed server held running streams: they were continued, none failed
    # (one dispatched there without output yet may be continued too)
    on_victim = len(killer.at_kill)
    assert continued >= on_victim >= 1 and failed == 0, (continued, failed, on_victim)
    assert recomputed > 0, recomputed
