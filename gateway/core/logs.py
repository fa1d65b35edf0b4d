"""structlog setup: JSON lines when not on a terminal, pretty console otherwise.

Request context (request_id, user, model, class) is bound with contextvars per request.
Prompt/completion text and API keys are never logged.

Per-request ``info`` lines (``queued``, ``dispatched``, ``finished``) can be sampled at high
rates (:class:`RequestLogSampler`, setting ``log_sample_above_per_s``); errors, warnings,
rejections and unfinished requests are always logged.

An event logged with an exception (``log.exception(...)``) carries ``exc_type``,
``exc_message`` and ``exception``, the formatted traceback (frames and source lines, no
local variables: those may hold prompts or keys).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
import zlib
from collections.abc import Callable
from types import TracebackType
from typing import Any

import orjson
import structlog
from aiohttp.http_exceptions import BadHttpMessage
from structlog.typing import EventDict, WrappedLogger

ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]

MALFORMED_HTTP_LOG_EVERY_S = 60.0


class MalformedHttpLogs(logging.Filter):
    """aiohttp logs every malformed HTTP request (a NUL in a header, a bad Content-Length)
    with a full traceback, so any client could flood the log: keep one such line per
    ``every_s``, without the traceback, counting the ones left out."""

    def __init__(self, every_s: float = MALFORMED_HTTP_LOG_EVERY_S) -> None:
        super().__init__()
        self.every_s = every_s
        self.next_at = 0.0
        self.left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, BadHttpMessage):
            return True
        if record.created < self.next_at:
            self.left_out += 1
            return False
        self.next_at = record.created + self.every_s
        record.msg = (f"malformed HTTP request answered 400: {exc.message} "
                      f"({self.left_out} more like it not logged since the last one)")
        record.args, record.exc_info, record.exc_text = (), None, None
        self.left_out = 0
        return True


def _exc_info(value: Any) -> ExcInfo | None:
    if isinstance(value, BaseException):
        return type(value), value, value.__traceback__
    if isinstance(value, tuple) and len(value) == 3 and value[0] is not None:
        return value
    if value:  # exc_info=True: the exception being handled
        info = sys.exc_info()
        return info if info[0] is not None else None
    return None


def exception_fields(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    """Name the exception of an ``exc_info`` event: ``exc_type`` and ``exc_message``.

    Runs before :func:`structlog.processors.format_exc_info`, which replaces ``exc_info``
    by the formatted traceback under ``exception``."""
    info = _exc_info(event.get("exc_info"))
    if info is None:
        event.pop("exc_info", None)
        return event
    exc_type, exc, _ = info
    event["exc_info"] = info
    event.setdefault("exc_type", exc_type.__qualname__)
    event.setdefault("exc_message", str(exc))
    return event


SAMPLED_EVENTS = frozenset({"queued", "dispatched", "finished"})
"""The per-request ``info`` lines a sampler may leave out."""


class RequestLogSampler:
    """Keeps about ``per_s`` per-request lines a second, whole requests at a time.

    While the previous second had at most ``per_s`` such lines every line is kept. Above
    that, one request in ``k`` (``k`` = last second's lines ÷ ``per_s``, rounded up) keeps
    all its lines, chosen by a hash of its ``request_id``, so a kept request's queued,
    dispatched and finished lines stay together; each kept line then carries
    ``sampled_one_in=k``. Never left out: any level but ``info``, any other event
    (``rejected``, ``client_disconnected``, …) and a ``finished`` line of a request that
    did not complete."""

    def __init__(self, per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_s = per_s
        self.clock = clock
        self.window_start = clock()
        self.count = 0  # sampleable lines in the current window
        self.one_in = 1
        self.left_out = 0

    def __call__(self, logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
        if (method != "info" or event.get("event") not in SAMPLED_EVENTS
                or event.get("completed") is False):
            return event
        now = self.clock()
        elapsed = now - self.window_start
        if elapsed >= 1.0:
            rate = self.count / elapsed if elapsed < 2.0 else 0.0  # idle since: no sampling
            self.one_in = max(1, math.ceil(rate / self.per_s))
            self.window_start, self.count = now, 0
        self.count += 1
        if self.one_in == 1:
            return event
        request_id = event.get("request_id")
        key = zlib.crc32(str(request_id).encode()) if request_id is not None else self.count
        if key % self.one_in:
            self.left_out += 1
            raise structlog.DropEvent
        event["sampled_one_in"] = self.one_in
        return event


def json_line(event: EventDict, **kw: Any) -> str:
    """A log line's JSON: orjson (three lines a request: it pays), ``json`` for what orjson
    cannot write (a key that is not a string, an integer beyond 64 bits)."""
    try:
        return orjson.dumps(event, default=kw.get("default")).decode()
    except TypeError:
        return json.dumps(event, **kw)


class _CurrentStderr:
    """``sys.stderr`` as it is at each write, not when logging was configured: a caller
    that swaps it (pytest's capture) must not leave the loggers writing to a closed file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_STDERR = _CurrentStderr()


def configure_logging(level: int | str = logging.INFO,
                      sample_above_per_s: float | None = None, cache: bool = True) -> None:
    """``level``: a logging level or its name (``operations.log_level``, env
    ``FAIRGATE_OPERATIONS__LOG_LEVEL``); ``sample_above_per_s``: see
    :class:`RequestLogSampler` (None: every line); ``cache``: each logger keeps the
    processors it first logged with (off in the tests, whose
    ``structlog.testing.capture_logs`` needs every logger to follow the current ones)."""
    if isinstance(level, str):
        level = logging.getLevelNamesMapping()[level.upper()]
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedHttpLogs) for f in server_log.filters):
        server_log.addFilter(MalformedHttpLogs())
    tail: list[structlog.typing.Processor]
    if sys.stderr.isatty():  # the console renderer prints the exception itself
        # plainly: rich's highlighted traceback (structlog's default when rich is
        # installed) took seconds per exception on a busy machine, with the event loop
        # standing still meanwhile
        tail = [structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)]
    else:
        tail = [exception_fields, structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(serializer=json_line)]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *([RequestLogSampler(sample_above_per_s)] if sample_above_per_s else []),
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *tail,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # one write per line (print() writes the newline apart): the workers of
        # `fairgate serve --workers N` share stderr, and their lines must not interleave
        logger_factory=structlog.WriteLoggerFactory(_STDERR),  # type: ignore[arg-type]
        cache_logger_on_first_use=cache,
    )
