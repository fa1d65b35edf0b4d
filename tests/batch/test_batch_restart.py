"""Kill the gateway mid-batch, start it again: the batch completes, nothing lost or doubled."""

from __future__ import annotations

import asyncio
import json
import signal
from collections import defaultdict
from pathlib import Path
from typing import Any

import openai
import redis.asyncio as aioredis

from gateway.storage.keys import BatchKeys
from tests.gateway.conftest import SimFactory
from tests.processes import FAST, batch_file, replica_config, start_gateway, wait_ready

LINES = 60


async def test_batch_survives_a_killed_gateway(sim: SimFactory, redis: aioredis.Redis,
                                               redis_url: str, tmp_path: Path) -> None:
    backend = await sim(max_num_seqs=16)
    config, port = replica_config(tmp_path, "data", redis_url, [backend.url])
    c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-batch",
                           max_retries=0)
    first = await start_gateway(config, port, FAST)
    try:
        await wait_ready(c)
        f = await c.files.create(file=("in.jsonl", batch_file(LINES, lambda i: 40 + i)),
                                 purpose="batch")
        batch = await c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                       completion_window="24h")
        out_key = BatchKeys(batch.id).out
        for _ in range(3000):  # until a quarter of the lines are done
            if await redis.hlen(out_key) >= LINES // 4:
                break
            await asyncio.sleep(0.005)
    finally:
        first.send_signal(signal.SIGKILL)
        await first.wait()
    recorded_before = {int(cid.split("-")[1]) for cid in await redis.hkeys(out_key)}
    assert LINES // 4 <= len(recorded_before) < LINES, recorded_before

    restarted_at = asyncio.get_running_loop().time()  # the simulator's clock
    second = await start_gateway(config, port, FAST)
    try:
        await wait_ready(c)
        final: Any = None
        for _ in range(1200):
            final = await c.batches.retrieve(batch.id)
            if final.status in {"completed", "failed"}:
                break
            await asyncio.sleep(0.05)
        assert final is not None and final.status == "completed", final
        assert final.request_counts.completed == LINES and final.request_counts.failed == 0
        text = (await c.files.content(final.output_file_id)).text
    finally:
        second.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(second.wait(), 30) == 0
        await c.close()

    custom_ids = [json.loads(x)["custom_id"] for x in text.splitlines()]
    assert custom_ids == [f"line-{i}" for i in range(LINES)]  # all there, once, in order
    runs: dict[int, list[float]] = defaultdict(list)
    for r in backend.engine.records.values():
        if r.finished_s is not None and not r.aborted:
            runs[r.max_tokens - 40].append(r.finished_s)
    assert set(runs) == set(range(LINES))  # every line ran to completion
    twice = {i: len(t) for i, t in runs.items() if len(t) > 1}
    # A line runs again only when its first answer died with the killed gateway: it
    # finished at the backend before the restart but was not in Redis yet. How many were
    # in that window depends on the machine's load (4 on a loaded run), not on a bound.
    lost_with_the_kill = {i for i in twice
                          if i not in recorded_before and min(runs[i]) <= restarted_at}
    assert set(twice) == lost_with_the_kill and set(twice.values()) <= {2}, (
        f"ran more than once: {twice}; recorded before the kill: {sorted(recorded_before)}")
