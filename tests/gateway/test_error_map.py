"""Every error class maps to an OpenAI error, rendered by the edge whichever way it leaves.

The classes are found by walking ``FairgateError``'s subclasses (a new one is checked
without being listed here). Each is raised from a handler of a tiny app behind the real
error boundary, on loopback, and must answer its status with OpenAI's error object; a 429
or 503 always carries ``Retry-After``, the wait estimator's unless the error brought one.
The same object leaves as an SSE frame (a stream cut mid-answer) and as a raw answer (the
connection cap).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

import gateway.core.errors
import gateway.proxy.upstream  # its ForeignAnswer is a FairgateError too
from gateway.core.edge import RETRY_STATUSES, error_boundary, error_object, raw_answer, sse_frame
from gateway.core.errors import FairgateError, RateLimitExceeded
from gateway.core.metrics import GatewayMetrics

FLOOR_S = 7  # the app's stand-in for the wait estimator's Retry-After


def error_classes(root: type[FairgateError] = FairgateError) -> Iterator[type[FairgateError]]:
    yield root
    for sub in root.__subclasses__():
        yield from error_classes(sub)


CLASSES = {c.__name__: c for c in error_classes()}


def make(cls: type[FairgateError], retry_after_s: int | None = None) -> FairgateError:
    if issubclass(cls, RateLimitExceeded):
        return cls(f"{cls.__name__} happened", retry_after_s=retry_after_s,
                   limit_headers={"x-ratelimit-limit-requests": "5"})
    error = cls(f"{cls.__name__} happened")
    error.retry_after_s = retry_after_s
    return error


@pytest.fixture
async def server() -> AsyncIterator[TestServer]:
    async def fail(request: web.Request) -> web.Response:
        given = request.query.get("retry_after_s")
        raise make(CLASSES[request.match_info["name"]],
                   None if given is None else int(given))

    app = web.Application(middlewares=[error_boundary(GatewayMetrics(), lambda _: FLOOR_S)])
    app.router.add_get("/fail/{name}", fail)
    async with TestServer(app, host="127.0.0.1") as srv:
        yield srv


def test_every_error_class_is_in_the_errors_tree() -> None:
    doc = gateway.core.errors.__doc__ or ""
    missing = [n for n, c in CLASSES.items()
               if c.__module__ == "gateway.core.errors" and n not in doc]
    assert missing == [], f"error classes missing from gateway/core/errors.py's tree: {missing}"


def test_each_code_is_one_outcome() -> None:
    seen: dict[str, str] = {}
    for name, cls in CLASSES.items():
        if cls.__module__ != "gateway.core.errors" or cls.code is None:
            continue
        assert cls.code not in seen, f"{name} and {seen[cls.code]} share code {cls.code}"
        seen[cls.code] = name
    assert len(seen) >= 20, f"only {len(seen)} codes found: {sorted(seen)}"


@pytest.mark.parametrize("name", sorted(CLASSES))
async def test_every_error_maps_to_an_openai_answer(server: TestServer, name: str) -> None:
    cls = CLASSES[name]
    async with aiohttp.ClientSession() as http, \
            http.get(server.make_url(f"/fail/{name}")) as resp:
        body = await resp.json()
        headers = resp.headers
    assert resp.status == cls.status and 400 <= resp.status < 600, (name, resp.status, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert f"{name} happened" in error["message"], body
    assert isinstance(error["type"], str) and error["type"] == cls.type, body
    expected_code = None if cls.status == 404 else cls.code  # NotFound: no model param
    assert error["code"] == expected_code, body
    if resp.status in RETRY_STATUSES:
        assert headers.get("Retry-After") == str(FLOOR_S), (name, dict(headers))
    if issubclass(cls, RateLimitExceeded):
        assert headers.get("x-ratelimit-limit-requests") == "5", (name, dict(headers))


@pytest.mark.parametrize("name", sorted(n for n, c in CLASSES.items()
                                        if c.status in RETRY_STATUSES))
async def test_an_errors_own_retry_after_wins(server: TestServer, name: str) -> None:
    async with aiohttp.ClientSession() as http, \
            http.get(server.make_url(f"/fail/{name}?retry_after_s=42")) as resp:
        assert resp.headers.get("Retry-After") == "42", (name, dict(resp.headers))


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_sse_frame_and_raw_answer_carry_the_same_object(name: str) -> None:
    error = make(CLASSES[name], retry_after_s=3)
    frame = sse_frame(error)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n"), frame
    assert json.loads(frame[len(b"data: "):]) == error_object(error), frame
    head, _, body = raw_answer(error).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {error.status} "), lines
    assert "Retry-After: 3" in lines and "Connection: close" in lines, lines
    assert f"Content-Length: {len(body)}" in lines, lines
    assert json.loads(body) == error_object(error), body
