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
    choice: int = 0  # index among the request's n choices
    n: int = 1
    pooling: bool = False  # an embedding: prefill only, nothing generated
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    lora: str | None = None  # the LoRA adapter it ran with (None: the base model)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Token:
    """One generated token: its 0-based position in its choice, when the engine emitted
    it, which of the request's ``n`` choices it belongs to, and the choice's finish reason
    when it is that choice's last token (vLLM sends the last token and the finish reason
    in one frame)."""

    index: int
    emit_s: float
    choice: int = 0
    finish_reason: str | None = None


class RequestStream:
    """Tokens of one request as an async iterator; ends when the request finishes.

    A request with ``n`` > 1 is ``n`` engine requests (one per choice, like vLLM's child
    requests) feeding one stream; it ends when all of them have. ``next_batch()`` returns
    every token available at once (one wake-up per engine step), which is what the HTTP
    layer uses to keep per-token work small.
    """

    __slots__ = ("_done", "_event", "_open", "_pending", "records")

    def __init__(self, records: list[RequestRecord]) -> None:
        self.records = records
        self._pending: deque[Token] = deque()
        self._event = asyncio.Event()
        self._open = len(records)
        self._done = False

    @property
    def record(self) -> RequestRecord:
        """The (first choice's) record."""
        return self.records[0]

    @property
    def request_id(self) -> str:
        """The (first choice's) engine request id."""
        return self.records[0].request_id

    @property
    def request_ids(self) -> list[str]:
        """The engine request ids of every choice."""
        return [r.request_id for r in self.records]

    @property
    def aborted(self) -> bool:
        """True if any choice was aborted."""
        return any(r.aborted for r in self.records)

    @property
    def finished(self) -> bool:
        """True once the engine will push no more tokens."""
        return self._done

    def push(self, token: Token) -> None:
        """Engine side: deliver a token."""
        self._pending.append(token)
        self._event.set()

    def close(self) -> None:
        """Engine side: one choice ends (finished or aborted); the stream ends with the
        last one."""
        self._open -= 1
        if self._open <= 0:
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
