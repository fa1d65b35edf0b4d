"""An admitted request's ticket: where it runs, with which vLLM priority, and what came
back. It is the relay's listener (``gateway/proxy/relay.py``): it hears the first token
(the gate slot frees at once), the token counts and the end of the answer, and it says
what the request is charged (:meth:`Ticket.charged`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from gateway.backends.handle import BackendHandle
from gateway.core.errors import UpstreamTimeout
from gateway.core.metrics.edge import StreamTiming
from gateway.proxy.moving import Mover
from gateway.scheduling.dispatcher import Dispatcher
from gateway.scheduling.waits import Waits
from gateway.storage.records import Grant


@dataclass(slots=True)
class Ticket:
    """An admitted request: where it runs, with which priority, and what came back."""

    model: str
    grant: Grant
    backend: BackendHandle
    priority: int
    dispatcher: Dispatcher
    timing: StreamTiming | None
    waits: Waits | None = None  # hears the dispatch-to-first-token time of a stream
    dispatched_s: float = field(default_factory=time.monotonic)
    wait_s: float = 0.0  # in the queue, from enqueued to dispatched (the finished line's)
    first_token_s: float | None = None  # monotonic, when its first token streamed
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, found in the backend's prefix cache
    completed: bool = False
    cancelled: bool = False  # its caller ended it (a client that hung up, a batch cancelled)
    unsent: bool = False  # nothing reached the backend: the dispatch cost is refunded
    # a whole (non-streamed) answer: nothing of it is counted until all of it came
    whole: bool = False
    timed_out: bool = False  # cut by upstream_timeout_s / max_request_s before its answer
    # (prompt, output) tokens it can cost at most: what a whole answer cut short is charged
    bound: tuple[int, int] = (0, 0)
    limit_headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-*
    usage_recorded: bool = False  # its usage counts rode on its settle
    # continuing the answer elsewhere: (reason, tokens to resend, the failed backend) → a
    # ticket for the rest, or None when no more continuations are allowed
    resumer: Callable[[str, int, BackendHandle],
                      AbstractAsyncContextManager[Ticket] | None] | None = None
    continuations: int = 0
    mover: Mover = field(default_factory=Mover)  # the relay's: moves the answer on purpose
    on_started: Callable[[], None] | None = None
    _started: bool = field(default=False, repr=False)

    def continuation(self, reason: str, tokens: int,
                     failed: BackendHandle) -> AbstractAsyncContextManager[Ticket] | None:
        """A ticket for the rest of this answer on another backend (``reason``: failover,
        or a move's: drain, preempt; ``tokens``: what the continuation sends again), or
        ``None``."""
        return None if self.resumer is None else self.resumer(reason, tokens, failed)

    async def first_token(self) -> None:
        if not self._started:
            self._started = True
            self.first_token_s = time.monotonic()
            if self.on_started is not None:
                self.on_started()
            if self.waits is not None and self.timing is not None:
                self.waits.first_token(self.model, time.monotonic() - self.dispatched_s)
            await self.dispatcher.started(self.model, self.grant)

    def tokens_sent(self, frames: int) -> None:
        if self.timing is not None:
            self.timing.token_frames_sent()

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> None:
        self.prompt_tokens = prompt_tokens or None
        self.completion_tokens = completion_tokens
        self.cached_tokens = cached_tokens

    def end(self, completed: bool) -> None:
        self.completed = completed

    def ended_by(self, exc: BaseException) -> None:
        """Its caller's code raised ``exc``: cancelled (a client that hung up, a batch
        cancelled), or the timeout cut its answer."""
        self.cancelled = self.cancelled or isinstance(exc, asyncio.CancelledError)
        self.timed_out = self.timed_out or isinstance(exc, UpstreamTimeout)

    @property
    def cut(self) -> bool:
        """A whole answer sent to its backend and cut before it came (its client left, a
        batch was cancelled, or the timeout fired): vLLM reports nothing of it, yet may
        have generated up to its output bound before it aborted it."""
        return (self.whole and not self.unsent and not self.completed
                and self.prompt_tokens is None and not self.completion_tokens  # no usage
                and (self.cancelled or self.timed_out))

    def charged(self, prompt_est: int) -> tuple[int, int]:
        """The (prompt, output) tokens it is charged: what the backend reported (the
        prompt's estimate when it said nothing); a :attr:`cut` whole answer its
        :attr:`bound`, so no one can generate for free by hanging up (docs/
        tenants-and-limits.md); nothing when nothing reached the backend."""
        if self.unsent:
            return 0, 0
        if self.cut:
            return self.bound
        return self.prompt_tokens or prompt_est, self.completion_tokens
