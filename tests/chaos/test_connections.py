"""Hostile connections: idle or half-sent headers are closed after client_idle_timeout_s,
and connections over max_client_connections get a clear 503 instead of exhausting the
process's files; the gateway keeps serving everyone else throughout."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.chaos.conftest import LOOPS
from tests.gateway.conftest import GatewayFactory, SimFactory, complete

IDLE = 40


async def open_idle(port: int, partial: bytes) -> tuple[asyncio.StreamReader,
                                                        asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(partial)
    await writer.drain()
    return reader, writer


async def user_statuses(url: str, count: int) -> list[int]:
    """``count`` small completions of a served user, one after the other, each on a new
    connection: their statuses."""
    statuses = []
    connector = aiohttp.TCPConnector(force_close=True)  # a new connection each request
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(count):
            async with session.post(url + "/v1/completions", json={
                    "model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 2},
                    headers={"Authorization": "Bearer sk-alice"}) as resp:
                statuses.append(resp.status)
    return statuses


async def test_idle_and_half_sent_connections_are_closed(sim: SimFactory,
                                                         gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], client_idle_timeout_s=0.5)
    conns = [await open_idle(gw.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             if i % 2 else b"") for i in range(IDLE)]
    async with aiohttp.ClientSession() as session:  # others are served meanwhile
        assert (await complete(session, gw.url, "sk-alice", 3))["usage"]["completion_tokens"] == 3
    for reader, writer in conns:  # the server hangs up on every one (EOF), unprompted
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()


async def open_authenticated(port: int) -> tuple[asyncio.StreamReader,
                                                 asyncio.StreamWriter]:
    """A keep-alive connection on which one request authenticated (then idle)."""
    reader, writer = await open_idle(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                                           b"Authorization: Bearer sk-alice\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    await asyncio.wait_for(reader.readexactly(length), 10)
    return reader, writer


def _errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.asyncio(loop_factories=list(LOOPS))
async def test_connections_over_the_cap_get_a_503(sim: SimFactory, gateway: GatewayFactory,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """On either loop: a connection over the cap is answered 503 with Retry-After and an
    OpenAI error, whether it sent nothing yet or a whole request, and nothing is logged
    as an error (uvloop's transports once failed an isinstance check: a reset and a
    traceback for each)."""
    backend = await sim(profile="instant")
    gw = await gateway([backend], max_client_connections=5)
    held = [await open_authenticated(gw.port) for _ in range(5)]
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    raw = await asyncio.wait_for(reader.read(), 10)  # answered and closed, nothing sent
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head, raw
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("server_error", "too_many_connections")
    assert "too many open connections" in error["message"]
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:  # requests sent at once

        async def refused() -> tuple[int, str | None, dict[str, Any]]:
            async with session.post(gw.url + "/v1/completions", json={
                    "model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 2},
                    headers={"Authorization": "Bearer sk-alice"}) as resp:
                return resp.status, resp.headers.get("Retry-After"), await resp.json()

        answers = await asyncio.gather(*(refused() for _ in range(5)))
    assert [(s, r) for s, r, _ in answers] == [(503, "1")] * 5, answers
    assert {b["error"]["code"] for _, _, b in answers} == {"too_many_connections"}, answers
    assert gw.refused == 6, f"refused {gw.refused} connections, not 6"
    assert _errors_logged(caplog) == [], _errors_logged(caplog)
    for _, w in held:
        w.close()
        await w.wait_closed()
    async with aiohttp.ClientSession() as session:  # room again once they are gone
        for _ in range(200):
            try:
                await complete(session, gw.url, "sk-alice", 2)
                break
            except (AssertionError, aiohttp.ClientError):
                await asyncio.sleep(0.01)
        else:
            raise AssertionError("never served again after the held connections closed")


# connects all its sockets first, then sends a completion on each: the gateway finds the
# whole burst in its accept queue at once; prints each answer's status line
BURST_CLIENT = """
import json, socket, sys, threading
port, count = int(sys.argv[1]), int(sys.argv[2])
body = json.dumps({"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 2}).encode()
request = (b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\nAuthorization: Bearer sk-alice"
           b"\\r\\nContent-Type: application/json\\r\\nConnection: close\\r\\n"
           b"Content-Length: %d\\r\\n\\r\\n" % len(body) + body)
socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]
answers = [""] * count
def one(i):
    try:
        socks[i].sendall(request)
        data = b""
        while chunk := socks[i].recv(65536):
            data += chunk
        answers[i] = data.split(b"\\r\\n", 1)[0].decode() or "closed unanswered"
    except OSError as exc:
        answers[i] = type(exc).__name__
    finally:
        socks[i].close()
threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(answers))
"""


@pytest.mark.asyncio(loop_factories=list(LOOPS))
async def test_a_burst_of_new_connections_under_the_cap_is_served(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """30 clients connecting at once under a cap of 50 (25 unauthenticated): all served.
    uvloop accepts the whole burst before reading any of it, so all 30 were
    unauthenticated for a moment, and the allowance closed the 5 oldest unanswered."""
    backend = await sim(profile="instant")
    gw = await gateway([backend], max_client_connections=50)
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", BURST_CLIENT, str(gw.port), "30",
        stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(client.communicate(), 60)
    answers = json.loads(out)
    lost = [a for a in answers if a != "HTTP/1.1 200 OK"]
    assert lost == [], f"{len(lost)} of 30 lost: {lost} ({gw.evicted} closed for room)"
    assert gw.evicted == 0, f"{gw.evicted} connections closed for room"


async def test_a_body_that_stops_arriving_gets_a_408(sim: SimFactory,
                                                    gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], client_idle_timeout_s=0.5)
    reader, writer = await open_idle(
        gw.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Authorization: Bearer sk-alice\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"model\": ")  # ...and nothing more
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 408")
    writer.close()


async def test_a_stream_longer_than_max_request_s_ends_with_an_error_event(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim(max_num_seqs=4)  # ~5 ms a token: 2,000 tokens take ~10 s
    gw = await gateway([backend], max_request_s=0.5)
    body = {"model": "llama-3.1-8b", "prompt": "x", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    events = []
    async with aiohttp.ClientSession() as session, session.post(
            gw.url + "/v1/completions", json=body,
            headers={"Authorization": "Bearer sk-alice"}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line)
    last = json.loads(events[-1][6:])
    assert last["error"]["code"] == "upstream_error", last  # not a silent truncation
    assert 1 < len(events) < 2000
    await backend.engine.wait_until(lambda: backend.engine.num_running == 0)
    assert all(r.aborted for r in backend.engine.records.values())  # vLLM stops too


STALLED_LOGIN = (b"POST /dashboard/login HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/x-www-form-urlencoded\r\n"
                 b"Content-Length: 1000\r\n\r\nkey=")  # ...and nothing more


def _multipart_head(key: str) -> bytes:
    return (b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
            + b"\r\nContent-Type: multipart/form-data; boundary=B\r\n"
            b"Content-Length: 100000\r\n\r\n--B\r\nContent-Disposition: form-data; "
            b"name=\"purpose\"\r\n\r\nbatch\r\n--B\r\nContent-Disposition: form-data; "
            b"name=\"file\"; filename=\"in.jsonl\"\r\n\r\n{\"custom_id\"")


def _json_head(path: str, key: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"a\": "
            ).encode()


STALLED = {
    "dashboard login (no key)": STALLED_LOGIN,
    "file upload": _multipart_head("sk-alice"),
    "batch create": _json_head("/v1/batches", "sk-alice"),
    "admin key create": _json_head("/admin/keys", "sk-admin"),
    "tokenize": _json_head("/tokenize", "sk-alice"),
}


@pytest.mark.parametrize("route", list(STALLED))
async def test_a_body_that_stops_arriving_is_cut_on_every_route(
        route: str, sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], client_idle_timeout_s=0.5, admin_keys=["sk-admin"])
    reader, writer = await open_idle(gw.port, STALLED[route])
    try:
        answer = await asyncio.wait_for(reader.read(), 20)  # the answer, then EOF
    except TimeoutError:
        raise AssertionError(f"{route}: a stalled body was never cut") from None
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408"), (route, answer[:200])
    assert b"stopped arriving" in answer, (route, answer)


async def test_a_trickled_body_is_cut_by_the_minimum_rate(sim: SimFactory,
                                                          gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], client_idle_timeout_s=0.5, min_body_bytes_per_s=200)
    reader, writer = await open_idle(gw.port, STALLED_LOGIN)
    answer = asyncio.ensure_future(reader.read())
    sent = 0
    for _ in range(400):  # a byte every 50 ms (20 B/s): never idle for 0.5 s; ≤ 20 s
        done, _ = await asyncio.wait([answer], timeout=0.05)
        if done:
            break
        writer.write(b"x")
        sent += 1
    else:
        answer.cancel()
        writer.close()
        raise AssertionError(f"a body trickled at 20 B/s was never cut ({sent} bytes sent)")
    writer.close()
    assert answer.result().startswith(b"HTTP/1.1 408"), answer.result()[:200]
    assert b"slower than 200 bytes/s" in answer.result(), answer.result()


async def test_stalled_unauthenticated_connections_leave_room_for_users(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], max_client_connections=10)  # 5 unauthenticated at most
    stalled = [await open_idle(gw.port, STALLED_LOGIN) for _ in range(10)]
    statuses = await user_statuses(gw.url, 15)
    assert statuses == [200] * 15, statuses
    closed = 0
    for reader, writer in stalled:  # the oldest stalled logins were closed for them
        if reader.at_eof() or await _closed_soon(reader):
            closed += 1
        writer.close()
    assert closed >= 5, f"only {closed} of 10 stalled logins were closed"


async def _closed_soon(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 0.2) == b""
    except TimeoutError:
        return False


async def _trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   every_s: float = 0.05, at_most: int = 400) -> bytes:
    """Send a byte every ``every_s`` (never idle) until the server answers and closes;
    returns what it sent back (b"" for a close without an answer). Bounded: ``at_most``
    bytes, then AssertionError."""
    answer = asyncio.ensure_future(reader.read())
    try:
        try:
            for _ in range(at_most):
                done, _ = await asyncio.wait([answer], timeout=every_s)
                if done:
                    break
                writer.write(b"x")
            else:
                raise AssertionError(f"a body trickled for {at_most} bytes was never cut")
        except ConnectionError:  # closed while writing: cut
            pass
        try:
            return await answer
        except ConnectionError:  # reset (closed with bytes of ours unread): cut, no answer
            return b""
    finally:
        answer.cancel()
        writer.close()


async def test_a_trickled_upload_is_cut_by_the_minimum_rate_and_not_kept(
        sim: SimFactory, gateway: GatewayFactory, tmp_path: Path) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], client_idle_timeout_s=0.5, min_body_bytes_per_s=200,
                       data_dir=tmp_path)
    answer = await _trickle(*await open_idle(gw.port, _multipart_head("sk-alice")))
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"slower than 200 bytes/s" in answer, answer
    async with aiohttp.ClientSession() as session, session.get(
            gw.url + "/v1/files", headers={"Authorization": "Bearer sk-alice"}) as resp:
        listing = await resp.json()
    assert listing["data"] == [], f"the cut upload was kept: {listing}"
    left = list((tmp_path / "files").glob("*")) + list((tmp_path / "files").glob(".*"))
    assert left == [], f"the cut upload left files behind: {left}"


async def test_trickled_unauthenticated_logins_are_cut_while_users_are_served(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """The probe's attack at a small size: the connection cap (10) filled with logins
    that trickle their body, never idle. Each is cut (408 by the minimum rate, or closed
    to make room: the allowance for connections that never authenticated is 5), and the
    users' requests, each on a new connection, are served meanwhile."""
    backend = await sim(profile="instant")
    gw = await gateway([backend], max_client_connections=10, client_idle_timeout_s=0.5,
                       min_body_bytes_per_s=200)
    logins = [asyncio.create_task(_trickle(*await open_idle(gw.port, STALLED_LOGIN)))
              for _ in range(10)]
    statuses = await user_statuses(gw.url, 15)
    answers = await asyncio.gather(*logins)  # each bounded by _trickle
    assert statuses == [200] * 15, statuses
    cut = [a[:12] for a in answers]
    assert all(a == b"" or a.startswith(b"HTTP/1.1 408") for a in answers), cut
