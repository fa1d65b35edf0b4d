"""Streams of the kinds a continuation once refused, continued on real vLLM (CPU, the tiny
model) through the ``openai`` SDK: ``stop`` strings (held-back text, a stop after the
seam, ``include_stop_str_in_output``, ``min_tokens``), log probabilities (completions'
``logprobs``, chat's ``logprobs``/``top_logprobs``) and ``echo``.

Twelve streams (each kind twice) through a gateway in front of the session's server and
the package's 4-slot one, at temperature 0: a reference run, then a run where the 4-slot
server is SIGKILLed (its process group) once a stream there has output, then a run where
every stream is moved (``RunningStreams.move``, the path preemption and a drain with
migrate take) once it has output. Each stream of the last two ends with exactly the
reference's text, ``finish_reason`` and usage, one id, and the same log-probability tokens
and text offsets; how far the log-probability values moved is printed (a continuation's
first token is computed in a prefill, not a decode step).

``suffix`` and ``prompt_logprobs`` are not here: vLLM 0.32 refuses a stream with
``prompt_logprobs`` (``test_vllm_refuses_what_is_never_streamed``), and ``suffix`` for
every model without a fill-in-the-middle renderer (the tiny model's case), so no such
stream runs; where vLLM renders a suffix, it is in the prompt's token ids a continuation
sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from gateway.http.server import GatewayServer
from gateway.proxy.completion_request import parse_body
from gateway.proxy.continuation import Progress
from gateway.proxy.endpoints import CHAT, COMPLETIONS
from gateway.proxy.moving import DRAIN
from tests.e2e_vllm.conftest import SharedServer, VllmServer
from tests.e2e_vllm.test_resumable_vllm import (
    KEYS,
    first_difference,
    gateway,
    gateway_counter,
    settled,
)

pytestmark = pytest.mark.vllm

TOKENS = 160  # each stream's max_tokens
MIN_TOKENS = 60  # the stop-string streams': their stop comes after the seam
CUT_AFTER = 1  # tokens a stream has generated when it is killed or moved
RUN_TIMEOUT_S = 120.0
ATTEMPTS = 3  # kill runs until a stream is running on the victim at the kill
NEVER = "@@@@"  # a stop string the tiny model's output never holds: text held back


@dataclass(frozen=True)
class Kind:
    name: str
    chat: bool
    args: dict[str, Any]  # SDK arguments beyond model, prompt/messages, max_tokens


def kinds(stops: dict[bool, str]) -> list[Kind]:
    """The kinds, ``stops``: a stop string (chat and completions) found in the reference
    output after MIN_TOKENS."""
    vllm_stop = {"min_tokens": MIN_TOKENS}
    return [
        Kind("completions stop", False, {"stop": [stops[False], NEVER],
                                         "extra_body": vllm_stop}),
        Kind("chat stop kept", True, {"stop": [stops[True]], "extra_body": {
            **vllm_stop, "include_stop_str_in_output": True}}),
        Kind("completions held back", False, {"stop": NEVER}),
        Kind("completions logprobs", False, {"logprobs": 2}),
        Kind("chat logprobs", True, {"logprobs": True, "top_logprobs": 2,
                                     "stop": [NEVER]}),
        Kind("completions echo", False, {"echo": True, "logprobs": 1}),
    ]


@dataclass
class Answer:
    """One streamed answer as the client read it."""

    text: str = ""
    finish: str | None = None
    usage: tuple[int, int] | None = None
    ids: set[str] = field(default_factory=set)
    tokens: list[str] = field(default_factory=list)  # log-probability tokens
    offsets: list[int] = field(default_factory=list)  # completions' text_offset
    logprobs: list[float | None] = field(default_factory=list)
    error: str | None = None


def sdk_args(model: str, kind: Kind, i: int) -> dict[str, Any]:
    args: dict[str, Any] = {"model": model, "max_tokens": TOKENS, "temperature": 0,
                            **kind.args}
    extra = {"ignore_eos": True, **args.pop("extra_body", {})}
    if kind.chat:
        args["messages"] = [{"role": "user", "content": f"question {i}: what comes next?"}]
    else:
        args["prompt"] = f"story {i}: the queue moved on"
    return {**args, "extra_body": extra}


def read_chunk(chunk: Any, chat: bool, out: Answer) -> bool:
    """Record one chunk; whether it carried content."""
    out.ids.add(chunk.id)
    if chunk.usage is not None:
        out.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    content = False
    for choice in chunk.choices:
        piece = choice.delta.content if chat else choice.text
        if piece:
            out.text += piece
            content = True
        if choice.finish_reason is not None:
            out.finish = choice.finish_reason
        lp = choice.logprobs
        if lp is None:
            continue
        if chat:
            for entry in lp.content or ():
                out.tokens.append(entry.token)
                out.logprobs.append(entry.logprob)
        else:
            out.tokens += lp.tokens or []
            out.offsets += lp.text_offset or []
            out.logprobs += lp.token_logprobs or []
    return content


async def run(client: openai.AsyncOpenAI, args: dict[str, Any], chat: bool,
              out: Answer, seen: asyncio.Event) -> Answer:
    try:
        async with asyncio.timeout(RUN_TIMEOUT_S):
            create = client.chat.completions.create if chat else client.completions.create
            stream: Any = await create(**args, stream=True,
                                       stream_options={"include_usage": True})
            async for chunk in stream:
                if read_chunk(chunk, chat, out):
                    seen.set()
    except (openai.APIError, TimeoutError) as exc:
        out.error = repr(exc)
    return out


async def run_all(gw: GatewayServer, model: str, ks: list[Kind],
                  watch: Any = None) -> list[Answer]:
    """Every kind twice through ``gw``, keys in turn; ``watch`` (a coroutine function
    of the gateway) runs beside them until they end."""
    clients = [openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=k, max_retries=0)
               for k in KEYS]
    answers = [Answer() for _ in range(2 * len(ks))]
    seen = asyncio.Event()
    watcher = None if watch is None else asyncio.create_task(watch(gw))
    try:
        await asyncio.gather(*(
            run(clients[i % len(KEYS)], sdk_args(model, ks[i // 2], i), ks[i // 2].chat,
                answers[i], seen) for i in range(len(answers))))
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        for c in clients:
            await c.close()
    return answers


def stop_after_min_tokens(text: str) -> str:
    """A stop string the answer holds only after its first MIN_TOKENS tokens: three
    characters from its last quarter (the tiny model repeats itself, so they come again
    soon after MIN_TOKENS)."""
    at = len(text) * 3 // 4
    return text[at:at + 3]


@pytest.fixture(scope="module")
def victim(request: pytest.FixtureRequest, four_slots: SharedServer) -> Iterator[SharedServer]:
    try:
        four_slots.get()
        yield four_slots
    finally:
        four_slots.release(request)


def compare(got: list[Answer], want: list[Answer], ks: list[Kind]) -> float:
    """Every answer equal to the reference's; the largest log-probability difference."""
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        name = f"stream {i} ({ks[i // 2].name})"
        assert g.error is None, (name, g.error)
        assert g.text == w.text, (
            f"{name}: {len(g.text)} chars vs the reference's {len(w.text)}; first "
            f"difference at {first_difference(g.text, w.text)}: {g.text!r} vs {w.text!r}")
        assert (g.finish, g.usage) == (w.finish, w.usage), (name, g.finish, g.usage,
                                                             w.finish, w.usage)
        assert len(g.ids) == 1, (name, g.ids)
        assert (g.tokens, g.offsets) == (w.tokens, w.offsets), (name, g.tokens, w.tokens,
                                                                g.offsets, w.offsets)
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            if a is not None and b is not None:
                worst = max(worst, abs(a - b))
    return worst


async def test_vllm_refuses_what_is_never_streamed(vllm_server: VllmServer) -> None:
    """``prompt_logprobs`` in a stream and a ``suffix`` without a fill-in-the-middle
    renderer: vLLM 0.32 answers 400 (``completion/protocol.py``: "`prompt_logprobs` are
    not available when `stream=True`"; ``renderers/online_renderer.py``: "suffix is only
    supported for models with FIM completion rendering")."""
    base = {"model": vllm_server.model, "prompt": "x", "max_tokens": 2, "stream": True}
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as http:
        for extra, param in (({"prompt_logprobs": 1}, "prompt_logprobs"),
                             ({"suffix": "end"}, "suffix")):
            resp = await http.post("/v1/completions", json={**base, **extra})
            assert resp.status_code == 400, (extra, resp.status_code, resp.text)
            assert resp.json()["error"]["param"] == param, resp.text


async def test_every_kind_survives_a_kill_and_a_move(
        victim: SharedServer, vllm_server: VllmServer, redis: aioredis.Redis,
        redis_url: str) -> None:
    started = time.monotonic()
    servers = [vllm_server, victim.get()]
    model = vllm_server.model
    plain = [Kind("plain", chat, {}) for chat in (False, True)]
    async with gateway(redis_url, servers) as gw:
        probe = await run_all(gw, model, plain)
        stops = {False: stop_after_min_tokens(probe[0].text),
                 True: stop_after_min_tokens(probe[2].text)}
        ks = kinds(stops)
        reference = await run_all(gw, model, ks)
        await settled(gw, model)
        for i, want in enumerate(reference):
            assert want.error is None and want.usage is not None, (i, want)
        assert reference[0].finish == "stop" and reference[2].finish == "stop", (
            stops, reference[0], reference[2])
        assert all(0 < len(reference[i].tokens) for i in range(6, 12)), reference[6:]
        # the echo fairgate puts back (it asks for the ids, with which vLLM echoes none)
        # is vLLM's own echo
        direct = openai.AsyncOpenAI(base_url=vllm_server.url + "/v1", api_key="x")
        want_echo = Answer()
        await run(direct, sdk_args(model, ks[5], 10), False, want_echo, asyncio.Event())
        await direct.close()
        assert reference[10].text == want_echo.text, (reference[10].text, want_echo.text)

        moved = await run_all(gw, model, ks, move_every_stream)
        await settled(gw, model)
        drained = await gateway_counter(gw, "fairgate_continuations_total", reason=DRAIN,
                                        outcome="continued")
        worst_moved = compare(moved, reference, ks)

        kill = Killer(victim)
        for _ in range(ATTEMPTS):
            killed = await run_all(gw, model, ks, kill.watch)
            await settled(gw, model)
            if kill.on_victim:
                break
            compare(killed, reference, ks)  # nothing was cut: still the reference's
        assert kill.on_victim, "no stream was running on the 4-slot server at a kill"
        await asyncio.to_thread(victim.launched.proc.wait, 30)  # type: ignore[union-attr]
        continued = await gateway_counter(gw, "fairgate_continuations_total",
                                          reason="failover", outcome="continued")
        failed = await gateway_counter(gw, "fairgate_continuations_total",
                                       reason="failover", outcome="failed")
        worst_killed = compare(killed, reference, ks)
    print(f"kinds on real vLLM: {drained:.0f} moved and continued; {kill.on_victim} on the "
          f"killed server, {continued:.0f} continued ({failed:.0f} failed); log-probability "
          f"values off by at most {worst_moved:.2e} (moved), {worst_killed:.2e} (killed); "
          f"load {os.getloadavg()[0]:.2f}; {time.monotonic() - started:.1f} s")
    assert drained >= len(reference) - 2, (drained, len(reference))
    assert continued >= kill.on_victim and failed == 0, (continued, failed, kill.on_victim)


async def move_every_stream(gw: GatewayServer) -> None:
    """Move each stream once it has output (every millisecond, until cancelled)."""
    running, asked = gw.services.running, set()
    while True:
        for entry in running.entries():
            if (entry.request_id not in asked and entry.generated >= CUT_AFTER
                    and entry.movable and running.move(entry.request_id, DRAIN)):
                asked.add(entry.request_id)
        await asyncio.sleep(0.001)


@dataclass
class Killer:
    """SIGKILLs the victim's process group once a stream there has output."""

    victim: SharedServer
    on_victim: int = 0

    async def watch(self, gw: GatewayServer) -> None:
        running = gw.services.running
        while not self.on_victim:
            there = [e for e in running.entries("cpu1") if 0 < e.generated < TOKENS]
            if any(e.generated >= CUT_AFTER for e in there):
                assert self.victim.launched is not None
                os.killpg(self.victim.launched.proc.pid, signal.SIGKILL)
                self.on_victim = len(there)
            await asyncio.sleep(0.001)


async def events_of(http: httpx.AsyncClient, path: str, body: dict[str, Any]
                    ) -> list[dict[str, Any]]:
    """A stream's events straight from vLLM."""
    out = []
    async with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


def outcome(events: list[dict[str, Any]], chat: bool) -> tuple[str, Any, Any, Any]:
    text, finish, stop_reason, usage = "", None, None, None
    for event in events:
        for choice in event["choices"]:
            text += (choice["delta"].get("content") if chat else choice.get("text")) or ""
            if choice.get("finish_reason") is not None:
                finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
        usage = event.get("usage") or usage
    return text, finish, stop_reason, usage


async def test_a_stop_string_stream_cut_after_every_frame_ends_as_vllm_s(
        vllm_server: VllmServer) -> None:
    """Completions, chat, and completions keeping the stop string: a stream cut after
    each of its token frames in turn and continued by token ids on real vLLM, the seam's
    text from its ``/detokenize``: each time exactly vLLM's uninterrupted text,
    ``finish_reason``, ``stop_reason`` and usage. The stop string begins inside a token,
    so the cut after that token (when vLLM sent it in a frame of its own) ends inside the
    stop string: the held-back text begins it, the continuation's text completes it, and
    fairgate ends the answer there."""
    across = [await cut_everywhere(vllm_server, chat, include)
              for chat, include in ((False, False), (True, False), (False, True))]
    print(f"stop strings across the seam on real vLLM: {across} (completions, chat, kept)")
    assert sum(across) >= 1, across


async def cut_everywhere(vllm_server: VllmServer, chat: bool, include: bool) -> int:
    """The cuts of one stream; how many ended the answer across the seam."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": vllm_server.model, "max_tokens": 24, "temperature": 0,
                            "ignore_eos": True, "stream": True, "return_token_ids": True,
                            "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "where does it stop?"}]} if chat
                else {"prompt": "story 3: where does it stop?"})
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as http:
        pieces = [(c["delta"].get("content") if chat else c["text"]) or ""
                  for e in await events_of(http, path, body) for c in e["choices"]
                  if c.get("token_ids")]
        # the last two characters of a token (of three or more: the stop string begins
        # inside it) and up to two of the next. No min_tokens here: a stop across the seam
        # completed in a chunk of several tokens that straddles min_tokens is judged by the
        # chunk's last token (docs/reliability.md), which a merged chunk can make differ
        j = next(i for i in range(len(pieces) - 1) if len(pieces[i]) >= 3 and pieces[i + 1])
        body.update(stop=[pieces[j][-2:] + pieces[j + 1][:2], NEVER],
                    include_stop_str_in_output=include)
        reference = await events_of(http, path, body)
        want = outcome(reference, chat)
        assert want[1] == "stop", (pieces, want)
        creq = parse_body({k: v for k, v in body.items() if k != "return_token_ids"},
                          CHAT if chat else COMPLETIONS)
        token_frames = [i for i, e in enumerate(reference)
                        if any(c.get("token_ids") for c in e["choices"])]
        across = 0  # cuts where fairgate found the stop string across the seam
        for k in token_frames[:-1]:
            progress = Progress.of(creq)
            assert progress is not None
            got = [progress.original(json.loads(json.dumps(e))) for e in reference[:k + 1]]
            texts = []
            for ids in progress.seam_ids():
                resp = await http.post("/detokenize", json={"model": vllm_server.model,
                                                            "tokens": ids})
                texts.append(resp.json()["prompt"])
            assert progress.seam_at(*texts), (k, texts)
            for event in await events_of(http, "/v1/completions",
                                         progress.continuation_body(creq, True)):
                got.append(progress.continued(event))
                if progress.cut:
                    got += progress.closing(True)
                    across += 1
                    break
            assert outcome(got, chat) == want, (k, outcome(got, chat), want)
    return across
