"""The store behind Redis Sentinel (a master, a replica and three sentinels: real
``valkey-server`` processes on loopback), its master SIGKILLed under load.

Every request sent is counted: answered OK, answered with a clear error, hung (no answer
within its bound: must be none), run twice at the backend (must be none: each request
has its own ``max_tokens``, the backend's record of it), lost (answered OK but never run:
must be none). Queued clients and newcomers wait through the failover (a pause, not a
503: ``store_failover_wait_s``), streams already running finish, a running batch records
every line exactly once, and the in-flight counters on the promoted master return to
zero.

The second test promotes a replica that missed the master's last writes (its replication
link frozen first, :class:`tests.sentinel_rig.LinkCut`): requests the new master forgot
are queued again with their arrival time, and requests it still queues although they
were granted already are not dispatched again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from gateway.http.server import GatewayServer
from gateway.storage.keys import BatchKeys, ModelKeys
from loadtest.sim.server import SimServer
from tests.gateway.conftest import MODEL, SimFactory, gateway_settings
from tests.processes import batch_file
from tests.sentinel_rig import PROMOTION_BOUND_S, SentinelRig

USERS = ("sk-alice", "sk-bob")  # the flood: two users
NEWCOMERS = ("sk-carol", "sk-dflt")  # arrive while the store is failing over
HUNG_AFTER_S = 150.0
BOUND_S = 60.0  # any wait for a condition below
# the gateway's wait for a new master: beyond the rig's bound on a promotion
# (PROMOTION_BOUND_S: on loaded machines one took more than 20 s, and 7 queued clients got
# their 503 first; another, beside a vLLM server compiling its kernels, more than 30 s)
FAILOVER_WAIT_S = PROMOTION_BOUND_S + 30.0


@dataclass
class Outcome:
    max_tokens: int
    status: int | None = None  # None: hung
    code: str | None = None
    tokens: int = 0
    done: bool = False
    answered_at: float = 0.0  # monotonic, when the status line arrived


async def stream(session: aiohttp.ClientSession, url: str, key: str,
                 max_tokens: int) -> Outcome:
    body = {"model": MODEL, "prompt": f"p{max_tokens}", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    out = Outcome(max_tokens)
    try:
        async with asyncio.timeout(HUNG_AFTER_S):
            async with session.post(url + "/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {key}"}) as resp:
                out.status, out.answered_at = resp.status, time.monotonic()
                if resp.status != 200:
                    out.code = (await resp.json())["error"]["code"]
                    return out
                async for line in resp.content:
                    if line.startswith(b"data: [DONE]"):
                        out.done = True
                    elif line.startswith(b"data: {"):
                        out.tokens += bool(json.loads(line[6:])["choices"])
    except TimeoutError:
        out.status = None
    return out


async def until(check: Any, what: str, timeout_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.fixture
async def rig() -> AsyncIterator[SentinelRig]:
    made = SentinelRig()
    try:
        yield made
    finally:
        await made.stop()


async def start_gateway(rig: SentinelRig, backend: SimServer) -> GatewayServer:
    gw = GatewayServer(gateway_settings(None, [backend], redis_sentinel=rig.config(),
                                        store_failover_wait_s=FAILOVER_WAIT_S))
    await gw.start()
    for handle in gw.services.pool.handles.values():
        await handle.scraped.wait()
    return gw


def ran_counts(backend: SimServer) -> Counter[int]:
    """How often the backend ran each request to its end (by the max_tokens its client
    asked for). A stream moved on purpose (fair preemption, on by default) or continued
    after a failure runs on as a continuation whose prompt holds the tokens generated so
    far and whose max_tokens is that much smaller: its max_tokens + prompt_tokens is its
    original's, whose run came first."""
    records = sorted(backend.engine.records.values(), key=lambda r: r.arrival_s)
    named: dict[int, int] = {}
    for r in records:
        named.setdefault(r.max_tokens + r.prompt_tokens, r.max_tokens)
    return Counter(named[r.max_tokens + r.prompt_tokens] for r in records
                   if r.finished_s is not None and not r.aborted)


def ran_at(backend: SimServer) -> set[int]:
    """The requests the backend has seen (by max_tokens)."""
    return {r.max_tokens for r in backend.engine.records.values()}


def tally(outcomes: list[Outcome]) -> Counter[str]:
    return Counter("hung" if o.status is None
                   else "ok" if o.status == 200 and o.done and o.tokens == o.max_tokens
                   else "clear_error" if o.code else "other" for o in outcomes)


async def converged(probe: aioredis.Redis) -> None:
    """In-flight counts and queue depths on the (promoted) master back to zero."""
    k = ModelKeys(MODEL)

    async def idle() -> bool:
        depth = await probe.hgetall(k.depth)
        return (not await probe.exists(k.user_inflight, k.backend_inflight("b0"))
                and all(int(v) == 0 for v in depth.values()))

    await until(idle, "in-flight counts and queue depths back to zero")


@pytest.mark.timeout(HUNG_AFTER_S + 90)
async def test_sentinel_master_killed_under_a_flood(sim: SimFactory,
                                                    rig: SentinelRig) -> None:
    await rig.start()
    backend = await sim(max_num_seqs=4)
    gw = await start_gateway(rig, backend)
    dispatcher = gw.services.dispatcher
    probe = rig.store_client()
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-batch", max_retries=0)
    lines = 40
    try:
        upload = await client.files.create(
            file=("in.jsonl", batch_file(lines, lambda i: 20 + i)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id,
                                            endpoint="/v1/completions",
                                            completion_window="24h")
        async with aiohttp.ClientSession() as session:
            flood = [asyncio.create_task(stream(session, gw.url, USERS[i % 2], 200 + i))
                     for i in range(24)]
            await until(lambda: backend.engine.num_running >= 2 and len(dispatcher.waiters) >= 5,
                        "streams running and clients queued")
            await until(lambda: probe.hlen(BatchKeys(batch.id).out), "a batch line done")
            rig.kill_master()
            killed_at, at_kill = time.monotonic(), ran_at(backend)
            newcomers = [asyncio.create_task(stream(session, gw.url, NEWCOMERS[i % 2], 240 + i))
                         for i in range(4)]
            promoted_at = await rig.until_promoted()
            outcomes = await asyncio.gather(*flood, *newcomers)
        final: Any = None
        for _ in range(int(BOUND_S / 0.05)):
            final = await client.batches.retrieve(batch.id)
            if final.status in {"completed", "failed", "expired", "cancelled"}:
                break
            await asyncio.sleep(0.05)
        assert final is not None and final.status == "completed", final
        texts = [(await client.files.content(fid)).text
                 for fid in (final.output_file_id, final.error_file_id) if fid]
        await converged(probe)
    finally:
        await client.close()
        await probe.aclose()
        await gw.stop()

    counts = tally(outcomes)
    assert counts["ok"] == len(outcomes), (counts, [o for o in outcomes if o.status != 200])
    ran = ran_counts(backend)
    # a batch line (max_tokens < 200) the backend had at the kill may run once more: its
    # result, written to the master just before, can be missing on the promoted replica
    # (replication is asynchronous; a clean run 2026-12-03 ran line 24 twice). Its output
    # holds it once all the same (checked below); nothing else may run twice, nothing 3 times.
    twice = {t: n for t, n in ran.items()
             if n > 2 or (n == 2 and not (t < 200 and t in at_kill))}
    assert not twice, f"run more than once at the backend: {twice}; at the kill: {at_kill}"
    lost = [o.max_tokens for o in outcomes if o.status == 200 and ran[o.max_tokens] == 0]
    assert not lost, f"answered but never run: {lost}"
    seen = Counter(json.loads(line)["custom_id"] for text in texts
                   for line in text.splitlines())
    assert set(seen) == {f"line-{i}" for i in range(lines)}, sorted(seen)
    assert all(n == 1 for n in seen.values()), seen.most_common(3)
    served = min(o.answered_at for o in outcomes if o.max_tokens not in at_kill)
    print(f"SCENARIO sentinel_failover: sent={len(outcomes)} ok={counts['ok']} "
          f"clear_error={counts['clear_error']} hung={counts['hung']} "
          f"duplicated={sum(n - 1 for n in ran.values())} lost={len(lost)} "
          f"promoted_after_s={promoted_at - killed_at:.2f} "
          f"served_after_kill_s={served - killed_at:.2f} batch_lines={lines} "
          f"recorded_once={len(seen)}")


@pytest.mark.timeout(HUNG_AFTER_S + 90)
async def test_promoted_replica_missing_the_last_writes(sim: SimFactory,
                                                        rig: SentinelRig) -> None:
    await rig.start(cut_link=True)
    assert rig.link is not None
    backend = await sim(max_num_seqs=3)
    gw = await start_gateway(rig, backend)
    dispatcher = gw.services.dispatcher
    probe = rig.store_client()
    try:
        async with aiohttp.ClientSession() as session:
            flood = [asyncio.create_task(stream(session, gw.url, USERS[i % 2], 100 + i))
                     for i in range(12)]
            await until(lambda: backend.engine.num_running >= 2 and len(dispatcher.waiters) >= 4,
                        "streams running and clients queued")
            rig.link.freeze()  # from here on the replica misses every write
            await probe.set("fg:lost-write-probe", "1")
            dispatched_at_freeze = len(backend.engine.records)
            late = [asyncio.create_task(stream(session, gw.url, NEWCOMERS[i % 2], 140 + i))
                    for i in range(4)]
            # granted after the freeze: the promoted replica still queues them
            await until(lambda: len(backend.engine.records) >= dispatched_at_freeze + 2,
                        "requests granted after the freeze")
            await until(lambda: sum(w.request.user in ("carol", "dave")
                                    for w in dispatcher.waiters.values()) >= 1,
                        "newcomers queued after the freeze")
            rig.kill_master()
            killed_at, at_kill = time.monotonic(), ran_at(backend)
            promoted_at = await rig.until_promoted()
            outcomes = await asyncio.gather(*flood, *late)
        missed = await probe.get("fg:lost-write-probe")
        await converged(probe)
    finally:
        await probe.aclose()
        await gw.stop()

    assert missed is None, "the promoted replica had the writes made after the freeze"
    counts = tally(outcomes)
    assert counts["ok"] == len(outcomes), (counts, [o for o in outcomes if o.status != 200])
    ran = ran_counts(backend)
    twice = {t: n for t, n in ran.items() if n > 1}
    assert not twice, f"run more than once at the backend: {twice}"
    lost = [o.max_tokens for o in outcomes if ran[o.max_tokens] == 0]
    assert not lost, f"answered but never run: {lost}"
    served = min(o.answered_at for o in outcomes if o.max_tokens not in at_kill)
    print(f"SCENARIO sentinel_lost_writes: sent={len(outcomes)} ok={counts['ok']} "
          f"clear_error={counts['clear_error']} hung={counts['hung']} "
          f"duplicated={sum(n - 1 for n in ran.values())} lost={len(lost)} "
          f"promoted_after_s={promoted_at - killed_at:.2f} "
          f"served_after_kill_s={served - killed_at:.2f}")
