"""Per-request records and the token stream a caller consumes.

All times are ``loop.time()`` seconds (monotonic).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request; ``engine.records`` maps request id to these."""

    request_id: str
    priority: int
    prompt_tokens: int
    max_tokens: int
    arrival_s: float
    output_tokens: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    num_preemptions: int = 0
    aborted: bool = False
    finish_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Token:
    """One generated token: its 0-based position and when the engine emitted it."""

    index: int
    emit_s: float


class RequestStream:
    """Tokens of one request as an async iterator; ends when the request finishes.

    ``next_batch()`` returns every token available at once (one wake-up per engine
    step), which is what the HTTP layer uses to keep per-token work small.
    """

    __slots__ = ("_done", "_event", "_pending", "record")

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self._pending: deque[Token] = deque()
        self._event = asyncio.Event()
        self._done = False

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.record.request_id

    @property
    def finished(self) -> bool:
        """True once the engine will push no more tokens."""
        return self._done

    def push(self, token: Token) -> None:
        """Engine side: deliver a token."""
        self._pending.append(token)
        self._event.set()

    def close(self) -> None:
        """Engine side: no more tokens (finished or aborted)."""
        self._done = True
        self._event.set()

    async def next_batch(self) -> list[Token]:
        """Wait for tokens; return all available ones, or ``[]`` at the end."""
        while not self._pending:
            if self._done:
                return []
            self._event.clear()
            await self._event.wait()
        batch = list(self._pending)
        self._pending.clear()
        return batch

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Token:
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()
        return self._pending.popleft()
