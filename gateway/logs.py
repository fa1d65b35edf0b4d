"""structlog setup: JSON lines when not on a terminal, pretty console otherwise.

Request context (request_id, user, model, class) is bound with contextvars per request.
Prompt/completion text and API keys are never logged.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: int | str = logging.INFO) -> None:
    """``level``: a logging level or its name (``log_level``, env ``FAIRGATE_LOG_LEVEL``)."""
    if isinstance(level, str):
        level = logging.getLevelNamesMapping()[level.upper()]
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer() if sys.stderr.isatty()
        else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
