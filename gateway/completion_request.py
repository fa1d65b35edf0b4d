"""Validation of an incoming ``/v1/completions`` or ``/v1/chat/completions`` body.

Only what fairgate needs is checked; every other field passes through to vLLM untouched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.errors import BadRequest, PayloadTooLarge

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(slots=True)
class CompletionRequest:
    path: str
    body: dict[str, Any]

    @property
    def model(self) -> str:
        return str(self.body["model"])

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream", False))

    @property
    def end_user(self) -> str | None:
        user = self.body.get("user")
        return user if isinstance(user, str) and user else None


async def read_completion(request: web.Request, path: str, max_bytes: int) -> CompletionRequest:
    if request.content_length is not None and request.content_length > max_bytes:
        raise PayloadTooLarge(f"request body is larger than {max_bytes} bytes")
    # StreamReader.read(n) returns whatever has arrived (up to n), not n bytes: read to EOF,
    # stopping as soon as the body is known to be too large.
    parts: list[bytes] = []
    size = 0
    while chunk := await request.content.read(max_bytes + 1 - size):
        parts.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"request body is larger than {max_bytes} bytes")
    raw = b"".join(parts)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # e.g. "[[[[…": nested deeper than the decoder can go
        raise BadRequest("request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    _validate(body, path)
    return CompletionRequest(path, body)


def _validate(body: dict[str, Any], path: str) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("you must provide a model parameter", param="model")
    if path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array", param="messages")
        if not all(isinstance(m, dict) and "role" in m for m in messages):
            raise BadRequest("each message must be an object with a 'role'", param="messages")
    elif "prompt" not in body or not isinstance(body["prompt"], str | list):
        raise BadRequest("'prompt' must be a string or an array", param="prompt")
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise BadRequest(f"'{name}' must be a positive integer", param=name)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
