"""Timed waits that never lose a cancellation.

On Python 3.11 ``asyncio.wait_for`` returns normally when what it waits for finishes just
as the waiting task is cancelled (CPython gh-86296; 3.12 rebuilt ``wait_for`` on
``asyncio.timeout``): the cancellation is gone, and a loop being shut down runs on. The
gateway's timed waits use :func:`event_set` and ``asyncio.timeout`` instead, which keep it.

redis-py itself sends every command through ``wait_for`` once ``socket_timeout`` is set
(``gateway/storage/redis_client.py`` sets it: a frozen Redis must not hang a request), so
the Redis boundary runs each command in :class:`KeepCancel`: when the command ends with
more cancellations pending than it began with, and none is on its way up, it raises one.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


async def event_set(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passes (None: no limit); whether it
    is set."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(None if timeout_s is None else max(0.0, timeout_s)):
            await event.wait()
    except TimeoutError:
        pass
    return event.is_set()


class KeepCancel:
    """``with KeepCancel():`` around a library call that may swallow a cancellation: one
    requested meanwhile and swallowed is raised at the end, in place of a return value or
    of another error (a cancelled task must stop, not run on)."""

    __slots__ = ("before", "task")

    def __enter__(self) -> None:
        self.task = task = asyncio.current_task()
        self.before = 0 if task is None else task.cancelling()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        task = self.task
        if task is not None and task.cancelling() > self.before \
                and (kind is None or not issubclass(kind, asyncio.CancelledError)):
            raise asyncio.CancelledError
