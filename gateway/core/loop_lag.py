"""How late the event loop runs: every :data:`PROBE_S` a timer is set, and how late it
fired is observed in ``fairgate_event_loop_lag_seconds``. A busy loop (a long callback, a
big snapshot tick, a starved CPU) delays every request this process serves by as much,
and no other metric shows it: the queue wait and the Redis round trips only grow with it.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

PROBE_S = 0.25  # four wake-ups a second: nothing next to the scrapes


async def watch(lag: Histogram, every_s: float = PROBE_S) -> None:
    """Observe the loop's lateness into ``lag``, for the life of the process."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + every_s
        await asyncio.sleep(every_s)
        lag.observe(max(0.0, loop.time() - due))
