"""What a request costs: token estimates before a backend has tokenized anything, and
the weighted token cost that VTC fairness and the service metrics both count."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4


@dataclass(frozen=True, slots=True)
class TokenCost:
    """VTC's cost of service: prompt tokens × ``w_in`` + output tokens × ``w_out``."""

    w_in: float = 1.0
    w_out: float = 2.0

    def of(self, prompt_tokens: int, output_tokens: int, weight: float = 1.0) -> float:
        return (prompt_tokens * self.w_in + output_tokens * self.w_out) / weight


def _text_len(value: Any) -> int:
    """Characters of text in a prompt or message content (iterative: any nesting depth)."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.append(item.get("text", ""))
            stack.append(item.get("content", ""))
    return total


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        type(t) is int for t in value)


def _input_tokens(value: Any) -> int:
    """Tokens of an embeddings or Responses ``input``: a string, token ids, or an array
    of strings, token-id arrays or (Responses) message items."""
    if _is_token_ids(value):
        return len(value)
    if not isinstance(value, list):
        return max(1, _text_len(value) // CHARS_PER_TOKEN)
    tokens = 0
    for item in value:
        if _is_token_ids(item):
            tokens += len(item)
        elif isinstance(item, dict):  # a Responses input item: a message, a tool output
            tokens += _text_len(item) // CHARS_PER_TOKEN + MESSAGE_OVERHEAD_TOKENS
        else:
            tokens += max(1, _text_len(item) // CHARS_PER_TOKEN)
    return max(1, tokens)


def estimate_prompt_tokens(body: dict[str, Any], field: str | None = None) -> int:
    """≈ characters / 4 (+4 per chat message or Responses input item; token ids count
    one each) of the prompt in ``field`` (``messages``, ``input`` or ``prompt``; when
    not given, the first of them the body has); corrected by real usage at completion."""
    if field is None:
        field = next((f for f in ("messages", "input") if f in body), "prompt")
    if field == "messages":
        messages = body.get("messages") or []
        chars = sum(_text_len(m.get("content", "")) for m in messages if isinstance(m, dict))
        return chars // CHARS_PER_TOKEN + MESSAGE_OVERHEAD_TOKENS * len(messages)
    if field == "input":  # /v1/embeddings, /v1/responses
        instructions = body.get("instructions")
        extra = len(instructions) // CHARS_PER_TOKEN if isinstance(instructions, str) else 0
        return _input_tokens(body.get("input", "")) + extra
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)  # already token ids
    return max(1, _text_len(prompt) // CHARS_PER_TOKEN)
