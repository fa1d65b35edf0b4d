"""``gateway.proxy.completion_request.read_completion`` behind a real aiohttp server.

A tiny app calls ``read_completion`` and answers with what it read, or renders the
:class:`~gateway.core.errors.FairgateError` it raised exactly as the gateway's edge does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.core.edge import render
from gateway.core.errors import FairgateError
from gateway.proxy.completion_request import read_completion
from gateway.proxy.endpoints import BY_PATH
from gateway.proxy.endpoints import CHAT as CHAT_ENDPOINT
from gateway.proxy.endpoints import COMPLETIONS as COMPLETIONS_ENDPOINT
from tests.gateway.conftest import MODEL, assert_error

CHAT, COMPLETIONS = CHAT_ENDPOINT.path, COMPLETIONS_ENDPOINT.path
MAX_BYTES = 2000
HI = [{"role": "user", "content": "hi"}]

Client = TestClient[web.Request, web.Application]
ClientFactory = Callable[[int], Awaitable[Client]]


def app(max_bytes: int) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        try:
            creq = await read_completion(request, BY_PATH[request.path], max_bytes)
        except FairgateError as exc:
            return render(exc)
        return web.json_response({"path": creq.path, "body": creq.body, "model": creq.model,
                                  "stream": creq.stream, "end_user": creq.end_user})

    application = web.Application()
    application.router.add_post(CHAT, handle)
    application.router.add_post(COMPLETIONS, handle)
    return application


@pytest.fixture
async def make_client() -> AsyncIterator[ClientFactory]:
    clients: list[Client] = []

    async def make(max_bytes: int = MAX_BYTES) -> Client:
        client: Client = TestClient(TestServer(app(max_bytes)))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def client(make_client: ClientFactory) -> Client:
    return await make_client(MAX_BYTES)


async def post(client: Client, path: str, body: Any, **kwargs: Any) -> tuple[int, Any]:
    if isinstance(body, bytes) or body is None or not isinstance(body, dict | list):
        kwargs["data"] = body
    else:
        kwargs["json"] = body
    async with client.post(path, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None)


# --------------------------------------------------------------------------- valid


async def test_valid_chat(client: Client) -> None:
    body = {"model": MODEL, "messages": HI, "stream": True, "max_tokens": 5,
            "stream_options": {"include_usage": True}, "user": "erin", "top_k": 3}
    status, got = await post(client, CHAT, body)
    assert status == 200, got
    # everything passes through untouched, unknown fields too
    assert got == {"path": CHAT, "body": body, "model": MODEL, "stream": True,
                   "end_user": "erin"}


async def test_integers_beyond_64_bits_stay_integers(client: Client) -> None:
    seed = 123456789012345678901234567890
    raw = json.dumps({"model": MODEL, "messages": HI, "seed": seed}).encode()
    status, got = await post(client, CHAT, raw)
    assert status == 200, got
    assert got["body"]["seed"] == seed, f"seed read as {got['body']['seed']!r}"


async def test_valid_completion(client: Client) -> None:
    for prompt in ("once upon", ["a", "b"], [791, 6762, 7325]):
        body = {"model": MODEL, "prompt": prompt, "max_completion_tokens": 1}
        status, got = await post(client, COMPLETIONS, body)
        assert status == 200, got
        assert got == {"path": COMPLETIONS, "body": body, "model": MODEL, "stream": False,
                       "end_user": None}


async def test_valid_body_at_exactly_the_limit(client: Client) -> None:
    head = json.dumps({"model": MODEL, "prompt": ""}).encode()
    raw = head[:-2] + b"x" * (MAX_BYTES - len(head)) + head[-2:]
    assert len(raw) == MAX_BYTES
    status, got = await post(client, COMPLETIONS, raw)
    assert status == 200, got
    assert got["body"]["prompt"] == "x" * (MAX_BYTES - len(head))


async def test_valid_body_in_pieces_without_content_length(client: Client) -> None:
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user",
                                                   "content": "y" * 1500}]}).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(raw), 100):
            yield raw[i:i + 100]

    status, got = await post(client, CHAT, pieces())
    assert status == 200, got
    assert got["body"]["messages"][0]["content"] == "y" * 1500


# --------------------------------------------------------------------------- 400


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe\x00garbage", b"", b'{"model": "m"',
                                 b"NaN]", b'{"model": "m", "temperature": NaN}',
                                 b'{"model": "m", "top_p": -Infinity}'])
async def test_invalid_json(client: Client, raw: bytes) -> None:
    status, got = await post(client, CHAT, raw)
    assert status == 400, got
    assert "not valid JSON" in assert_error(got, type_="invalid_request_error", param=None)


async def test_deeply_nested_json(make_client: ClientFactory) -> None:
    client = await make_client(1_000_000)
    for raw in (b"[" * 200_000, b'{"a":' * 100_000):
        status, got = await post(client, CHAT, raw)
        assert status == 400, got
        msg = assert_error(got, type_="invalid_request_error", param=None)
        assert "not valid JSON" in msg


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"chat"', b"42", b"null", b"true"])
async def test_body_not_an_object(client: Client, raw: bytes) -> None:
    status, got = await post(client, CHAT, raw)
    assert status == 400, got
    assert "JSON object" in assert_error(got, type_="invalid_request_error", param=None)


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {"messages": HI}, "model"),
    (CHAT, {"model": "", "messages": HI}, "model"),
    (CHAT, {"model": 7, "messages": HI}, "model"),
    (CHAT, {"model": None, "messages": HI}, "model"),
    (COMPLETIONS, {"prompt": "p"}, "model"),
    (CHAT, {"model": MODEL}, "messages"),
    (CHAT, {"model": MODEL, "messages": []}, "messages"),
    (CHAT, {"model": MODEL, "messages": "hi"}, "messages"),
    (CHAT, {"model": MODEL, "messages": {"role": "user"}}, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"content": "no role"}]}, "messages"),
    (CHAT, {"model": MODEL, "messages": [*HI, "hi"]}, "messages"),
    (COMPLETIONS, {"model": MODEL}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": 5}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": None}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": {"text": "p"}}, "prompt"),
    (CHAT, {"model": MODEL, "messages": HI, "stream": "yes"}, "stream"),
    (CHAT, {"model": MODEL, "messages": HI, "stream": None}, "stream"),
    (COMPLETIONS, {"model": MODEL, "prompt": "p", "stream": 1}, "stream"),
    (CHAT, {"model": MODEL, "messages": HI, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "max_tokens": -3}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "max_tokens": "10"}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "max_tokens": 2.5}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "p", "max_tokens": 0}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "max_completion_tokens": 0},
     "max_completion_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "max_completion_tokens": False},
     "max_completion_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "stream": True, "stream_options": "x"},
     "stream_options"),
    (CHAT, {"model": MODEL, "messages": HI, "stream": True, "stream_options": []},
     "stream_options"),
    (COMPLETIONS, {"model": MODEL, "prompt": "p", "stream_options": True},
     "stream_options"),
    # vLLM reads "8" and 8.0 as 8 sequences: counted as one, they would evade the reservation
    (CHAT, {"model": MODEL, "messages": HI, "n": "8"}, "n"),
    (CHAT, {"model": MODEL, "messages": HI, "n": 8.0}, "n"),
    (CHAT, {"model": MODEL, "messages": HI, "n": 0}, "n"),
    (CHAT, {"model": MODEL, "messages": HI, "n": 129}, "n"),
    (COMPLETIONS, {"model": MODEL, "prompt": "p", "best_of": "4"}, "best_of"),
    (COMPLETIONS, {"model": MODEL, "prompt": "p", "best_of": 10**40}, "best_of"),
    (COMPLETIONS, {"model": MODEL, "prompt": "p", "n": 2, "best_of": False}, "best_of"),
])
async def test_bad_field(client: Client, path: str, body: dict[str, Any], param: str) -> None:
    status, got = await post(client, path, body)
    assert status == 400, got
    assert_error(got, type_="invalid_request_error", param=param)


async def test_n_and_best_of_within_bounds_are_allowed(client: Client) -> None:
    body = {"model": MODEL, "prompt": "p", "n": 128, "best_of": 128}
    status, got = await post(client, COMPLETIONS, body)
    assert status == 200, got
    status, got = await post(client, CHAT, {"model": MODEL, "messages": HI, "n": None})
    assert status == 200, got


async def test_null_max_tokens_and_stream_options_are_allowed(client: Client) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": None, "stream_options": None}
    status, got = await post(client, CHAT, body)
    assert status == 200, got
    assert got["stream"] is False


# --------------------------------------------------------------------------- 413


async def test_too_large_with_content_length(client: Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (2 * MAX_BYTES)}]}
    status, got = await post(client, CHAT, body)
    assert status == 413, got
    msg = assert_error(got, type_="invalid_request_error", code="request_too_large")
    assert str(MAX_BYTES) in msg


async def test_too_large_without_content_length(client: Client) -> None:
    raw = json.dumps({"model": MODEL, "prompt": "z" * (2 * MAX_BYTES)}).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(raw), 300):
            yield raw[i:i + 300]

    status, got = await post(client, COMPLETIONS, pieces())
    assert status == 413, got
    assert_error(got, type_="invalid_request_error", code="request_too_large")


async def test_one_byte_over_the_limit_without_content_length(client: Client) -> None:
    head = json.dumps({"model": MODEL, "prompt": ""}).encode()
    raw = head[:-2] + b"x" * (MAX_BYTES + 1 - len(head)) + head[-2:]
    assert len(raw) == MAX_BYTES + 1

    async def whole() -> AsyncIterator[bytes]:
        yield raw

    status, got = await post(client, COMPLETIONS, whole())
    assert status == 413, got
    assert_error(got, type_="invalid_request_error", code="request_too_large")


async def test_declared_too_large_is_refused_before_the_body_arrives(client: Client) -> None:
    """A Content-Length over the limit is answered at once: nothing of the body is read
    (the rest of it is only sent after the answer arrived)."""
    answered = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        await answered.wait()
        yield b"x" * MAX_BYTES + b'"}'

    headers = {"Content-Length": str(MAX_BYTES + 1), "Content-Type": "application/json"}
    async with asyncio.timeout(10):  # a bound: without the check the server waits forever
        async with client.post(COMPLETIONS, data=body(), headers=headers) as resp:
            answered.set()
            status, got = resp.status, await resp.json()
    assert status == 413, got
    assert_error(got, type_="invalid_request_error", code="request_too_large")
