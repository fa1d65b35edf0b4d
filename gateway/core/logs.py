"""structlog setup: JSON lines when not on a terminal, pretty console otherwise.

Request context (request_id, user, model, class) is bound per request (:func:`bind_request`,
a context variable). Prompt/completion text and API keys are never logged.

A request says one line at ``info``: ``finished`` (its context, backend, wait, vLLM
priority, latency, tokens), or the line of how it ended otherwise (``rejected``,
``client_disconnected``, ``refused_in_stream``). Its ``queued`` and ``dispatched`` steps
are ``debug`` lines. The ``info`` lines of requests can be sampled at high rates
(:class:`RequestLogSampler`, setting ``log_sample_above_per_s``); errors, warnings,
rejections and unfinished requests are always logged.

A line costs a few microseconds: the timestamp's text is made once a second, orjson
writes the line's bytes, and one ``write`` puts them on stderr's file descriptor.

An event logged with an exception (``log.exception(...)``) carries ``exc_type``,
``exc_message`` and ``exception``, the formatted traceback (frames and source lines, no
local variables: those may hold prompts or keys).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import zlib
from collections.abc import Callable
from contextvars import ContextVar
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
    """Name the exception of an ``exc_info`` event: ``exc_type`` and ``exc_message``,
    and format its traceback under ``exception`` (:func:`structlog.processors.format_exc_info`,
    run only for such an event: most lines have none)."""
    if "exc_info" not in event:
        return event
    info = _exc_info(event["exc_info"])
    if info is None:
        del event["exc_info"]
        return event
    exc_type, exc, _ = info
    event["exc_info"] = info
    event.setdefault("exc_type", exc_type.__qualname__)
    event.setdefault("exc_message", str(exc))
    return structlog.processors.format_exc_info(logger, method, event)


class LevelAndTime:
    """``level`` (the method's name, ``warn`` as ``warning``, ``exception`` as ``error``)
    and ``timestamp``, UTC ISO 8601 to the microsecond (``2026-12-07T17:17:22.595170Z``).
    The text of the second is made once a second, not at each line."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.second = -1
        self.prefix = ""

    def __call__(self, logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
        event["level"] = _LEVELS.get(method, method)
        now = self.clock()
        second = int(now)
        if second != self.second:
            self.second = second
            self.prefix = time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(second))
        event["timestamp"] = f"{self.prefix}{int((now - second) * 1e6):06d}Z"
        return event


_LEVELS = {"warn": "warning", "exception": "error"}


_REQUEST: ContextVar[dict[str, Any]] = ContextVar("fairgate_request_log_fields")
_NO_FIELDS: dict[str, Any] = {}


def bind_request(**fields: Any) -> None:
    """Add ``fields`` to every line logged from here on in this context (the request's
    task, and the tasks it starts): the request's id, user, model and class. The dict is
    replaced, never changed, so a task started earlier keeps the fields it had."""
    _REQUEST.set({**_REQUEST.get(_NO_FIELDS), **fields})


def clear_request() -> None:
    """No request fields from here on in this context (a connection's task serves its
    requests one after the other)."""
    _REQUEST.set(_NO_FIELDS)


def merge_request(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    """The request's fields (:func:`bind_request`) on the line; the line's own win."""
    for key, value in _REQUEST.get(_NO_FIELDS).items():
        event.setdefault(key, value)
    return event


SAMPLED_EVENTS = frozenset({"queued", "dispatched", "finished"})
"""The per-request lines a sampler may leave out when logged at ``info`` (``finished``; the
other two are ``debug`` lines, all kept at ``log_level: debug``)."""


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


def _fallback(value: Any) -> Any:
    """What neither JSON codec writes: its ``__structlog__()``, else its ``repr``
    (structlog's ``JSONRenderer`` does the same)."""
    structlog_form = getattr(value, "__structlog__", None)
    return structlog_form() if structlog_form is not None else repr(value)


def json_line(logger: WrappedLogger, method: str, event: EventDict) -> bytes:
    """The event as one line of JSON, newline included: orjson, ``json`` for what orjson
    cannot write (a key that is not a string, an integer beyond 64 bits, a lone surrogate;
    ``gateway/core/jsonio.py``)."""
    try:
        return orjson.dumps(event, default=_fallback, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        return (json.dumps(event, default=_fallback) + "\n").encode()


class StderrLines:
    """Writes each line whole with one ``write`` to the process's standard error (the
    workers of ``fairgate serve --workers N`` share it: their lines must not interleave),
    straight to its file descriptor, not through ``sys.stderr``'s text layer. While
    something else stands in ``sys.stderr`` (pytest's capture), the line goes there, so
    whoever swapped it sees it."""

    def msg(self, line: bytes) -> None:
        err = sys.stderr
        if err is not sys.__stderr__ or _STDERR_FD is None:
            err.write(line.decode())
            err.flush()
            return
        written = os.write(_STDERR_FD, line)
        while written < len(line):  # a signal cut the write short
            line = line[written:]
            written = os.write(_STDERR_FD, line)

    log = debug = info = warn = warning = error = err = critical = exception = msg


def _stderr_fd() -> int | None:
    try:
        return sys.__stderr__.fileno() if sys.__stderr__ is not None else None
    except (AttributeError, OSError, ValueError):  # no file behind it
        return None


_STDERR_FD = _stderr_fd()
_STDERR_LINES = StderrLines()


def _stderr_lines(*_: Any) -> StderrLines:
    """structlog's logger factory: every logger writes through the one :class:`StderrLines`."""
    return _STDERR_LINES


class _CurrentStderr:
    """``sys.stderr`` as it is at each write (the console's lines, on a terminal)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


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
    factory: Callable[..., Any] = _stderr_lines
    if sys.stderr.isatty():  # the console renderer prints the exception itself
        # plainly: rich's highlighted traceback (structlog's default when rich is
        # installed) took seconds per exception on a busy machine, with the event loop
        # standing still meanwhile
        tail = [structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)]
        factory = structlog.WriteLoggerFactory(_CurrentStderr())  # type: ignore[arg-type]
    else:
        tail = [exception_fields, json_line]
    structlog.configure(
        processors=[
            merge_request,
            *([RequestLogSampler(sample_above_per_s)] if sample_above_per_s else []),
            LevelAndTime(),
            *tail,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=factory,
        cache_logger_on_first_use=cache,
    )
