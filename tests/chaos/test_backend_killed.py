"""One of a model's two backends (a real process) SIGKILLed mid-stream.

Its streams continue on the other backend from the tokens they had (each ends with
exactly the text of an uninterrupted run); requests not yet sent, and those whose
connection failed before anything was sent, go to the other backend; its gates close at
once and reopen when it returns. No request hangs, none ends with an error."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from gateway.core.settings import Backend
from gateway.http.server import GatewayServer
from gateway.storage.embedded_redis import die_with_parent, free_port
from tests.gateway.conftest import MODEL, assert_settled, gateway_settings

STREAMS = 24
REOPEN_TIMEOUT_S = 60.0  # a restarted backend's gate opens again within this


async def start_sim(port: int) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest", "sim", "--port", str(port), "--model", MODEL,
        "--max-num-seqs", "4", "--scheduling-policy", "priority",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=die_with_parent)
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    assert re.search(r"on http://\S+", line), line
    return proc


@dataclass
class Outcome:
    status: int | None = None  # None: hung
    done: bool = False  # reached [DONE]
    error_event: bool = False  # ended with an OpenAI error (event, or a non-200 answer)
    tokens: int = 0
    text: str = ""


def body_of(i: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"p{i}", "max_tokens": 200 + i, "ignore_eos": True,
            "temperature": 0}


async def reference(session: aiohttp.ClientSession, url: str, i: int,
                    body: dict[str, Any] | None = None) -> str:
    """The uninterrupted answer, straight from a simulator."""
    async with session.post(url + "/v1/completions", json=body or body_of(i)) as resp:
        return str((await resp.json())["choices"][0]["text"])


async def stream(session: aiohttp.ClientSession, url: str, i: int,
                 body: dict[str, Any] | None = None) -> Outcome:
    body = {**(body or body_of(i)), "stream": True}
    key = ("sk-alice", "sk-bob", "sk-carol")[i % 3]
    out = Outcome()
    try:
        async with asyncio.timeout(60):
            async with session.post(url + "/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {key}"}) as resp:
                out.status = resp.status
                if resp.status != 200:  # a clear error: OpenAI's format, an upstream code
                    error = (await resp.json())["error"]
                    out.error_event = error["type"] == "server_error" and bool(error["code"])
                    return out
                async for line in resp.content:
                    if line.startswith(b"data: [DONE]"):
                        out.done = True
                    elif line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            out.error_event = True
                        elif event.get("choices"):
                            out.tokens += 1
                            out.text += event["choices"][0]["text"]
    except TimeoutError:
        out.status = None
    return out


@asynccontextmanager
async def two_backends(redis_url: str
                       ) -> AsyncIterator[tuple[GatewayServer, list[int],
                                                list[asyncio.subprocess.Process]]]:
    """A gateway in front of two simulators, each a process of its own (``b0`` may be
    SIGKILLed and started again on its port); everything stopped at the end."""
    ports = [free_port(), free_port()]
    sims: list[asyncio.subprocess.Process] = []
    settings = gateway_settings(redis_url, [], scrape_interval_s=0.05)
    gw = GatewayServer(settings.model_copy(update={"backends": [
        Backend(name=f"b{i}", url=f"http://127.0.0.1:{p}", model=MODEL)
        for i, p in enumerate(ports)]}))
    try:
        sims += [await start_sim(p) for p in ports]
        await gw.start()
        for handle in gw.services.pool.handles.values():
            await asyncio.wait_for(handle.scraped.wait(), 30)
        yield gw, ports, sims
    finally:
        await gw.stop()
        for proc in sims:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_a_killed_backend_fails_over(redis: aioredis.Redis, redis_url: str) -> None:
    async with two_backends(redis_url) as (gw, ports, sims):
        pool = gw.services.pool
        async with aiohttp.ClientSession() as session:
            flood = [asyncio.create_task(stream(session, gw.url, i)) for i in range(STREAMS)]

            async def both_busy() -> bool:
                return all(h.last is not None and h.last.running >= 2
                           for h in pool.handles.values())

            for _ in range(3000):
                if await both_busy():
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("both backends never ran requests")
            sims[0].send_signal(signal.SIGKILL)
            await sims[0].wait()
            killed_at = time.monotonic()
            b0 = pool.handles["b0"]
            while b0.gates_at(time.time(), 1.0)["interactive"].open:
                assert time.monotonic() - killed_at < 20, "b0's gate stayed open 20 s"
                await asyncio.sleep(0.005)
            closed_after = time.monotonic() - killed_at
            # closed because the kill was seen (a failed stream or scrape), not only
            # because its last snapshot aged: it is marked unhealthy
            while b0.healthy:
                assert time.monotonic() - killed_at < 20, "b0 not marked unhealthy in 20 s"
                await asyncio.sleep(0.005)
            outcomes = await asyncio.gather(*flood)
            wants = await asyncio.gather(*(reference(session, f"http://127.0.0.1:{ports[1]}",
                                                     i) for i in range(STREAMS)))
            sims[0] = await start_sim(ports[0])  # back on the same port
            # from the restart: the continuations, references and a simulator's start
            # took 30 s together at load 7 on 2 cores
            restarted_at = time.monotonic()
            while not b0.gates_at(time.time(), 1.0)["interactive"].open:
                assert time.monotonic() - restarted_at < REOPEN_TIMEOUT_S, (
                    f"b0's gate not open {REOPEN_TIMEOUT_S:.0f} s after its restart: "
                    f"healthy {b0.healthy}, failures {b0.failures}, gates "
                    f"{b0.gates_at(time.time(), 1.0)}, last snapshot {b0.last}")
                await asyncio.sleep(0.01)
        await assert_settled(gw)

    kinds = Counter("hung" if o.status is None else "ok" if o.done and o.text == want
                    else "clean_error" if o.error_event and not o.done else "other"
                    for o, want in zip(outcomes, wants, strict=True))
    metrics = gw.services.metrics
    continued = metrics.moves.continuations.labels("failover", "continued")._value.get()
    # grants: one per request, one per continuation, one more per request sent again
    dispatched = sum(metrics.dispatch.dispatches.labels(MODEL, b, "interactive")._value.get()
                     for b in ("b0", "b1"))
    # every stream completed with exactly the uninterrupted text: b0's continued on b1
    assert kinds["ok"] == STREAMS, (kinds, outcomes)
    assert continued >= 1, continued  # b0 held streams when it died
    print(f"SCENARIO backend_killed: sent={STREAMS} ok={kinds['ok']} "
          f"errored={kinds['clean_error'] + kinds['other']} hung={kinds['hung']} "
          f"continued={continued:.0f} dispatched_twice={dispatched - STREAMS - continued:.0f} "
          f"gate_closed_after_s={closed_after:.3f}")


async def test_a_stream_of_a_killed_backend_continues_on_an_idle_one(
        redis: aioredis.Redis, redis_url: str) -> None:
    """One stream of a long prompt, its backend killed. That backend's prefix index holds
    the prompt and, once the stream left it, it is no busier than the survivor: locality
    would leave the continuation for it (bounded-load affinity,
    ``locality_max_imbalance``). A backend that is down is never waited for: the
    continuation runs on the survivor at once (before, it waited out continue_wait_s,
    60 s, and the stream ended with an error event)."""
    body = {**body_of(0), "prompt": " ".join(f"word{n}" for n in range(200))}
    async with two_backends(redis_url) as (gw, ports, sims):
        pool = gw.services.pool
        async with aiohttp.ClientSession() as session:
            one = asyncio.create_task(stream(session, gw.url, 0, body))

            def running_on() -> list[int]:
                return [i for i, h in enumerate(pool.handles.values())
                        if h.last is not None and h.last.running]

            deadline = time.monotonic() + 30
            while not running_on():
                assert time.monotonic() < deadline, "the stream never ran in 30 s"
                await asyncio.sleep(0.005)
            [ran_on] = running_on()
            sims[ran_on].send_signal(signal.SIGKILL)
            await sims[ran_on].wait()
            killed_at = time.monotonic()
            outcome = await one
            ended_s = time.monotonic() - killed_at
            want = await reference(session, f"http://127.0.0.1:{ports[1 - ran_on]}", 0, body)
        await assert_settled(gw)
    continued = gw.services.metrics.moves.continuations.labels("failover", "continued")._value.get()
    assert outcome.done and outcome.text == want, (outcome, want, ended_s)
    assert continued == 1, (continued, ended_s)
    print(f"SCENARIO backend_killed_idle_survivor: sent=1 ok=1 continued={continued:.0f} "
          f"ended_after_kill_s={ended_s:.2f}")
