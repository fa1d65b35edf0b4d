"""``POST /v1/responses`` (the Responses API) as vLLM 0.32 serves it for a plain chat model
(``responses/serving.py`` without tools or reasoning), simulated.

The request becomes a chat: ``instructions`` a system message, ``input`` a user message
(a string) or the messages it lists (items with a ``role``; other items, e.g. a
``function_call_output``, count as tool messages). From there it is a chat request
(``protocol.parse_request``): the same prompt token count and output draw, with
``max_output_tokens`` as ``max_tokens`` (clamped to the context, never a 400). vLLM has no
``ignore_eos`` here, nor does the simulator.

A whole response has ``status`` ``completed``, or ``incomplete`` (``incomplete_details:
{reason: max_output_tokens}``) when the output hit ``max_output_tokens``; its usage is
``input_tokens``/``output_tokens``/``total_tokens``. A stream is SSE frames
``event: <type>\\ndata: <json>``, numbered from 0 by ``sequence_number``, without
``[DONE]``: ``response.created`` and ``response.in_progress`` as soon as the request is
accepted; with the first output ``response.output_item.added`` and
``response.content_part.added``, then one ``response.output_text.delta`` per token; at the
end ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed`` with the whole response (usage
included).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from loadtest.sim.protocol import SimRequest, body_error, parse_request
from loadtest.sim.records import Token


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict) and "role" in item:
                messages.append({"role": item["role"], "content": item.get("content")})
            elif isinstance(item, dict):
                text = item.get("output", item.get("arguments", ""))
                messages.append({"role": "tool", "content": text if isinstance(text, str) else ""})
            else:
                raise body_error("input", "model_type", "Input should be an object", item)
    else:
        raise body_error("input", "missing" if value is None else "list_type",
                         "Field required" if value is None else "Input should be a valid list",
                         value)  # fmt: skip
    return messages


def parse_responses(
    body: dict[str, Any], *, headers_priority: str | None, model_len: int, seed: int
) -> SimRequest:
    """Validate a Responses body as the chat request it becomes."""
    chat: dict[str, Any] = {"messages": _messages(body), "stream": bool(body.get("stream"))}
    for name in ("priority", "temperature"):
        if body.get(name) is not None:
            chat[name] = body[name]
    limit = body.get("max_output_tokens")
    if limit is not None:
        chat["max_tokens"] = min(limit, model_len) if isinstance(limit, int) else limit
    return parse_request(
        chat, chat=True, headers_priority=headers_priority, model_len=model_len, seed=seed
    )


def _usage(req: SimRequest, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": req.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": 0, "input_tokens_per_turn": [], "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": req.prompt_tokens + output_tokens,
    }  # fmt: skip


def _text_part(text: str) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


def _message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {
        "id": item_id, "content": content, "role": "assistant", "status": status,
        "type": "message",
    }  # fmt: skip


class ResponseBuilder:
    """The response object of one request, at any stage, and its stream's frames."""

    def __init__(self, req: SimRequest, body: dict[str, Any], response_id: str, model: str):
        self.req = req
        self.body = body
        self.response_id = response_id
        self.model = model
        self.created_at = int(time.time())
        self.item_id = "msg_" + uuid.uuid4().hex
        self.sequence = 0
        self.count = 0
        self.text = ""

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        """vLLM's ``ResponsesResponse`` (``from_request``)."""
        body = self.body
        temperature = body.get("temperature")
        top_p = body.get("top_p")
        return {
            "id": self.response_id,
            "created_at": self.created_at,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": 1.0 if temperature is None else temperature,
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": 1.0 if top_p is None else top_p,
            "background": bool(body.get("background")),
            "max_output_tokens": self.req.max_tokens,
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": body.get("previous_response_id"),
            "prompt": None,
            "reasoning": body.get("reasoning"),
            "service_tier": body.get("service_tier", "auto"),
            "status": status,
            "text": body.get("text"),
            "top_logprobs": None,
            "truncation": body.get("truncation") or "disabled",
            "usage": usage,
            "user": body.get("user"),
            "input_messages": None,
            "output_messages": None,
        }

    def final(self, count: int, finish_reason: str) -> dict[str, Any]:
        """The whole response once ``count`` tokens were generated."""
        status = "incomplete" if finish_reason == "length" else "completed"
        output = [_message(self.item_id, self.req.text(count), "completed")]
        return self.response(status, output, _usage(self.req, count))

    # -------------------------------------------------------------------- the stream

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {**fields, "sequence_number": self.sequence, "type": kind}
        self.sequence += 1
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def opening(self) -> bytes:
        """``response.created`` and ``response.in_progress`` (sent at accept)."""
        snapshot = self.response("in_progress", [], None)
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def first_output(self) -> bytes:
        """The message item and its text part open, before the first delta."""
        return self._event(
            "response.output_item.added", item=_message(self.item_id, None, "in_progress"),
            output_index=0,
        ) + self._event(
            "response.content_part.added", content_index=0, item_id=self.item_id,
            output_index=0, part={**_text_part(""), "logprobs": []},
        )  # fmt: skip

    def token(self, token: Token) -> bytes:
        """One ``response.output_text.delta``."""
        word = self.req.word(token.index)
        self.count += 1
        self.text += word
        return self._event(
            "response.output_text.delta", content_index=0, delta=word, item_id=self.item_id,
            logprobs=[], output_index=0,
        )  # fmt: skip

    def closing(self, finish_reason: str) -> bytes:
        """The done events and ``response.completed`` with the whole response."""
        part: dict[str, Any] = _text_part(self.text)
        return b"".join((
            self._event(
                "response.output_text.done", content_index=0, item_id=self.item_id,
                logprobs=[], output_index=0, text=self.text,
            ),
            self._event(
                "response.content_part.done", content_index=0, item_id=self.item_id,
                output_index=0, part=part,
            ),
            self._event(
                "response.output_item.done", item=_message(self.item_id, self.text, "completed"),
                output_index=0,
            ),
            self._event("response.completed", response=self.final(self.count, finish_reason)),
        ))  # fmt: skip
