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


class Backoff:
    """Pauses between restarts: ``first_s`` doubling up to ``cap_s``; :meth:`reset` after
    a run that was healthy. Shared by the loops here and the worker processes
    (``gateway/runtime/workers.py``)."""

    __slots__ = ("cap_s", "first_s", "next_s")

    def __init__(self, first_s: float, cap_s: float) -> None:
        self.first_s, self.cap_s = first_s, cap_s
        self.next_s = first_s

    def take(self) -> float:
        """The pause to wait now; the next one doubles (up to the cap)."""
        pause = self.next_s
        self.next_s = min(self.next_s * 2, self.cap_s)
        return pause

    def reset(self) -> None:
        self.next_s = self.first_s


async def supervise(name: str, loop: Callable[[], Awaitable[None]], restarts: Counter,
                    first_backoff_s: float = FIRST_BACKOFF_S,
                    max_backoff_s: float = MAX_BACKOFF_S) -> None:
    backoff = Backoff(first_backoff_s, max_backoff_s)
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
            backoff.reset()
        await asyncio.sleep(backoff.take() * random.uniform(0.5, 1.5))


def start(name: str, loop: Callable[[], Awaitable[None]], restarts: Counter
          ) -> asyncio.Task[None]:
    """Run ``loop`` supervised in its own task named ``name``."""
    return asyncio.create_task(supervise(name, loop, restarts), name=name)
