"""Continuing a stream of several choices (``n`` > 1, a completions batch of prompts):
each unfinished choice continues from its own token ids (pure, no I/O; the relay and
``gateway/proxy/upstream.py`` drive it, ``gateway/proxy/fan_in.py`` reads the
continuations as one stream).

Every choice is a :class:`~gateway.proxy.continuation.Progress` of its own; this one
routes each frame's choices to theirs by ``index`` and keeps what the choices share.
vLLM 0.32 numbers prompt ``p``'s choice ``k`` ``p * n + k``; a completion choice's first
frame carries its prompt's ids, a chat stream's role frames carry the one prompt's ids at
the top level; the usage counts each prompt once and every choice's tokens
(``completion/serving.py``, ``chat_completion/serving.py``).

A continuation of choice ``i`` is a ``/v1/completions`` call with ``n`` 1 and, when the
request has a ``seed``, ``seed + i % n``: vLLM gives child ``k`` of a request the seed
``seed + k`` (``v1/engine/parallel_sampling.py``), so choice ``i`` continued alone samples
from its own seed. A finished choice stays finished: only the others continue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.proxy.completion_request import CompletionRequest
from gateway.proxy.continuation import Progress
from gateway.proxy.endpoints import CHAT


def progress_of(creq: CompletionRequest) -> StreamProgress | None:
    """A continuable stream's progress (one choice, or several); ``None``: not
    continuable."""
    if creq.choices == (1, 1):
        return Progress.of(creq)
    return ChoicesProgress.of(creq)


@dataclass(slots=True)
class ChoicesProgress:
    """A streamed answer of several choices as the client has received it so far."""

    chat: bool
    wants_ids: bool
    n: int
    parts: dict[int, Progress] = field(default_factory=dict)  # by the choice's index
    id: str | None = None
    created: int | None = None
    model: str | None = None
    base_generated: int = 0  # generated (all choices) before the current continuation
    continuations: int = 0
    # never set here: stop strings and echo are continued for one choice (continuation.py)
    changed: bool = False
    cut: bool = False

    @classmethod
    def of(cls, creq: CompletionRequest) -> ChoicesProgress | None:
        if creq.unresumable is not None:
            return None
        n, prompts = creq.choices
        chat = creq.endpoint is CHAT
        wants = creq.return_token_ids
        return cls(chat, wants, n, {i: Progress(chat, wants) for i in range(n * prompts)})

    def _part(self, choice: dict[str, Any]) -> Progress | None:
        index = choice.get("index")
        return self.parts.get(index) if isinstance(index, int) else None

    def _group(self, index: int) -> list[int] | None:
        """The prompt's ids of choice ``index`` (its own, or a sibling's of the same
        prompt)."""
        own = self.parts[index].prompt_ids
        if own is not None:
            return own
        first = index - index % self.n
        for i in range(first, first + self.n):
            if self.parts[i].prompt_ids is not None:
                return self.parts[i].prompt_ids
        return None

    @property
    def resumable(self) -> bool:
        """Some choice is unfinished, and every unfinished one's prompt ids came."""
        open_ = [i for i, p in self.parts.items() if p.finish_reason is None]
        return bool(open_) and all(self._group(i) is not None for i in open_)

    @property
    def finish_reason(self) -> str | None:
        """Every choice's last token came (the last one's reason); else ``None``."""
        reasons = [p.finish_reason for p in self.parts.values()]
        return None if None in reasons else reasons[-1]

    @property
    def generated(self) -> list[int]:
        return [t for p in self.parts.values() for t in p.generated]

    @property
    def resent(self) -> int:
        """The tokens a continuation sends again: each unfinished choice's prompt and what
        it generated."""
        return sum(len(self._group(i) or ()) + len(p.generated)
                   for i, p in self.parts.items() if p.finish_reason is None)

    @property
    def prompt_ids(self) -> list[int] | None:
        """Every prompt's ids, each once (``None``: none came)."""
        groups = [self._group(i) for i in range(0, len(self.parts), self.n)]
        known = [ids for ids in groups if ids is not None]
        return [t for ids in known for t in ids] if known else None

    def original(self, event: dict[str, Any]) -> dict[str, Any]:
        """Record an event of the original stream; the event for the client."""
        if self.id is None:
            self.id, self.created, self.model = (event.get("id"), event.get("created"),
                                                 event.get("model"))
        shared = event.get("prompt_token_ids") if self.chat else None
        if isinstance(shared, list) and shared:
            for part in self.parts.values():
                part.prompt_ids = list(shared)
            if not self.wants_ids:
                event["prompt_token_ids"] = None
        for choice in _choices(event):
            if (target := self._part(choice)) is not None:
                target.original({"choices": [choice]})  # its ids stripped in place
        return event

    def continuation_bodies(self, creq: CompletionRequest, stream: bool
                            ) -> list[tuple[int, dict[str, Any]]]:
        """(index, ``/v1/completions`` body) for each unfinished choice (``resumable``
        must hold)."""
        bodies = []
        for index, part in self.parts.items():
            if part.finish_reason is not None:
                continue
            part.prompt_ids = self._group(index) or []
            body = part.continuation_body(creq, stream)
            seed = body.get("seed")
            if isinstance(seed, int) and not isinstance(seed, bool):
                body["seed"] = seed + index % self.n
            bodies.append((index, body))
        self.base_generated = len(self.generated)
        self.continuations += 1
        return bodies

    def continued(self, event: dict[str, Any]) -> dict[str, Any]:
        """An event of the continuations' merged stream (``/v1/completions`` chunks
        whose ``index`` is the original choice's), re-framed as the original endpoint's."""
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat
                               else "text_completion", "created": self.created,
                               "model": self.model}
        choices = []
        for choice in _choices(event):
            if (part := self._part(choice)) is None:
                continue
            one = part.continued({"choices": [choice]})  # a part is never replayed: not None
            for reframed in [] if one is None else one["choices"]:
                reframed["index"] = choice["index"]
                choices.append(reframed)
        out["choices"] = choices
        if isinstance(event.get("usage"), dict):
            out["usage"] = self.usage()
        return out

    def usage(self) -> dict[str, int]:
        """Each prompt once, every choice's generated tokens."""
        prompt = len(self.prompt_ids or ())
        completion = sum(len(p.generated) for p in self.parts.values())
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion}

    def closing(self, wants_usage: bool) -> list[dict[str, Any]]:
        """The usage that ends an answer whose backend died after the last token."""
        if not wants_usage:
            return []
        return [{"id": self.id, "object": "chat.completion.chunk" if self.chat
                 else "text_completion", "created": self.created, "model": self.model,
                 "choices": [], "usage": self.usage()}]


# what the relay, a move and upstream.py read of a continuable stream
StreamProgress = Progress | ChoicesProgress


def _choices(event: dict[str, Any]) -> list[dict[str, Any]]:
    choices = event.get("choices")
    if not isinstance(choices, list):
        return []
    return [c for c in choices if isinstance(c, dict)]
