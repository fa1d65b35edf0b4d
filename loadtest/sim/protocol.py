"""OpenAI request parsing, token-count approximations and vLLM-style errors.

Token counts (no tokenizer; deterministic and documented):

- a prompt string costs ``ceil(len(utf8 bytes) / 4)`` tokens (at least 1); a prompt given
  as token ids costs one token per id;
- a chat request costs, per message, ``4 + ceil(len(utf8 content) / 4)`` tokens, plus 3
  for the assistant reply header (like OpenAI's cookbook formula);
- the output length is ``max_tokens`` with ``ignore_eos``; otherwise a seeded draw from
  ``hash(seed, prompt)`` uniform in [16, 512], capped by ``max_tokens`` (whose default is
  ``max_model_len - prompt_tokens``). It ends with ``finish_reason`` "length" when the cap
  cut it, else "stop".
- the output text is one filler word per token, chosen from ``hash(seed, prompt)``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

PRIORITY_HEADER = "X-Vllm-Priority"
CHARS_PER_TOKEN = 4
CHAT_MESSAGE_OVERHEAD = 4
CHAT_REPLY_OVERHEAD = 3
MIN_DRAW, MAX_DRAW = 16, 512
FILLER = (
    "the", "model", "is", "simulated", "and", "every", "token", "costs", "time", "on",
    "an", "imaginary", "GPU", "while", "fair", "queues", "wait", "patiently",
)  # fmt: skip


class SimError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def error_type(self) -> str:
        """vLLM's ``type`` for this status."""
        return {404: "NotFoundError", 500: "InternalServerError"}.get(
            self.status, "BadRequestError"
        )

    def body(self) -> dict[str, Any]:
        """The JSON body vLLM answers with."""
        return {
            "object": "error",
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            },
        }


@dataclass(frozen=True)
class SimRequest:
    """The fields of a completion or chat request the simulator acts on."""

    chat: bool
    prompt_key: bytes
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    priority: int
    stream: bool
    include_usage: bool
    seed_hash: int

    def word(self, index: int) -> str:
        """The filler text of output token ``index``."""
        return " " + FILLER[(self.seed_hash + index) % len(FILLER)]

    def text(self, count: int) -> str:
        """The first ``count`` tokens' text."""
        return "".join(self.word(i) for i in range(count))


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object body or raise a 400."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SimError(400, f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise SimError(400, "The request body must be a JSON object")
    return body


def _int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SimError(400, f"'{name}' must be an integer", param=name)
    return value


def _prompt(body: dict[str, Any], chat: bool) -> tuple[bytes, int]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SimError(400, "'messages' must be a non-empty list", param="messages")
        key = json.dumps(messages, sort_keys=True).encode()
        tokens = CHAT_REPLY_OVERHEAD
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            text = content if isinstance(content, str) else ""
            tokens += CHAT_MESSAGE_OVERHEAD + -(-len(text.encode()) // CHARS_PER_TOKEN)
        return key, tokens
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        data = prompt.encode()
        return data, max(1, -(-len(data) // CHARS_PER_TOKEN))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return json.dumps(prompt).encode(), len(prompt)
    raise SimError(
        400, "'prompt' must be a string or a list of token ids (one prompt)", param="prompt"
    )


def parse_request(
    body: dict[str, Any],
    *,
    chat: bool,
    headers_priority: str | None,
    model_len: int,
    seed: int,
) -> SimRequest:
    """Validate a request body and derive token counts; raise ``SimError`` on bad input."""
    n = _int_field(body, "n", 1)
    if n != 1:
        raise SimError(400, f"n={n} is not supported by the simulator: use n=1", param="n")
    priority = _int_field(body, "priority", 0) or 0
    if headers_priority is not None:
        try:
            priority = int(headers_priority)
        except ValueError as exc:
            raise SimError(400, f"{PRIORITY_HEADER} must be an integer") from exc
    key, prompt_tokens = _prompt(body, chat)
    max_tokens = _int_field(body, "max_tokens", None)
    if chat:
        max_tokens = _int_field(body, "max_completion_tokens", max_tokens)
    if prompt_tokens >= model_len or (
        max_tokens is not None and prompt_tokens + max_tokens > model_len
    ):
        raise SimError(
            400,
            f"This model's maximum context length is {model_len} tokens. However, you "
            f"requested {prompt_tokens + (max_tokens or 0)} tokens ({prompt_tokens} in the "
            f"input, {max_tokens or 0} in the completion). Please reduce the length of the "
            "input or completion.",
            param="messages" if chat else "prompt",
        )
    if max_tokens is None:
        max_tokens = model_len - prompt_tokens
    if max_tokens < 1:
        raise SimError(400, "max_tokens must be at least 1", param="max_tokens")
    digest = hashlib.blake2b(key, digest_size=8, key=seed.to_bytes(8, "big", signed=True))
    seed_hash = int.from_bytes(digest.digest(), "big")
    draw = MIN_DRAW + seed_hash % (MAX_DRAW - MIN_DRAW + 1)
    output_tokens = max_tokens if body.get("ignore_eos") else min(draw, max_tokens)
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    return SimRequest(
        chat=chat,
        prompt_key=key,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        output_tokens=output_tokens,
        priority=priority,
        stream=bool(body.get("stream")),
        include_usage=include_usage,
        seed_hash=seed_hash,
    )
