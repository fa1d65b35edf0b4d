"""Continuing a running answer on another backend: what fairgate keeps of a chat or
completion stream, the request that continues it, and the re-framing of what comes back.

Pure protocol logic on plain data (no I/O); ``gateway/proxy/relay.py`` and
``gateway/proxy/upstream.py`` drive it.

- fairgate asks the backend for ``return_token_ids`` (vLLM 0.32: ``prompt_token_ids``,
  top level in chat's first frame, on a completion choice's first frame; ``token_ids`` on
  every choice) and strips those fields before the client sees them unless the client
  asked for them itself (:meth:`Progress.original`).
- A continuation is a ``/v1/completions`` call whose prompt is the prompt's ids plus the
  ids generated so far, ``max_tokens`` reduced by what was generated, the same sampling
  parameters (:meth:`Progress.continuation_body`), all read from the typed request
  (``gateway/proxy/completion_request.CompletionRequest``), never from its body.
- Its frames are re-framed in the original endpoint's format (:meth:`Progress.continued`):
  chat chunks stay chat chunks with the original ``id``, ``created`` and ``model``; the
  usage counts the whole answer once (the original prompt, every generated token).
- A request that a continuation cannot reproduce keeps today's behaviour
  (:func:`not_continuable` says why; ``docs/reliability.md`` lists the cases).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.proxy.completion_request import CompletionRequest
from gateway.proxy.endpoints import CHAT
from gateway.proxy.penalties import continued_bias


def not_continuable(creq: CompletionRequest) -> str | None:
    """Why a continuation could not reproduce this request's answer; ``None``: it can
    (read with the body: ``completion_request._unresumable`` lists the cases)."""
    return creq.unresumable


def _empty(value: Any) -> bool:
    return value is None or value == []


@dataclass(slots=True)
class Progress:
    """One streamed answer (a single choice) as the client has received it so far."""

    chat: bool
    wants_ids: bool  # the client asked for return_token_ids itself
    id: str | None = None
    created: int | None = None
    model: str | None = None
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    base_generated: int = 0  # generated before the current continuation began
    continuations: int = 0

    @classmethod
    def of(cls, creq: CompletionRequest) -> Progress | None:
        """The progress of a request that can be continued; ``None`` for one that cannot."""
        if creq.unresumable is not None:
            return None
        return cls(creq.endpoint is CHAT, creq.return_token_ids)

    @property
    def resumable(self) -> bool:
        """Enough is known to continue by token ids (the prompt's ids came)."""
        return self.prompt_ids is not None and self.finish_reason is None

    def original(self, event: dict[str, Any]) -> dict[str, Any]:
        """Record an event of the original stream; the event for the client."""
        if self.id is None:
            self.id, self.created, self.model = (event.get("id"), event.get("created"),
                                                 event.get("model"))
        if self.chat and not _empty(event.get("prompt_token_ids")):
            self.prompt_ids = list(event["prompt_token_ids"])
            if not self.wants_ids:
                event["prompt_token_ids"] = None
        for choice in _choices(event):
            if not self.chat and not _empty(choice.get("prompt_token_ids")):
                self.prompt_ids = list(choice["prompt_token_ids"])
                if not self.wants_ids:
                    choice["prompt_token_ids"] = None
            self._record(choice)
        return event

    def _record(self, choice: dict[str, Any]) -> None:
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.generated += ids
            if not self.wants_ids:
                choice["token_ids"] = None
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]

    def continuation_body(self, creq: CompletionRequest, stream: bool) -> dict[str, Any]:
        """The ``/v1/completions`` body that continues the answer (``resumable`` must
        hold): the request's sampling parameters, its prompt's ids and what was generated,
        its output bound less what was generated."""
        if self.prompt_ids is None:
            raise ValueError("the prompt's token ids never came: nothing to continue from")
        out = dict(creq.sampling)
        out.update(model=creq.model, prompt=self.prompt_ids + self.generated,
                   return_token_ids=True, stream=stream)
        if stream:
            out["stream_options"] = {"include_usage": True}
        bound = creq.output.bound
        if bound is not None:
            out["max_tokens"] = max(1, bound - len(self.generated))
        if creq.min_tokens > 0:
            out["min_tokens"] = max(0, creq.min_tokens - len(self.generated))
        if (bias := continued_bias(out, self.generated)) is not None:
            out["logit_bias"] = bias  # the penalties the generated tokens carried
        self.base_generated = len(self.generated)
        self.continuations += 1
        return out

    def continued(self, event: dict[str, Any]) -> dict[str, Any]:
        """An event of a continuation's stream (``/v1/completions`` chunks), re-framed as
        the original endpoint's chunk."""
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat
                               else "text_completion", "created": self.created,
                               "model": self.model}
        choices = []
        for choice in _choices(event):
            self._record(choice)
            choices.append(self._reframed(choice))
        out["choices"] = choices
        usage = event.get("usage")
        if isinstance(usage, dict):
            out["usage"] = self.usage()
        if "system_fingerprint" in event:
            out["system_fingerprint"] = event["system_fingerprint"]
        return out

    def _reframed(self, choice: dict[str, Any]) -> dict[str, Any]:
        ids = choice.get("token_ids") if self.wants_ids else None
        finish = choice.get("finish_reason")
        if self.chat:
            out: dict[str, Any] = {"index": 0, "delta": {"content": choice.get("text", "")},
                                   "logprobs": None, "finish_reason": finish,
                                   "token_ids": ids}
            if finish is not None:
                out["stop_reason"] = choice.get("stop_reason")
            return out
        return {"index": 0, "text": choice.get("text", ""), "logprobs": None,
                "finish_reason": finish, "stop_reason": choice.get("stop_reason"),
                "prompt_token_ids": None, "token_ids": ids}

    def usage(self) -> dict[str, int]:
        """The whole answer's usage: the original prompt, every generated token."""
        prompt = len(self.prompt_ids or ())
        completion = len(self.generated)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion}

    def closing(self, wants_usage: bool) -> list[dict[str, Any]]:
        """The events that end an answer whose last token came but whose backend died
        before its usage frame: the usage (when the client asked for it)."""
        if not wants_usage:
            return []
        return [{"id": self.id, "object": "chat.completion.chunk" if self.chat
                 else "text_completion", "created": self.created, "model": self.model,
                 "choices": [], "usage": self.usage()}]


def _choices(event: dict[str, Any]) -> list[dict[str, Any]]:
    choices = event.get("choices")
    if not isinstance(choices, list):
        return []
    return [c for c in choices if isinstance(c, dict)]
