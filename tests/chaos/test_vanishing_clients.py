"""200 streaming clients that hang up at random points (queued, mid-stream, or never):
the backend sees an abort for every stream cut short, nothing runs on for nobody, and
every counter in Redis returns to zero."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import aiohttp

from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, assert_settled, until

CLIENTS = 200
SEED = 7


async def client(session: aiohttp.ClientSession, url: str, i: int, leave_after: int | None,
                 ) -> str:
    """Reads ``leave_after`` frames then hangs up (None: reads to the end)."""
    body = {"model": MODEL, "prompt": f"p{i}", "max_tokens": 40, "ignore_eos": True,
            "stream": True}
    key = ("sk-alice", "sk-bob", "sk-carol")[i % 3]
    async with session.post(url + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status == 200
        frames = 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                frames += 1
                if leave_after is not None and frames >= leave_after:
                    return "left_mid_stream"
            if line.startswith(b"data: [DONE]"):
                return "done"
    return "truncated"


async def test_vanishing_clients_leave_nothing_behind(sim: SimFactory,
                                                      gateway: GatewayFactory) -> None:
    backend = await sim(max_num_seqs=16)
    gw = await gateway([backend])
    rng = random.Random(SEED)
    async with aiohttp.ClientSession() as session:
        tasks, plans = [], []
        for i in range(CLIENTS):
            plan = rng.choice(["queued", "mid_stream", "stay"])
            leave = rng.randint(1, 30) if plan == "mid_stream" else None
            task = asyncio.create_task(client(session, gw.url, i, leave))
            tasks.append(task)
            plans.append(plan)
        await until(lambda: len(gw.services.dispatcher.waiters) >= 20, "clients queued")
        for task, plan in zip(tasks, plans, strict=True):
            if plan == "queued" and not task.done():
                task.cancel()  # hangs up while queued (or just after its first bytes)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    outcome = Counter(r if isinstance(r, str) else "cancelled" for r in results)
    assert outcome["truncated"] == 0, outcome  # a stream that ran to the end got [DONE]
    await assert_settled(gw)  # in-flight and queue counters back to zero
    engine = backend.engine
    await until(lambda: engine.num_running == 0 and engine.num_waiting == 0,
                "the backend idle")
    records = list(engine.records.values())
    aborted = sum(r.aborted for r in records)
    finished = sum(r.finished_s is not None and not r.aborted for r in records)
    assert aborted + finished == len(records)  # every request the backend got has ended
    assert finished >= outcome["done"], (finished, outcome)
    # each client that hung up mid-stream aborted its request, unless the backend had
    # just finished it
    assert aborted >= outcome["left_mid_stream"] - (finished - outcome["done"]), outcome
    assert len(records) <= CLIENTS  # nothing sent twice
    print(f"SCENARIO vanishing_clients: sent={CLIENTS} {dict(outcome)} "
          f"backend_aborted={aborted} backend_finished={finished}")
