"""Response bodies and SSE frames shaped like vLLM's OpenAI server.

Streaming frames are built from a per-request prefix and suffix around the token text
(filler words never need JSON escaping), so a token costs two byte concatenations.
"""

from __future__ import annotations

import json
import time
from typing import Any

from loadtest.sim.protocol import SimRequest

DONE_FRAME = b"data: [DONE]\n\n"


def _usage(req: SimRequest, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": req.prompt_tokens + completion_tokens,
    }


def _frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def full_body(
    req: SimRequest, request_id: str, model: str, count: int, finish_reason: str
) -> dict[str, Any]:
    """The non-streaming response."""
    text = req.text(count)
    base = {"id": request_id, "created": int(time.time()), "model": model}
    if req.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        return {
            **base,
            "object": "chat.completion",
            "choices": [choice],
            "usage": _usage(req, count),
        }
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }
    return {**base, "object": "text_completion", "choices": [choice], "usage": _usage(req, count)}


class StreamFramer:
    """Builds the SSE frames of one streaming response."""

    def __init__(self, req: SimRequest, request_id: str, model: str) -> None:
        self.req = req
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if req.chat else "text_completion"
        head = json.dumps(
            {"id": request_id, "object": self.object, "created": self.created, "model": model},
            separators=(",", ":"),
        )[:-1]
        if req.chat:
            self._prefix = f'data: {head},"choices":[{{"index":0,"delta":{{"content":"'.encode()
            self._suffix = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._prefix = f'data: {head},"choices":[{{"index":0,"text":"'.encode()
            self._suffix = b'","logprobs":null,"finish_reason":null}]}\n\n'

    def _base(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
        }

    def opening(self) -> bytes:
        """The chat role frame (empty for completions)."""
        if not self.req.chat:
            return b""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return _frame({**self._base(), "choices": [choice]})

    def token(self, index: int) -> bytes:
        """The frame of output token ``index``."""
        return self._prefix + self.req.word(index).encode() + self._suffix

    def closing(self, completion_tokens: int, finish_reason: str) -> bytes:
        """Finish-reason frame, optional usage frame and ``[DONE]``."""
        if self.req.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        out = _frame({**self._base(), "choices": [choice]})
        if self.req.include_usage:
            usage = _usage(self.req, completion_tokens)
            out += _frame({**self._base(), "choices": [], "usage": usage})
        return out + DONE_FRAME
