"""Token-cost estimates made before a backend has tokenized anything."""

from __future__ import annotations

from typing import Any

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4


def _text_len(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_len(v) for v in value)
    if isinstance(value, dict):
        return _text_len(value.get("text", "")) + _text_len(value.get("content", ""))
    return 0


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """≈ characters / 4 (+4 per chat message); corrected by real usage at completion."""
    if "messages" in body:
        messages = body["messages"]
        chars = sum(_text_len(m.get("content", "")) for m in messages if isinstance(m, dict))
        return chars // CHARS_PER_TOKEN + MESSAGE_OVERHEAD_TOKENS * len(messages)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)  # already token ids
    return max(1, _text_len(prompt) // CHARS_PER_TOKEN)
