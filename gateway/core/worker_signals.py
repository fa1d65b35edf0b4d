"""What a worker of ``fairgate serve --workers N`` and its supervisor
(``gateway/runtime/workers.py``) share besides the ready pipe: the worker's index in its
environment, and SIGHUP, the config reload of every worker.

``POST /admin/reload`` reloads the worker that answered and asks the supervisor to pass
SIGHUP to all workers (that one reloads again: a reload is idempotent); SIGHUP to the
supervisor, or to a single ``fairgate serve`` process, reloads the same way.
"""

from __future__ import annotations

import os
import signal

WORKER_INDEX_ENV = "FAIRGATE_WORKER_INDEX"
RELOAD_SIGNAL = signal.SIGHUP


def worker_index() -> int | None:
    """This process's worker index, or None when it is not a worker."""
    value = os.environ.get(WORKER_INDEX_ENV)
    return int(value) if value else None


def reload_siblings() -> None:
    """As a worker: ask the supervisor to reload every worker (nothing otherwise)."""
    if worker_index() is not None:
        os.kill(os.getppid(), RELOAD_SIGNAL)
