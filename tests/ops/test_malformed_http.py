"""Malformed HTTP (answered 400 by aiohttp before any route) cannot flood the log: one
line per minute, no traceback, with a count of the ones left out."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import BadHttpMessage

from gateway.core.logs import MalformedHttpLogs


def record(created: float, exc: BaseException | None) -> logging.LogRecord:
    info = (type(exc), exc, None) if exc is not None else None
    rec = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1,
                            "Error handling request from %s", ("127.0.0.1",), info)
    rec.created = created
    return rec


def test_one_line_a_minute_without_traceback() -> None:
    limit = MalformedHttpLogs(every_s=60.0)
    bad = BadHttpMessage("Invalid header value char")
    first = record(1000.0, bad)
    assert limit.filter(first) and first.exc_info is None
    assert "malformed HTTP request" in first.getMessage()
    assert not any(limit.filter(record(1000.0 + i, bad)) for i in range(1, 50))
    later = record(1061.0, bad)
    assert limit.filter(later) and "49 more like it" in later.getMessage()
    other = record(1062.0, RuntimeError("a real bug"))  # other errors are untouched
    assert limit.filter(other) and other.exc_info is not None
