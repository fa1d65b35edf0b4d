"""The Batch API through the official openai SDK, on a real gateway + simulator."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.http.server import GatewayServer
from gateway.storage.keys import BatchKeys
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory

CHAT = "/v1/chat/completions"


def jsonl(n: int, url: str = CHAT, max_tokens: int = 3, **body: Any) -> bytes:
    lines = []
    for i in range(n):
        request: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens + i % 3,
                                   "ignore_eos": True, **body}
        if url == CHAT:
            request["messages"] = [{"role": "user", "content": f"question {i}"}]
        else:
            request["prompt"] = f"question {i}"
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url,
                                 "body": request}))
    return ("\n".join(lines) + "\n").encode()


def client(gw: GatewayServer, key: str = "sk-batch") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def wait_status(c: openai.AsyncOpenAI, batch_id: str, statuses: set[str],
                      limit_s: float = 60) -> Any:
    for _ in range(int(limit_s / 0.05)):
        batch = await c.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        await asyncio.sleep(0.05)  # polling, as an SDK user does
    raise AssertionError(f"batch stayed {batch.status}")


@pytest.fixture
async def gw(sim: SimFactory, gateway: GatewayFactory, tmp_path: Path) -> GatewayServer:
    backend = await sim(profile="instant")
    return await gateway([backend], data_dir=tmp_path, batch_poll_s=0.05)


async def test_sdk_end_to_end(gw: GatewayServer) -> None:
    c = client(gw)
    f = await c.files.create(file=("in.jsonl", jsonl(20)), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0
    assert (await c.files.retrieve(f.id)).filename == "in.jsonl"
    batch = await c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h",
                                   metadata={"job": "eval"})
    assert batch.status == "validating" and batch.metadata == {"job": "eval"}
    done = await wait_status(c, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (20, 20, 0)
    assert done.in_progress_at and done.completed_at and done.output_file_id
    assert done.error_file_id is None
    text = (await c.files.content(done.output_file_id)).text
    lines = [json.loads(x) for x in text.splitlines()]
    assert [x["custom_id"] for x in lines] == [f"req-{i}" for i in range(20)]
    for i, line in enumerate(lines):
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["usage"]["completion_tokens"] == 3 + i % 3
    assert (await c.files.content(f.id)).content == jsonl(20)
    registry = gw.services.metrics.registry
    assert registry.get_sample_value("fairgate_batch_requests_total",
                                     {"outcome": "completed"}) == 20
    assert registry.get_sample_value("fairgate_user_requests_total",
                                     {"model": MODEL, "user": "bert"}) == 20
    ids = [x.id for x in (await c.files.list()).data]
    assert f.id in ids and done.output_file_id in ids
    deleted = await c.files.delete(f.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        await c.files.retrieve(f.id)
    await c.close()


async def test_list_batches_paginates_newest_first(gw: GatewayServer) -> None:
    c = client(gw)
    f = await c.files.create(file=("in.jsonl", jsonl(1)), purpose="batch")
    made = [await c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
            for _ in range(3)]
    first = await c.batches.list(limit=2)
    assert [b.id for b in first.data] == [made[2].id, made[1].id] and first.has_more
    rest = await c.batches.list(limit=2, after=made[1].id)
    assert [b.id for b in rest.data] == [made[0].id] and not rest.has_more
    seen = [b.id async for b in await c.batches.list(limit=1)]  # SDK auto-pagination
    assert seen == [m.id for m in reversed(made)]
    for m in made:
        await wait_status(c, m.id, {"completed"})
    await c.close()


async def test_cancel_stops_promptly_with_partial_results(sim: SimFactory,
                                                          gateway: GatewayFactory,
                                                          tmp_path: Path) -> None:
    backend = await sim(max_num_seqs=2)
    gw = await gateway([backend], data_dir=tmp_path, batch_poll_s=0.05, batch_max_in_flight=2,
                       admin_keys=["sk-admin"])
    c = client(gw)
    f = await c.files.create(file=("in.jsonl", jsonl(40, max_tokens=200)), purpose="batch")
    batch = await c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    engine = backend.engine
    await engine.wait_until(lambda: sum(r.finished_s is not None for r in
                                        engine.records.values()) >= 2)
    cancelling = await c.batches.cancel(batch.id)
    assert cancelling.status in {"cancelling", "cancelled"}
    done = await wait_status(c, batch.id, {"cancelled"})
    assert done.cancelled_at and done.request_counts is not None
    assert 2 <= done.request_counts.completed < 40
    started_after_cancel = len(engine.records)
    await asyncio.sleep(0.3)  # nothing may start once the batch is cancelled
    assert len(engine.records) == started_after_cancel
    assert done.output_file_id
    out = (await c.files.content(done.output_file_id)).text.splitlines()
    assert len(out) == done.request_counts.completed
    await c.close()
    # usage: the lines the cancel cut count as cancelled, not as errors
    async with aiohttp.ClientSession() as http, http.get(
            gw.url + "/admin/usage?group_by=user",
            headers={"Authorization": "Bearer sk-admin"}) as resp:
        rows = (await resp.json())["data"]
    assert len(rows) == 1 and rows[0]["errors"] == 0, rows
    assert rows[0]["requests"] == done.request_counts.completed + rows[0]["cancelled"], rows
    assert rows[0]["cancelled"] >= 1, rows


@pytest.mark.parametrize(("content", "needle"), [
    (b'{"custom_id": "a", "method": "POST"\n', "line 1: the line is not valid JSON"),
    (jsonl(2).replace(b"req-1", b"req-0"), "duplicate custom_id 'req-0'"),
    (jsonl(1).replace(MODEL.encode(), b"gpt-9"), "model 'gpt-9' is not served here"),
    (jsonl(1).replace(b"/v1/chat/completions", b"/v1/moderations"), "'url' must be one of"),
    (jsonl(1).replace(b'"POST"', b'"GET"'), "'method' must be"),
    (b"\n\n", "has no requests"),
])
async def test_upload_rejects_bad_jsonl(gw: GatewayServer, content: bytes, needle: str) -> None:
    c = client(gw)
    with pytest.raises(openai.BadRequestError) as err:
        await c.files.create(file=("bad.jsonl", content), purpose="batch")
    assert needle in err.value.message
    assert (await c.files.list()).data == []  # nothing kept
    await c.close()


async def test_wrong_endpoint_and_oversize_file(sim: SimFactory, gateway: GatewayFactory,
                                                tmp_path: Path) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], data_dir=tmp_path, max_file_bytes=2000)
    c = client(gw)
    f = await c.files.create(file=("in.jsonl", jsonl(2)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as err:
        await c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                               completion_window="24h")
    assert "must match the batch endpoint" in err.value.message
    with pytest.raises(openai.BadRequestError):
        await c.batches.create(input_file_id=f.id, endpoint=CHAT,
                               completion_window="48h")  # type: ignore[arg-type]
    with pytest.raises(openai.APIStatusError) as big:
        await c.files.create(file=("big.jsonl", jsonl(40)), purpose="batch")
    assert big.value.status_code == 413
    with pytest.raises(openai.BadRequestError):
        await c.files.create(file=("x.jsonl", jsonl(1)), purpose="fine-tune")
    await c.close()


async def test_other_users_cannot_see_files_or_batches(gw: GatewayServer) -> None:
    owner, other = client(gw, "sk-batch"), client(gw, "sk-alice")
    f = await owner.files.create(file=("in.jsonl", jsonl(1)), purpose="batch")
    batch = await owner.batches.create(input_file_id=f.id, endpoint=CHAT,
                                       completion_window="24h")
    for call in (other.files.retrieve(f.id), other.files.content(f.id),
                 other.files.delete(f.id), other.batches.retrieve(batch.id),
                 other.batches.cancel(batch.id),
                 other.batches.create(input_file_id=f.id, endpoint=CHAT,
                                      completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            await call
    assert (await other.files.list()).data == []
    assert (await other.batches.list()).data == []
    await wait_status(owner, batch.id, {"completed"})
    await owner.close()
    await other.close()


async def test_operators_see_running_batches(sim: SimFactory, gateway: GatewayFactory,
                                             tmp_path: Path) -> None:
    backend = await sim(max_num_seqs=2)
    gw = await gateway([backend], data_dir=tmp_path, batch_poll_s=0.05,
                       admin_keys=["sk-admin"])
    c = client(gw)
    f = await c.files.create(file=("in.jsonl", jsonl(10, max_tokens=300)), purpose="batch")
    batch = await c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    await wait_status(c, batch.id, {"in_progress"})
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/admin/state",
                            headers={"Authorization": "Bearer sk-admin"}) as resp:
            state = await resp.json()
    (running,) = [b for b in state["batches"] if b["id"] == batch.id]
    assert running["user"] == "bert" and running["total"] == 10
    assert running["status"] == "in_progress"
    await c.batches.cancel(batch.id)
    await wait_status(c, batch.id, {"cancelled"})
    await c.close()


async def test_expiry_finalises_with_batch_expired_errors(sim: SimFactory,
                                                          gateway: GatewayFactory,
                                                          redis: Any, tmp_path: Path) -> None:
    backend = await sim(max_num_seqs=1)
    gw = await gateway([backend], data_dir=tmp_path, batch_poll_s=0.05, batch_max_in_flight=1)
    c = client(gw)
    f = await c.files.create(file=("in.jsonl", jsonl(20, max_tokens=200)), purpose="batch")
    batch = await c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    await backend.engine.wait_until(lambda: any(r.finished_s for r in
                                                backend.engine.records.values()))
    # the 24 h window runs out now: move the deadline into the past
    key = BatchKeys(batch.id).hash
    doc = json.loads(await redis.hget(key, "doc"))
    doc["expires_at"] = 0
    await redis.hset(key, "doc", json.dumps(doc))
    done = await wait_status(c, batch.id, {"expired"})
    assert done.expired_at and done.request_counts is not None
    assert done.request_counts.completed >= 1
    assert done.request_counts.completed + done.request_counts.failed == 20
    assert done.error_file_id
    errors = [json.loads(x) for x in (await c.files.content(done.error_file_id)).text.splitlines()]
    assert errors and all(e["error"]["code"] == "batch_expired" for e in errors)
    await c.close()


async def test_a_line_no_pool_takes_fails_alone_with_its_code(sim: SimFactory,
                                                              gateway: GatewayFactory,
                                                              tmp_path: Path) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], data_dir=tmp_path, batch_poll_s=0.05,
                       backend_options={"b0": {"max_prompt_tokens": 500}})
    lines = jsonl(3).decode().splitlines()
    lines.append(json.dumps({"custom_id": "too-long", "method": "POST", "url": CHAT, "body": {
        "model": MODEL, "max_tokens": 3,
        "messages": [{"role": "user", "content": "word " * 1000}]}}))
    c = client(gw)
    try:
        f = await c.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()),
                                 purpose="batch")
        batch = await c.batches.create(input_file_id=f.id, endpoint=CHAT,
                                       completion_window="24h")
        done = await wait_status(c, batch.id, {"completed", "failed"})
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)
        assert done.error_file_id is not None
        (error,) = [json.loads(x) for x in
                    (await c.files.content(done.error_file_id)).text.splitlines()]
    finally:
        await c.close()
    assert error["custom_id"] == "too-long"
    assert error["error"]["code"] == "context_length_exceeded"
    assert "0–500" in error["error"]["message"]
    assert len(backend.engine.records) == 3  # the long one never reached the backend


async def test_a_cancel_while_the_last_lines_finalize_ends_the_batch(gw: GatewayServer) -> None:
    """A cancel that lands after the last line's result, as the runner finalizes (in a
    clean-clone run it came between the runner's in_progress → finalizing and finalizing →
    completed), still ends the batch: cancelled, with every line's result; before, it stayed
    ``cancelling`` for ever. The cancel is the real route's, sent at that moment."""
    c = client(gw)
    records = gw.services.batch_runner.batches
    real = records.transition
    cancelled_at_finalizing: list[str] = []

    async def cancel_first(batch_id: str, allowed: tuple[str, ...], status: str,
                           stamp: str | None = None) -> bool:
        if status == "finalizing" and not cancelled_at_finalizing:
            cancelled_at_finalizing.append((await c.batches.cancel(batch_id)).status)
        return await real(batch_id, allowed, status, stamp)

    records.transition = cancel_first  # type: ignore[method-assign]
    f = await c.files.create(file=("in.jsonl", jsonl(3)), purpose="batch")
    batch = await c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    done = await wait_status(c, batch.id, {"completed", "cancelled"}, limit_s=30)
    assert cancelled_at_finalizing == ["cancelling"], cancelled_at_finalizing
    assert done.status == "cancelled" and done.cancelled_at, done
    assert done.request_counts is not None and done.request_counts.completed == 3, done
    assert done.output_file_id, done
    await c.close()
