"""Which event loop ``fairgate serve`` runs: uvloop when installed (a dependency on the
platforms it is built for: CPython outside Windows), asyncio's own otherwise; setting
``event_loop`` (``auto``, ``uvloop``, ``asyncio``).

The gateway runs the same on either loop, and one log line says which.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("fairgate.loop")

T = TypeVar("T")


def loop_factory(choice: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """The loop's name and its factory (None: asyncio's default) for ``choice``."""
    if choice == "asyncio":
        return "asyncio", None
    if importlib.util.find_spec("uvloop") is None:
        if choice == "uvloop":
            raise RuntimeError("event_loop: uvloop is not installed (pip install 'fairgate[fast]')")
        return "asyncio", None
    import uvloop

    return "uvloop", uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """``asyncio.run(main)`` on the chosen loop, saying which in the log."""
    name, factory = loop_factory(choice)
    with asyncio.Runner(loop_factory=factory) as runner:
        log.info("event_loop", loop=name)
        return runner.run(main)
