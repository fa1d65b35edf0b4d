"""Supervision of long-lived loops: a loop that dies is a bug that hides.

:func:`supervise` runs one loop for the life of the gateway: when it raises (or returns,
which a loop never should) the failure is logged with its traceback, counted in
``fairgate_loop_restarts_total{loop}``, and the loop starts again after a jittered,
growing pause. Only cancellation (shutdown) ends it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

import structlog
from prometheus_client import Counter

log = structlog.get_logger("fairgate.supervise")

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0
HEALTHY_AFTER_S = 30.0  # a loop that ran this long before failing starts from a short pause


async def supervise(name: str, loop: Callable[[], Awaitable[None]], restarts: Counter,
                    first_backoff_s: float = FIRST_BACKOFF_S,
                    max_backoff_s: float = MAX_BACKOFF_S) -> None:
    backoff = first_backoff_s
    while True:
        started = time.monotonic()
        try:
            await loop()
            log.error("loop_returned", loop=name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("loop_crashed", loop=name, error=str(exc))
        restarts.labels(name).inc()
        if time.monotonic() - started >= HEALTHY_AFTER_S:
            backoff = first_backoff_s
        await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
        backoff = min(backoff * 2, max_backoff_s)


def start(name: str, loop: Callable[[], Awaitable[None]], restarts: Counter
          ) -> asyncio.Task[None]:
    """Run ``loop`` supervised in its own task named ``name``."""
    return asyncio.create_task(supervise(name, loop, restarts), name=name)
