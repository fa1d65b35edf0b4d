"""What a request costs: token estimates before a backend has tokenized anything, the
most a request can cost (what limits reserve), and the weighted token cost that VTC
fairness and the service metrics both count."""

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


def _units(text: str) -> int:
    """A text's size in quarter tokens: an ASCII character is a quarter (a text's ASCII
    part rounded up to whole tokens), every UTF-8 byte of any other character a token."""
    ascii_chars = len(text) if text.isascii() else len(text.encode("ascii", "ignore"))
    other_bytes = (0 if ascii_chars == len(text)
                   else len(text.encode("utf-8", "surrogatepass")) - ascii_chars)
    return -(-ascii_chars // CHARS_PER_TOKEN) * CHARS_PER_TOKEN + CHARS_PER_TOKEN * other_bytes


def _prompt_units(value: Any) -> int:
    """Quarter tokens of a prompt or message content: its text (:func:`_units`) and its
    token ids, one token each (iterative: any nesting depth)."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += _units(item)
        elif isinstance(item, list):
            if item and all(type(t) is int for t in item):  # token ids, at C speed
                total += CHARS_PER_TOKEN * len(item)
            else:
                stack.extend(item)
        elif isinstance(item, dict):
            stack.append(item.get("text", ""))
            stack.append(item.get("content", ""))
        elif type(item) is int:
            total += CHARS_PER_TOKEN
    return total


def _tokens(value: Any, floor: int = 1) -> int:
    return max(floor, _prompt_units(value) // CHARS_PER_TOKEN)


def estimate_prompt_tokens(body: dict[str, Any], field: str | None = None) -> int:
    """The prompt tokens of the prompt in ``field`` (``messages``, ``input`` or ``prompt``;
    when not given, the first of them the body has), before a backend tokenized it;
    corrected by real usage at completion.

    Counted as: a token per token id (at any nesting: ``[[ids], …]`` too), a token per
    UTF-8 byte of every non-ASCII character, a quarter token per ASCII character, and 4
    per chat message or Responses input item. The bound: the estimate is never below the
    real count for token ids and for any non-ASCII script (a byte-level BPE tokenizer
    emits at most one token per byte: emoji, CJK and the like cannot be made to look
    short), nor for ASCII text of about 4 or more characters a token (natural language,
    code); only ASCII crafted to tokenize denser than that can be up to 4× over it.
    """
    if field is None:
        field = next((f for f in ("messages", "input") if f in body), "prompt")
    if field == "messages":
        messages = body.get("messages") or []
        content = [m.get("content", "") for m in messages if isinstance(m, dict)]
        return _tokens(content, 0) + MESSAGE_OVERHEAD_TOKENS * len(messages)
    if field == "input":  # /v1/embeddings, /v1/responses
        value = body.get("input", "")
        items = sum(1 for i in value if isinstance(i, dict)) if isinstance(value, list) else 0
        instructions = body.get("instructions")
        extra = _tokens(instructions, 0) if isinstance(instructions, str) else 0
        return _tokens(value) + MESSAGE_OVERHEAD_TOKENS * items + extra
    return _tokens(body.get("prompt", ""))


def max_cost_tokens(prompt_estimate: int, body: dict[str, Any], output_fields: tuple[str, ...],
                    context_tokens: int) -> int:
    """What a request can cost at most, in tokens: what limits and budgets reserve before
    the backend reports the real count.

    Its prompt estimate, plus its output bound — the largest of the output-token fields
    of ``output_fields`` (those the endpoint honours) the body sets, else
    ``context_tokens`` (the model's context length), never more than that — times the
    sequences it generates (the larger of ``n`` and ``best_of``). The largest, not the
    smallest: the backend picks one of them (vLLM takes ``max_completion_tokens`` over
    ``max_tokens``), and only the largest bounds whichever it picks. An endpoint without
    output (``output_fields`` empty: embeddings) costs its prompt.
    """
    prompt = max(0, prompt_estimate)
    if not output_fields:
        return prompt
    bounds = [_count(body.get(f), 0) for f in output_fields if f in body]
    output = min(context_tokens, max(bounds)) if any(bounds) else context_tokens
    sequences = max(1, *(_count(body.get(f), 1) for f in ("n", "best_of")))
    return prompt + max(0, output) * sequences


def _count(value: Any, absent: int) -> int:
    """A body's count field, or ``absent`` when it is not a number."""
    return value if isinstance(value, int) and not isinstance(value, bool) else absent
