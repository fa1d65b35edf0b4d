"""structlog setup: JSON lines when not on a terminal, pretty console otherwise.

Request context (request_id, user, model, class) is bound with contextvars per request.
Prompt/completion text and API keys are never logged.

An event logged with an exception (``log.exception(...)``) carries ``exc_type``,
``exc_message`` and ``exception``, the formatted traceback (frames and source lines, no
local variables: those may hold prompts or keys).
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType
from typing import Any

import structlog
from structlog.typing import EventDict, WrappedLogger

ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]


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


def configure_logging(level: int | str = logging.INFO) -> None:
    """``level``: a logging level or its name (``log_level``, env ``FAIRGATE_LOG_LEVEL``)."""
    if isinstance(level, str):
        level = logging.getLevelNamesMapping()[level.upper()]
    tail: list[structlog.typing.Processor]
    if sys.stderr.isatty():  # the console renderer prints the exception itself
        tail = [structlog.dev.ConsoleRenderer()]
    else:
        tail = [exception_fields, structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *tail,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
