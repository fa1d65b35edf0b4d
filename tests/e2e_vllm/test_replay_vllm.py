"""Streams with tools or structured output continued by a replay (``gateway/proxy/replay.py``)
on real vLLM (CPU, the tiny model), through the ``openai`` SDK.

Two servers of this module's own, with vLLM's tool parser (``--enable-auto-tool-choice
--tool-call-parser hermes``), a frame per 4 tokens (so a seam falls inside a replay's
frame), niced. One stream of each kind at once (:data:`KINDS`: ``tool_choice``
``required``, a named function, ``auto``, a seeded sampled ``required``; ``response_format``
``json_schema`` and ``json_object``; a completion with ``structured_outputs``), first
uninterrupted (the reference), then:

- moved mid-stream: every movable stream on ``cpu1`` asked to move (``drain``, the path a
  drain with migrate and preemption take) once one has output there;
- SIGKILLed mid-stream: ``cpu1``'s whole process group killed once a stream has output
  there (one kill for every kind).

Each stream ends with exactly the reference's content, tool calls (names and arguments)
and finish reason, under one id, its usage counted once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from gateway.http.server import GatewayServer
from tests.e2e_vllm.conftest import Launched, _stop, launch, skip_requested, wait_healthy
from tests.e2e_vllm.test_resumable_vllm import gateway, gateway_counter, settled

pytestmark = pytest.mark.vllm

SERVER_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--stream-interval", "4")
SERVER_NICE = 10  # as test_resumable_vllm's: the gateway must read while vLLM generates
MAX_TOKENS = 160
RUN_TIMEOUT_S = 120.0
ATTEMPTS = 3  # runs until one is cut mid-stream (a starved server may send answers whole)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 120},
                                         "days": {"type": "integer"}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}},
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
MESSAGES = [{"role": "user", "content": "what is the weather in paris for 3 days?"}]
KINDS: dict[str, dict[str, Any]] = {
    "required": {"tools": TOOLS, "tool_choice": "required"},
    "named": {"tools": TOOLS, "tool_choice": {"type": "function",
                                              "function": {"name": "get_weather"}}},
    "auto": {"tools": TOOLS},
    "required_seeded": {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0,
                        "seed": 1234},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "completion_regex": {"extra_body": {"structured_outputs": {"regex": "[a-z ]{20,600}"}}},
}


@dataclass
class Answer:
    """One streamed answer as the client read it."""

    kind: str
    content: str = ""
    calls: dict[int, list[str]] = field(default_factory=dict)  # index → [id, name, args]
    finish: str | None = None
    usage: tuple[int, int] | None = None
    ids: set[str] = field(default_factory=set)
    chunks: int = 0
    error: str | None = None

    def same(self) -> tuple[Any, ...]:
        """What must equal the reference's (a call's id is the server's own)."""
        return (self.content, [(c[1], c[2]) for _, c in sorted(self.calls.items())],
                self.finish, self.usage)


def request_args(kind: str) -> dict[str, Any]:
    extra = dict(KINDS[kind])
    args: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0}
    args.update(extra)
    if kind.startswith("completion"):
        args["prompt"] = "pick a few words:"
    else:
        args["messages"] = MESSAGES
    return args


async def run(client: openai.AsyncOpenAI, out: Answer,
              on_chunk: Callable[[], Awaitable[None]]) -> Answer:
    args = request_args(out.kind)
    chat = "messages" in args
    create = client.chat.completions.create if chat else client.completions.create
    try:
        async with asyncio.timeout(RUN_TIMEOUT_S):
            stream: Any = await create(**args, stream=True,
                                       stream_options={"include_usage": True})
            async for chunk in stream:
                out.ids.add(chunk.id)
                if chunk.usage is not None:
                    out.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                for choice in chunk.choices:
                    read(out, choice, chat)
                await on_chunk()
    except (openai.APIError, TimeoutError) as exc:
        out.error = repr(exc)
    return out


def read(out: Answer, choice: Any, chat: bool) -> None:
    out.chunks += 1
    out.finish = choice.finish_reason or out.finish
    if not chat:
        out.content += choice.text or ""
        return
    out.content += choice.delta.content or ""
    for call in choice.delta.tool_calls or ():
        have = out.calls.setdefault(call.index, ["", "", ""])
        if call.id:
            assert not have[0], f"{out.kind}: tool call {call.index} got a second id"
            have[0] = call.id
        if call.function is not None:
            have[1] += call.function.name or ""
            have[2] += call.function.arguments or ""


async def all_kinds(gw: GatewayServer, cut: Callable[[], Awaitable[None]] | None = None
                    ) -> dict[str, Answer]:
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0)

    async def nothing() -> None:
        pass

    try:
        answers = await asyncio.gather(*(run(client, Answer(kind), cut or nothing)
                                         for kind in KINDS))
    finally:
        await client.close()
    return {a.kind: a for a in answers}


@dataclass
class CutMidStream:
    """Cuts ``victim``'s streams (``act``) the moment fairgate has relayed some, not all,
    of a stream's tokens there, by the gateway's own record of its running requests."""

    gw: GatewayServer
    victim: str
    act: Callable[[], object]
    at_cut: int | None = None  # streams with output on the victim then

    async def __call__(self) -> None:
        if self.at_cut is not None:
            return
        entries = self.gw.services.running.entries(self.victim)
        there = [e for e in entries if 0 < e.generated < MAX_TOKENS and e.movable]
        # as many as can be cut at once: every stream there has output, or one is half done
        if there and (len(there) == len(entries)
                      or any(e.generated > MAX_TOKENS // 2 for e in there)):
            self.act()
            self.at_cut = len(there)


@dataclass
class Servers:
    launched: list[Launched]
    factory: tuple[Any, Any, pytest.TempPathFactory]

    def kill(self, i: int) -> None:
        os.killpg(self.launched[i].proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def two_tool_servers(request: pytest.FixtureRequest,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    if skip_requested():
        pytest.skip("FAIRGATE_SKIP_VLLM=1")
    python = request.getfixturevalue("vllm_python")
    model_dir = request.getfixturevalue("tiny_model_dir")
    servers = Servers([launch(python, model_dir, tmp_path_factory, 8, SERVER_ARGS,
                              SERVER_NICE) for _ in range(2)],
                      (python, model_dir, tmp_path_factory))
    try:
        for s in servers.launched:
            wait_healthy(s)
        yield servers
    finally:
        for s in servers.launched:
            _stop(s.proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.proc.wait(timeout=10)


@contextlib.asynccontextmanager
async def tool_gateway(redis_url: str, servers: Servers) -> AsyncIterator[GatewayServer]:
    async with gateway(redis_url, [s.server for s in servers.launched]) as gw:
        yield gw


def check(got: dict[str, Answer], want: dict[str, Answer], what: str) -> None:
    for kind, reference in want.items():
        answer = got[kind]
        assert answer.error is None, (what, kind, answer.error)
        assert answer.same() == reference.same(), (what, kind, answer.same(),
                                                    reference.same())
        assert len(answer.ids) == 1, (what, kind, answer.ids)  # one answer, one id


def check_reference(want: dict[str, Answer]) -> None:
    for kind, answer in want.items():
        assert answer.error is None and answer.usage is not None, (kind, answer)
    # a tool call streamed: the parser state is what a replay rebuilds
    for kind in ("required", "named"):
        assert want[kind].calls and all(c[0] and c[1] for c in want[kind].calls.values()), (
            kind, want[kind].calls)
    assert want["json_schema"].content.startswith("{"), want["json_schema"].content[:40]


async def test_replayed_streams_survive_a_move_and_a_kill_exactly(
        two_tool_servers: Servers, redis: aioredis.Redis, redis_url: str) -> None:
    async with tool_gateway(redis_url, two_tool_servers) as gw:
        want = await all_kinds(gw)
        check_reference(want)
        await settled(gw, "tiny")
        running = gw.services.running
        for _ in range(ATTEMPTS):
            mover = CutMidStream(gw, "cpu1", lambda: running.move_backend("cpu1", "drain"))
            moved = await all_kinds(gw, mover)
            await settled(gw, "tiny")
            check(moved, want, "moved")
            if mover.at_cut:
                break
        assert mover.at_cut, f"in {ATTEMPTS} runs no stream had output on cpu1 mid-answer"
        drained = await gateway_counter(gw, "fairgate_continuations_total", reason="drain",
                                        outcome="continued")
        assert drained >= 1, drained
        for _ in range(ATTEMPTS):
            killer = CutMidStream(gw, "cpu1", lambda: two_tool_servers.kill(1))
            killed = await all_kinds(gw, killer)
            await settled(gw, "tiny")
            check(killed, want, "killed")
            if killer.at_cut:
                break
        assert killer.at_cut, f"in {ATTEMPTS} runs no stream had output on cpu1 mid-answer"
        continued = await gateway_counter(gw, "fairgate_continuations_total",
                                          reason="failover", outcome="continued")
        failed = await gateway_counter(gw, "fairgate_continuations_total",
                                       reason="failover", outcome="failed")
        recomputed = await gateway_counter(
            gw, "fairgate_continuation_recomputed_tokens_total", reason="failover")
    print(f"replay on real vLLM: moved {mover.at_cut} ({drained:.0f} continued), killed "
          f"with {killer.at_cut} streaming ({continued:.0f} continued, {failed:.0f} "
          f"failed, {recomputed:.0f} tokens recomputed); load {os.getloadavg()[0]:.2f}")
    assert continued >= 1 and failed == 0, (continued, failed)
    assert recomputed > 0, recomputed
