"""Which client connection the running request arrived on has authenticated.

The HTTP side (``gateway/http/client_guard.py``) binds a marker for each request; the key
checks (``gateway/access/auth.py``, ``gateway/access/sessions.py``) call
:func:`authenticated` once a caller proved who it is. The server
(``gateway/http/server.py``) gives connections that never authenticated a smaller
allowance than the connection cap, so they cannot crowd out the users it serves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

_MARK: ContextVar[Callable[[], None] | None] = ContextVar("fairgate_connection_mark",
                                                          default=None)


def authenticated() -> None:
    """The running request's connection authenticated (no-op outside a request)."""
    mark = _MARK.get()
    if mark is not None:
        mark()


@contextlib.contextmanager
def marking(mark: Callable[[], None]) -> Iterator[None]:
    token = _MARK.set(mark)
    try:
        yield
    finally:
        _MARK.reset(token)
