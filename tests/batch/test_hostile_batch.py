"""Hostile batches (issue 10, items 1 and 11): every accepted line ends in the output or
the error file, whatever it contains, and the runner respects its user's queue cap by
feeding fewer lines, never by failing them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.http.server import GatewayServer
from tests.batch.test_batch_api import CHAT, client, jsonl, wait_status
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory

FINISHED = {"completed", "failed", "expired", "cancelled"}


def nested(depth: int) -> str:
    """JSON of a message content list nested ``depth`` deep around one text part (built
    as text: encoding it with ``json`` would itself hit the recursion limit)."""
    return "[" * (depth - 1) + '[{"type": "text", "text": "deep"}]' + "]" * (depth - 1)


def line(custom_id: str, content: str) -> str:
    head = json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT,
                       "body": {"model": MODEL, "max_tokens": 2,
                                "messages": [{"role": "user", "content": "@"}]}})
    return head.replace('"@"', content)


async def results(c: openai.AsyncOpenAI, batch: Any) -> dict[str, dict[str, Any]]:
    """custom_id → its result line, over the output and the error file."""
    found: dict[str, dict[str, Any]] = {}
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is None:
            continue
        for text in (await c.files.content(file_id)).text.splitlines():
            result = json.loads(text)
            assert result["custom_id"] not in found, "a line appears twice"
            found[result["custom_id"]] = result
    return found


async def run_batch(c: openai.AsyncOpenAI, data: bytes) -> Any:
    f = await c.files.create(file=("in.jsonl", data), purpose="batch")
    batch = await c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    return await wait_status(c, batch.id, FINISHED)


# --------------------------------------------------------------------------- item 1


@pytest.fixture
async def unbounded(sim: SimFactory, gateway: GatewayFactory, tmp_path: Path) -> GatewayServer:
    """No depth limit of fairgate's own: lines as deep as Python decodes are accepted (the
    upload is parsed in a worker thread, on a fresh stack), and must still get a result
    when the runner cannot encode them for the backend."""
    backend = await sim(profile="instant")
    return await gateway([backend], data_dir=tmp_path, batch_poll_s=0.05,
                         max_json_depth=100_000)


async def test_single_deeply_nested_line_ends_in_a_file(unbounded: GatewayServer) -> None:
    c = client(unbounded)
    try:
        done = await run_batch(c, (line("deep", nested(950)) + "\n").encode())
        assert done.status == "completed", done
        counts = done.request_counts
        assert counts is not None
        assert counts.total == 1 and counts.completed + counts.failed == 1, counts
        found = await results(c, done)
    finally:
        await c.close()
    assert set(found) == {"deep"}, done


async def test_every_accepted_line_ends_in_a_file(unbounded: GatewayServer) -> None:
    """Depths around the interpreter's recursion limit, mixed with ordinary lines."""
    depths = [1, 2, 100, 900, 930, 950, 970, 980]
    body = "".join(line(f"d{d}", nested(d)) + "\n" for d in depths)
    c = client(unbounded)
    try:
        done = await run_batch(c, body.encode())
        assert done.status == "completed", done
        counts = done.request_counts
        assert counts is not None
        assert counts.total == len(depths), counts
        assert counts.completed + counts.failed == len(depths), counts
        found = await results(c, done)
    finally:
        await c.close()
    assert set(found) == {f"d{d}" for d in depths}
    for d in (1, 2, 100):
        assert found[f"d{d}"]["response"]["status_code"] == 200, found[f"d{d}"]
    for result in found.values():  # a failed line says why, in OpenAI's shape
        if result["error"] is not None:
            assert result["error"]["code"] and result["error"]["message"], result
        else:
            body = result["response"]["body"]
            assert result["response"]["status_code"] == 200 or "error" in body, result
    # a line too deep to encode for the backend failed as a bad request, not a crash
    too_deep = found["d980"]
    assert too_deep["error"] == {"code": "invalid_request_error", "message":
                                 "request body is nested too deeply to be sent to the backend"}


# --------------------------------------------------------------------------- item 11


@pytest.fixture
async def capped(sim: SimFactory, gateway: GatewayFactory, tmp_path: Path) -> GatewayServer:
    """A user may queue 2 requests; a batch may have 64 lines in flight."""
    backend = await sim(profile="instant")
    return await gateway([backend], data_dir=tmp_path, batch_poll_s=0.05,
                         max_queued_per_user=2, batch_max_in_flight=64)


async def test_batch_respects_the_users_queue_cap(capped: GatewayServer) -> None:
    assert capped.services.batch_runner.feed_limit() == 2
    c = client(capped)
    try:
        done = await run_batch(c, jsonl(30))
        counts = done.request_counts
        found = await results(c, done)
    finally:
        await c.close()
    assert done.status == "completed", done
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (30, 30, 0)
    assert all(r["error"] is None for r in found.values())


async def test_concurrent_batches_wait_for_room_in_a_full_queue(capped: GatewayServer) -> None:
    """Two batches of one user each feed 2 lines into a queue capped at 2: lines that
    find it full wait for room instead of failing with queue_full."""
    c = client(capped)
    try:
        files = [await c.files.create(file=(f"in{i}.jsonl", jsonl(12)), purpose="batch")
                 for i in range(2)]
        batches = [await c.batches.create(input_file_id=f.id, endpoint=CHAT,
                                          completion_window="24h") for f in files]
        done = await asyncio.gather(*(wait_status(c, b.id, FINISHED) for b in batches))
        found = [await results(c, d) for d in done]
    finally:
        await c.close()
    for batch, lines in zip(done, found, strict=True):
        assert batch.status == "completed", batch
        counts = batch.request_counts
        assert counts is not None and (counts.completed, counts.failed) == (12, 0), counts
        assert all(r["error"] is None for r in lines.values())



async def test_a_revoked_keys_running_batch_is_cancelled_at_its_next_line(
        sim: SimFactory, gateway: GatewayFactory, tmp_path: Path) -> None:
    """The rule (issue 29, item 9): revoking the key that created a running batch cancels
    the batch at its next line; the lines that finished stay in its output file, the
    batch says why."""
    backend = await sim(max_num_seqs=2)
    gw = await gateway([backend], data_dir=tmp_path, batch_poll_s=0.05, batch_max_in_flight=2,
                       admin_keys=["sk-admin"], key_pepper="test-pepper")
    admin = {"Authorization": "Bearer sk-admin"}
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/admin/keys", headers=admin,
                             json={"user": "rita", "priority_class": "batch"}) as resp:
            created = await resp.json()
            assert resp.status == 201, created
        c = client(gw, created["key"])
        try:
            f = await c.files.create(file=("in.jsonl", jsonl(40, max_tokens=200)),
                                     purpose="batch")
            batch = await c.batches.create(input_file_id=f.id, endpoint=CHAT,
                                           completion_window="24h")
        finally:
            await c.close()
        engine = backend.engine
        await engine.wait_until(lambda: sum(r.finished_s is not None for r in
                                            engine.records.values()) >= 2)
        async with http.delete(gw.url + f"/admin/keys/{created['id']}",
                               headers=admin) as resp:
            assert resp.status == 200, await resp.text()

    async def final() -> dict[str, Any]:
        for _ in range(1200):
            found = await gw.services.batches.get("rita", batch.id)
            if found["status"] in FINISHED:
                return found
            await asyncio.sleep(0.05)  # polling, as an operator does
        raise AssertionError(f"the batch stayed {found['status']}")

    done = await final()
    assert done["status"] == "cancelled", done
    assert [e["code"] for e in done["errors"]["data"]] == ["api_key_revoked"], done
    completed = done["request_counts"]["completed"]
    assert 2 <= completed < 40, done["request_counts"]
    out = gw.services.files.path(done["output_file_id"]).read_text().splitlines()
    assert len(out) == completed, (len(out), completed)
