"""Hostile uploads to ``POST /v1/files`` (issue 10, items 2 and 10): malformed multipart
bodies are 400s in OpenAI's format, a user's files are bounded by a quota, and input
files are parsed off the event loop (counted, not timed: a wall-clock bound on
``/health`` latency was flaky on a loaded 2-core machine)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

import gateway.batch.input
from gateway.http.server import GatewayServer
from gateway.proxy.completion_request import parse_json
from gateway.storage.keys import user_file_bytes
from tests.batch.test_batch_api import CHAT, client, jsonl, wait_status
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, assert_error, auth

BOUNDARY = "fgboundary7c1e"


def multipart(*parts: tuple[str, str | None, bytes], close: bool = True) -> bytes:
    """A multipart/form-data body; ``close=False`` leaves out the closing boundary."""
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (
            f'; filename="{filename}"' if filename else "")
        out += (f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n").encode()
        out += data + b"\r\n"
    if close:
        out += f"--{BOUNDARY}--\r\n".encode()
    return out


VALID = multipart(("purpose", None, b"batch"), ("file", "in.jsonl", jsonl(2)))


@pytest.fixture
async def gw(sim: SimFactory, gateway: GatewayFactory, tmp_path: Path) -> GatewayServer:
    return await gateway([await sim(profile="instant")], data_dir=tmp_path, batch_poll_s=0.05)


async def upload(gw: GatewayServer, body: bytes, content_type: str
                 ) -> tuple[int, dict[str, Any]]:
    headers = {**auth("sk-batch"), "Content-Type": content_type}
    async with aiohttp.ClientSession() as http, http.post(gw.url + "/v1/files", data=body,
                                                          headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def files_of(gw: GatewayServer) -> list[Any]:
    c = client(gw)
    try:
        return (await c.files.list()).data
    finally:
        await c.close()


async def test_valid_raw_multipart_is_accepted(gw: GatewayServer) -> None:
    status, got = await upload(gw, VALID, f"multipart/form-data; boundary={BOUNDARY}")
    assert status == 200, got
    assert got["purpose"] == "batch" and got["bytes"] == len(jsonl(2))


@pytest.mark.parametrize(("body", "content_type"), [
    (VALID, "multipart/form-data"),  # no boundary
    (VALID, "multipart/form-data; boundary="),  # empty boundary
    (VALID, "multipart/form-data; boundary=" + "b" * 200),  # longer than RFC 2046 allows
    (VALID[: len(VALID) // 2], f"multipart/form-data; boundary={BOUNDARY}"),  # truncated
    (multipart(("purpose", None, b"batch"), ("file", "in.jsonl", jsonl(2)), close=False),
     f"multipart/form-data; boundary={BOUNDARY}"),  # no closing boundary
    (b"garbage without any boundary", f"multipart/form-data; boundary={BOUNDARY}"),
    (b"", f"multipart/form-data; boundary={BOUNDARY}"),
    (f"--{BOUNDARY}\r\nno headers end".encode(), f"multipart/form-data; boundary={BOUNDARY}"),
])
async def test_malformed_multipart_is_a_400(gw: GatewayServer, body: bytes,
                                           content_type: str) -> None:
    status, got = await upload(gw, body, content_type)
    assert status == 400, got
    assert_error(got, type_="invalid_request_error", param=got["error"]["param"])
    assert got["error"]["param"] in (None, "file"), got
    assert await files_of(gw) == []  # nothing kept, no partial file on disk
    parts = list((gw.settings.store.data_dir / "files").iterdir())
    assert parts == [], parts


async def test_deep_lines_are_refused_at_upload(gw: GatewayServer) -> None:
    """Lines nested deeper than ``max_json_depth`` (or than Python can decode) are named
    at upload, so no accepted line can fail on its depth later."""
    deep = "[" * 949 + '[{"type": "text", "text": "x"}]' + "]" * 949
    line = json.dumps({"custom_id": "deep", "method": "POST", "url": CHAT,
                       "body": {"model": MODEL, "messages": [{"role": "user",
                                                              "content": "@"}]}})
    body = (line.replace('"@"', deep) + "\n" + line.replace('"@"', "[" * 50_000) + "\n"
            + line.replace('"@"', '"fine"').replace('"deep"', '"ok"') + "\n").encode()
    c = client(gw)
    try:
        with pytest.raises(openai.BadRequestError) as err:
            await c.files.create(file=("deep.jsonl", body), purpose="batch")
    finally:
        await c.close()
    assert "line 1:" in err.value.message and "64 levels" in err.value.message
    assert "line 2:" in err.value.message and "line 3" not in err.value.message
    assert await files_of(gw) == []


async def test_per_user_file_quota(sim: SimFactory, gateway: GatewayFactory,
                                   tmp_path: Path) -> None:
    one = len(jsonl(10))
    gw = await gateway([await sim(profile="instant")], data_dir=tmp_path,
                       max_files_bytes_per_user=2 * one + 10)
    owner, other = client(gw), client(gw, "sk-alice")
    try:
        first = await owner.files.create(file=("a.jsonl", jsonl(10)), purpose="batch")
        await owner.files.create(file=("b.jsonl", jsonl(10)), purpose="batch")
        with pytest.raises(openai.APIStatusError) as err:
            await owner.files.create(file=("c.jsonl", jsonl(10)), purpose="batch")
        assert err.value.status_code == 413
        assert err.value.code == "file_quota_exceeded" and err.value.param == "file"
        assert f"{2 * one + 10} bytes" in err.value.message
        assert len((await owner.files.list()).data) == 2
        await other.files.create(file=("c.jsonl", jsonl(10)), purpose="batch")  # per user
        await owner.files.delete(first.id)  # room again
        await owner.files.create(file=("c.jsonl", jsonl(10)), purpose="batch")
    finally:
        await owner.close()
        await other.close()
    assert sorted(p.name.startswith(".") for p in (tmp_path / "files").iterdir()) == [
        False, False, False]  # no partial file left behind


async def test_parallel_uploads_never_store_more_than_the_quota(
        sim: SimFactory, gateway: GatewayFactory, tmp_path: Path) -> None:
    """Ten uploads of about 40 KB at once against a 100,000-byte quota (issue 43, item 2:
    all ten were stored, 4x the quota): each chunk is reserved before it is written, so
    at most two are stored and the others are 413s naming the quota."""
    quota = 100_000
    lines = max(n for n in range(1, 400) if len(jsonl(n)) <= 40_000)
    body = jsonl(lines)
    gw = await gateway([await sim(profile="instant")], data_dir=tmp_path,
                       max_files_bytes_per_user=quota)
    c = client(gw)
    try:
        outcomes = await asyncio.gather(*(
            c.files.create(file=(f"f{i}.jsonl", body), purpose="batch") for i in range(10)),
            return_exceptions=True)
        refused = [o for o in outcomes if isinstance(o, BaseException)]
        for exc in refused:
            assert isinstance(exc, openai.APIStatusError) and exc.status_code == 413, exc
            assert exc.code == "file_quota_exceeded" and exc.param == "file", exc
            assert f"quota of {quota} bytes" in exc.message, exc.message
        stored = (await c.files.list()).data
        total = sum(f.bytes for f in stored)
        assert total <= quota, f"{len(stored)} files of {len(body)} B stored: {total} B"
        assert len(stored) == quota // len(body), f"{len(stored)} stored, {len(refused)} refused"
        on_disk = sorted(p.stat().st_size for p in (tmp_path / "files").iterdir())
        assert on_disk == [len(body)] * len(stored), on_disk  # nothing partial left
        counted = await gw.services.store.client.get(user_file_bytes("bert"))
        assert int(counted) == total, f"the counter holds {counted}, the files {total}"
        for f in stored:  # deleting gives the bytes back: room for as many again
            await c.files.delete(f.id)
        again = await asyncio.gather(*(
            c.files.create(file=(f"g{i}.jsonl", body), purpose="batch") for i in range(10)),
            return_exceptions=True)
        kept = [o for o in again if not isinstance(o, BaseException)]
        assert len(kept) == len(stored), f"{len(kept)} stored after the deletes"
    finally:
        await c.close()


class WhereJsonRuns:
    """Stands in for ``parse_json`` in ``gateway.batch.input``: counts decodes on and off
    the event loop's thread."""

    def __init__(self) -> None:
        self.on_loop = self.off_loop = 0

    def __call__(self, raw: bytes, what: str = "request body") -> Any:
        try:
            asyncio.get_running_loop()
            self.on_loop += 1
        except RuntimeError:
            self.off_loop += 1
        return parse_json(raw, what)


async def test_input_files_are_parsed_off_the_event_loop(gw: GatewayServer,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    where = WhereJsonRuns()
    monkeypatch.setattr(gateway.batch.input, "parse_json", where)
    c = client(gw)
    try:
        meta = await c.files.create(file=("in.jsonl", jsonl(50)), purpose="batch")
        batch = await c.batches.create(input_file_id=meta.id, endpoint=CHAT,
                                       completion_window="24h")
        done = await wait_status(c, batch.id, {"completed", "failed"})
    finally:
        await c.close()
    assert done.status == "completed", done
    # upload, batch creation and the runner each parsed the 50 lines, none on the loop
    assert (where.on_loop, where.off_loop) == (0, 150)


@pytest.mark.parametrize(("body", "param"), [
    (b"[" * 100_000, None),
    (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, None),
    (None, "metadata"),  # a key longer than OpenAI's 64 characters
    ({"job": "v" * 513}, "metadata"),  # a value longer than OpenAI's 512 characters
])
async def test_hostile_batch_creation_is_a_400(gw: GatewayServer, body: Any,
                                               param: str | None) -> None:
    c = client(gw)
    try:
        meta = await c.files.create(file=("in.jsonl", jsonl(1)), purpose="batch")
    finally:
        await c.close()
    if not isinstance(body, bytes):
        metadata = body if body is not None else {"k" * 65: "v"}
        body = json.dumps({"input_file_id": meta.id, "endpoint": CHAT,
                           "completion_window": "24h", "metadata": metadata}).encode()
    async with aiohttp.ClientSession() as http, http.post(
            gw.url + "/v1/batches", data=body,
            headers={**auth("sk-batch"), "Content-Type": "application/json"}) as resp:
        status, got = resp.status, await resp.json(content_type=None)
    assert status == 400, got
    assert_error(got, type_="invalid_request_error", param=param)
