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
  parameters (:meth:`Progress.continuation_body`).
- Its frames are re-framed in the original endpoint's format (:meth:`Progress.continued`):
  chat chunks stay chat chunks with the original ``id``, ``created`` and ``model``; the
  usage counts the whole answer once (the original prompt, every generated token).
- A request that a continuation cannot reproduce keeps today's behaviour
  (:func:`not_continuable` says why; ``docs/reliability.md`` lists the cases).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.proxy.endpoints import CHAT, COMPLETIONS, Endpoint
from policies.cost import output_bound

# copied to the continuation as they are: they shape each next token the same way
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
            "repetition_penalty", "skip_special_tokens", "spaces_between_special_tokens",
            "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "user",
            "cache_salt")
# framing and prompt construction: the continuation sends the prompt's ids instead
NEUTRAL = frozenset(("model", "messages", "prompt", "stream", "stream_options", "max_tokens",
                     "max_completion_tokens", "n", "priority", "return_token_ids",
                     "min_tokens", "add_generation_prompt", "continue_final_message",
                     "add_special_tokens", "chat_template", "chat_template_kwargs",
                     "documents", "request_id", "metadata", "store", "service_tier",
                     "parallel_tool_calls", "tool_choice", "echo", "logprobs",
                     "top_logprobs", "prompt_logprobs"))


def not_continuable(endpoint: Endpoint, body: dict[str, Any]) -> str | None:
    """Why a continuation could not reproduce this request's answer; ``None``: it can.

    Every field outside :data:`SAMPLING` and :data:`NEUTRAL` that is set (not null,
    false, zero or empty) counts: ``stop`` strings (text held back for them lags the token
    ids), ``n`` or ``best_of`` above 1, ``echo``, log probabilities, structured output
    (``response_format``, ``guided_*``, ``structured_outputs``), ``tools``, presence and
    frequency penalties (they count only the generated tokens, which a continuation sends
    as its prompt), ``suffix`` and anything fairgate does not know."""
    if endpoint not in (CHAT, COMPLETIONS):
        return f"{endpoint.path} is not continued"
    if body.get("n") not in (None, 1):
        return "n > 1"
    if not _token_prompt_ok(endpoint, body):
        return "more than one prompt"
    for name in ("echo", "logprobs", "top_logprobs", "prompt_logprobs"):
        if body.get(name):
            return f"{name} is set"
    if body.get("tool_choice") not in (None, "none"):
        return "tool_choice is set"
    for name, value in body.items():
        if name in NEUTRAL or name in SAMPLING:
            continue
        if value is None or value is False or value == 0 or value == [] or value == {}:
            continue
        if name == "response_format" and isinstance(value, dict) and value.get(
                "type") == "text":
            continue
        if name == "best_of" and value == 1:
            continue
        return f"{name} is set"
    return None


def _token_prompt_ok(endpoint: Endpoint, body: dict[str, Any]) -> bool:
    if endpoint is not COMPLETIONS:
        return True
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt) == 1
    return True


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
    def of(cls, endpoint: Endpoint, body: dict[str, Any]) -> Progress | None:
        """The progress of a request that can be continued; ``None`` for one that cannot."""
        if not_continuable(endpoint, body) is not None:
            return None
        return cls(endpoint is CHAT, bool(body.get("return_token_ids")))

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

    def continuation_body(self, body: dict[str, Any], endpoint: Endpoint,
                          stream: bool) -> dict[str, Any]:
        """The ``/v1/completions`` body that continues the answer (``resumable`` must
        hold)."""
        if self.prompt_ids is None:
            raise ValueError("the prompt's token ids never came: nothing to continue from")
        out = {name: body[name] for name in SAMPLING if name in body}
        out.update(model=body["model"], prompt=self.prompt_ids + self.generated,
                   return_token_ids=True, stream=stream)
        if stream:
            out["stream_options"] = {"include_usage": True}
        bound = output_bound(body, endpoint.output_token_fields)
        if bound is not None:
            out["max_tokens"] = max(1, bound - len(self.generated))
        min_tokens = body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > 0:
            out["min_tokens"] = max(0, min_tokens - len(self.generated))
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
