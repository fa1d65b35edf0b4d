"""Moving a running answer on purpose: the seam between whoever decides to move it (a
drain, preemption) and the relay that continues it elsewhere.

One :class:`Mover` per answer. The relay attaches each backend response it reads (the
original's, then every continuation's; for a whole answer also the request whose status
line vLLM sends only with the whole answer); a move closes what is attached (vLLM sees
the connection drop, aborts the request and frees its KV cache) and leaves the reason
behind, so the relay's continuation path (``gateway/proxy/relay.py``) takes over with
that reason instead of ``failover``.

Only an answer a continuation reproduces exactly is movable: a stream whose token ids
came (:attr:`Progress.resumable <gateway.proxy.continuation.Progress.resumable>`), or a
whole (non-streamed) answer, which is sent again. Every other stream (not continuable,
its first frame not in yet, or its last token already relayed) is never moved.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp

from gateway.proxy.choices import StreamProgress

# why an answer continues elsewhere: its backend failed, or it was moved on purpose
FAILOVER, DRAIN, PREEMPT = "failover", "drain", "preempt"
# ... or its backend answered a whole request with a 5xx: sent once more, the backend not
# taken for failing (it answered; the error may be the request's)
RETRY = "retry"


class Moved(aiohttp.ClientPayloadError):
    """The answer's response was closed on purpose; the relay continues it elsewhere."""


class Failable(Protocol):
    """What a move fails of a response's body (``aiohttp.StreamReader``, ``FanIn``'s)."""

    def set_exception(self, exc: BaseException) -> None: ...


class Closable(Protocol):
    """What a move needs of a backend response (``aiohttp.ClientResponse``)."""

    @property
    def content(self) -> Failable: ...

    def close(self) -> None: ...


class Mover:
    """One answer's current backend response and the move asked of it, if any."""

    __slots__ = ("_close", "progress", "reason", "whole")

    def __init__(self) -> None:
        self.progress: StreamProgress | None = None  # a continuable stream's progress
        self.whole = False  # a non-streamed answer: nothing reaches the client until it ends
        self.reason: str | None = None  # the move asked, until the relay takes it
        # closes what the relay reads now; False: that was over already
        self._close: Callable[[], bool] | None = None

    @property
    def generated(self) -> int:
        """Tokens generated so far (known for a continuable stream only)."""
        return 0 if self.progress is None else len(self.progress.generated)

    @property
    def streaming(self) -> bool:
        """The backend it reads now has generated tokens of it (a continuable stream with
        no move pending): vLLM runs it there, or has just finished it."""
        progress = self.progress
        return (self._close is not None and self.reason is None and progress is not None
                and len(progress.generated) > progress.base_generated)

    @property
    def movable(self) -> bool:
        """A continuation would reproduce the rest exactly, and the relay reads something
        a move can close."""
        if self._close is None or self.reason is not None:
            return False
        return self.whole or (self.progress is not None and self.progress.resumable)

    def attach(self, resp: Closable) -> None:
        """The relay reads ``resp`` now."""
        def close() -> bool:
            resp.content.set_exception(Moved("the answer was moved"))
            resp.close()  # the connection drops: vLLM aborts the request
            return True
        self._close = close

    def attach_pending(self, request: asyncio.Future[Any]) -> None:
        """A whole answer's request waits for its status line (``request``); a move
        cancels it, which drops the connection."""
        self._close = request.cancel

    def detach(self) -> None:
        """The relay stopped reading (the answer ended, failed or was moved)."""
        self._close = None

    def move(self, reason: str) -> bool:
        """Close what the relay reads so the answer continues elsewhere with ``reason``;
        ``False`` (nothing done) when the answer is not movable now."""
        if reason == FAILOVER:
            raise ValueError("a move is on purpose: drain or preempt, not failover")
        if not self.movable or self._close is None or not self._close():
            return False
        self.reason = reason  # the relay runs again only after this returns
        return True

    def take(self) -> str | None:
        """The reason of the move that ended what the relay read (``None``: it failed)."""
        reason, self.reason = self.reason, None
        return reason
