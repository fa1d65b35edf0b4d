"""Redis SIGKILLed under a flood, then restarted empty or from its AOF; and Redis
frozen (SIGSTOP) under the same flood, then resumed.

Every request sent is counted: answered OK, answered with a clear error (a status and an
OpenAI error body), or hung (no answer within its bound: must be none). Queued clients
get a 503 ``queue_store_unavailable`` with Retry-After at once; streams already running
finish; the gateway serves again right after Redis returns, without a restart; and the
in-flight counters in Redis return to zero (settles that failed during the outage are
retried, or reconciled against what the replica really holds).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.http.server import GatewayServer
from gateway.storage.embedded_redis import EmbeddedRedis
from gateway.storage.keys import ModelKeys
from tests.gateway.conftest import MODEL, SimFactory, gateway_settings

STREAMS, USERS = 24, ("sk-alice", "sk-bob", "sk-carol")
# hung: nothing from a stream for STALLED_AFTER_S, or no end within HUNG_AFTER_S. A stream
# that crawls on a loaded machine is not hung (CI, load 10: 155 of 200 tokens in 30 s, at
# ~5 tokens/s, was once counted hung under a 30 s bound on the whole answer)
STALLED_AFTER_S, HUNG_AFTER_S = 10.0, 120.0


@dataclass
class Outcome:
    status: int | None  # None: hung
    code: str | None = None
    tokens: int = 0
    done: bool = False  # a stream that reached [DONE]
    answered_at: float = 0.0
    retry_after: str | None = None
    max_tokens: int = 0


async def stream(session: aiohttp.ClientSession, url: str, key: str, i: int) -> Outcome:
    body = {"model": MODEL, "prompt": f"p{i}", "max_tokens": 200 + i, "ignore_eos": True,
            "stream": True}
    out = Outcome(None, max_tokens=200 + i)
    try:
        async with asyncio.timeout(HUNG_AFTER_S):
            async with session.post(url + "/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {key}"}) as resp:
                if resp.status != 200:
                    error = (await resp.json())["error"]
                    return Outcome(resp.status, error["code"], answered_at=time.monotonic(),
                                   retry_after=resp.headers.get("Retry-After"))
                out = Outcome(200, answered_at=time.monotonic(), max_tokens=200 + i)
                while line := await asyncio.wait_for(resp.content.readline(),
                                                     STALLED_AFTER_S):
                    if line.startswith(b"data: [DONE]"):
                        out.done = True
                    elif line.startswith(b"data: {"):
                        out.tokens += bool(json.loads(line[6:])["choices"])
                return out
    except TimeoutError:
        out.status = None  # hung; its tokens say where
        return out


async def until(predicate: object, what: str) -> None:
    await until_s(predicate, what, 30.0)


async def until_s(predicate: object, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} ({timeout_s:g} s)")
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("restart", ["empty", "aof"])
async def test_redis_killed_under_a_flood(sim: SimFactory, tmp_path: Path,
                                          restart: str) -> None:
    redis = EmbeddedRedis(data_dir=tmp_path / "redis", append_only=restart == "aof").start()
    backend = await sim(max_num_seqs=4)
    gw = GatewayServer(gateway_settings(redis.url, [backend]))
    await gw.start()
    for handle in gw.services.pool.handles.values():
        await handle.scraped.wait()
    dispatcher = gw.services.dispatcher
    probe = aioredis.Redis.from_url(redis.url, decode_responses=True)
    try:
        async with aiohttp.ClientSession() as session:
            flood = [asyncio.create_task(stream(session, gw.url, USERS[i % len(USERS)], i))
                     for i in range(STREAMS)]

            async def running_and_queued() -> bool:
                return backend.engine.num_running >= 2 and len(dispatcher.waiters) >= 5

            await until(running_and_queued, "streams running and clients queued")
            running_at_kill = sum(r.finished_s is None for r in backend.engine.records.values())
            redis.kill()
            killed_at = time.monotonic()

            async def nobody_queued() -> bool:
                return not dispatcher.waiters

            await until(nobody_queued, "queued clients answered")
            # off the event loop: the start polls with time.sleep, and the running streams'
            # relays share this loop
            redis = await asyncio.to_thread(EmbeddedRedis(
                port=redis.port, data_dir=redis.data_dir, append_only=restart == "aof").start)
            back_at = time.monotonic()
            after = await stream(session, gw.url, "sk-dflt", STREAMS)
            outcomes = await asyncio.gather(*flood)

        k = ModelKeys(MODEL)

        async def drained() -> bool:  # deferred settles retried, or reconciled
            return not await probe.exists(k.user_inflight, k.backend_inflight("b0"))

        await until(drained, "in-flight counters back to zero")
    finally:
        await probe.aclose()
        await gw.stop()
        redis.stop()

    counts = Counter("hung" if o.status is None else "ok" if o.status == 200 and o.done
                     else "clear_error" if o.code else "other" for o in outcomes)
    assert counts["hung"] == 0 and counts["other"] == 0, (counts, outcomes)
    errors = [o for o in outcomes if o.code]
    assert errors and all(o.status == 503 and o.code == "queue_store_unavailable"
                          and o.retry_after for o in errors), errors
    # answered promptly, not at the 5 s lost-check: ~0.95 s measured on a quiet machine,
    # 1.8 s once under a loaded CI run (a bound, not a speed target: those live in bench)
    assert max(o.answered_at for o in errors) - killed_at < 3.0, counts
    # the streams running at the kill all finished, with every token
    ok = [o for o in outcomes if o.status == 200]
    assert len(ok) >= running_at_kill and all(o.tokens == o.max_tokens for o in ok), ok
    assert after.status == 200 and after.done, after  # served right after the restart
    assert after.answered_at - back_at < 2.0
    ran = Counter(r.max_tokens for r in backend.engine.records.values()
                  if r.finished_s is not None and not r.aborted)
    assert all(n == 1 for n in ran.values()), ran  # nothing ran twice
    print(f"SCENARIO redis_killed_{restart}: sent={STREAMS + 1} ok={counts['ok'] + 1} "
          f"clear_error={counts['clear_error']} hung={counts['hung']} "
          f"duplicated={sum(n - 1 for n in ran.values())} lost=0 "
          f"error_after_s={max(o.answered_at for o in errors) - killed_at:.2f} "
          f"served_after_restart_s={after.answered_at - back_at:.2f}")


async def test_redis_frozen_under_a_flood(sim: SimFactory, tmp_path: Path) -> None:
    """Redis SIGSTOPped under the same flood, then resumed: a store that keeps every
    connection open and answers nothing (a frozen process, a node cut off without a
    reset). Each command fails after ``redis_socket_timeout_s`` instead of waiting
    forever: queued clients and a newcomer get the 503 of a store that is down, running
    streams finish, and once Redis runs again (executing what it had buffered: commands
    whose callers already gave up) the gateway serves, nothing runs twice, and the
    in-flight counters return to zero."""
    socket_timeout_s = 2.0
    redis = EmbeddedRedis(data_dir=tmp_path / "redis").start()
    assert redis.process is not None
    backend = await sim(max_num_seqs=4)
    gw = GatewayServer(gateway_settings(redis.url, [backend],
                                        redis_socket_timeout_s=socket_timeout_s))
    await gw.start()
    for handle in gw.services.pool.handles.values():
        await handle.scraped.wait()
    dispatcher = gw.services.dispatcher
    probe = aioredis.Redis.from_url(redis.url, decode_responses=True)
    frozen = False
    try:
        async with aiohttp.ClientSession() as session:
            flood = [asyncio.create_task(stream(session, gw.url, USERS[i % len(USERS)], i))
                     for i in range(STREAMS)]

            async def running_and_queued() -> bool:
                return backend.engine.num_running >= 2 and len(dispatcher.waiters) >= 5

            await until(running_and_queued, "streams running and clients queued")
            running_at_freeze = sum(r.finished_s is None
                                    for r in backend.engine.records.values())
            redis.process.send_signal(signal.SIGSTOP)
            frozen, frozen_at = True, time.monotonic()
            newcomer = await stream(session, gw.url, "sk-dflt", STREAMS)

            async def nobody_queued() -> bool:
                return not dispatcher.waiters

            await until_s(nobody_queued, "queued clients answered", 60.0)
            answered_s = time.monotonic() - frozen_at
            redis.process.send_signal(signal.SIGCONT)
            frozen, back_at = False, time.monotonic()
            after = await stream(session, gw.url, "sk-dflt", STREAMS + 1)
            outcomes = await asyncio.gather(*flood)

        k = ModelKeys(MODEL)

        async def drained() -> bool:  # deferred settles retried, or reconciled
            return not await probe.exists(k.user_inflight, k.backend_inflight("b0"))

        await until_s(drained, "in-flight counters back to zero", 60.0)
        # every loop rode the outage out (a StoreUnavailable it let through restarts it,
        # logged as a crash)
        registry = gw.services.metrics.registry
        restarts = {m.labels["loop"]: m.value for metric in registry.collect()
                    if metric.name == "fairgate_loop_restarts"
                    for m in metric.samples if m.name.endswith("_total") and m.value}
    finally:
        if frozen:
            redis.process.send_signal(signal.SIGCONT)
        await probe.aclose()
        await gw.stop()
        redis.stop()

    counts = Counter("hung" if o.status is None else "ok" if o.status == 200 and o.done
                     else "clear_error" if o.code else "other" for o in outcomes)
    assert counts["hung"] == 0 and counts["other"] == 0, (counts, outcomes)
    assert newcomer.status == 503 and newcomer.code == "queue_store_unavailable", newcomer
    errors = [o for o in outcomes if o.code]
    assert errors and all(o.status == 503 and o.code == "queue_store_unavailable"
                          and o.retry_after for o in errors), errors
    # a bound, not a speed target: each client's command fails after one socket timeout
    # (2 s here); the old client, with no timeout, never answered
    assert answered_s < 10 * socket_timeout_s, (answered_s, counts)
    ok = [o for o in outcomes if o.status == 200]
    assert len(ok) >= running_at_freeze and all(o.tokens == o.max_tokens for o in ok), ok
    assert after.status == 200 and after.done, after  # served once Redis runs again
    assert not restarts, f"loops restarted during the freeze: {restarts}"
    ran = Counter(r.max_tokens for r in backend.engine.records.values()
                  if r.finished_s is not None and not r.aborted)
    assert all(n == 1 for n in ran.values()), ran  # nothing ran twice
    print(f"SCENARIO redis_frozen: sent={STREAMS + 2} ok={counts['ok'] + 1} "
          f"clear_error={counts['clear_error'] + 1} hung={counts['hung']} "
          f"duplicated={sum(n - 1 for n in ran.values())} "
          f"queued_answered_after_s={answered_s:.2f} "
          f"newcomer_answered_after_s={newcomer.answered_at - frozen_at:.2f} "
          f"served_after_resume_s={after.answered_at - back_at:.2f}")
