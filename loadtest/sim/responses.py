"""Response bodies and SSE frames shaped like vLLM 0.32's OpenAI server.

Field sets and their order follow vLLM (``chat_completion/serving.py`` and
``completion/serving.py``) and the recorded answers in
``tests/data/vllm-0.32-conformance.json``:

- chat streams open with one role frame per choice (``delta: {role: "assistant",
  content: ""}``), sent together with the first generated tokens, i.e. when the engine
  returns its first output, never when the request is accepted;
- each token frame carries its choice's delta; a choice's last token frame also carries
  ``finish_reason`` and ``stop_reason`` (there is no separate finish frame), plus
  ``system_fingerprint`` when no usage frame follows;
- with ``stop`` strings a token frame carries only the text that cannot start one (it
  may be empty), the last frame the rest, cut before the stop (``loadtest/sim/stops.py``);
- ``stream_options.include_usage`` adds a final ``choices: []`` frame with the usage;
  ``continuous_usage_stats`` adds the running usage to every frame;
- the stream ends with ``data: [DONE]``, except when the request was aborted;
- ``return_token_ids`` fills ``prompt_token_ids`` (chat: top level, in the first frame;
  completions: on each choice's first frame) and each frame's ``token_ids`` (whole
  answers: the same fields, complete).

Token frames are built from a per-choice prefix and suffix around the token text
(filler words never need JSON escaping), so a token costs two byte concatenations.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from typing import Any

from loadtest.sim import logprobs
from loadtest.sim.protocol import SimRequest
from loadtest.sim.records import Token
from loadtest.sim.stops import HeldText

DONE_FRAME = b"data: [DONE]\n\n"
VLLM_VERSION = "0.32.0"


def system_fingerprint(model: str) -> str:
    """``vllm-<version>-<8 hex>`` like vLLM's (there a hash of the serving config)."""
    return f"vllm-{VLLM_VERSION}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def _details(cached: int | None) -> dict[str, int] | None:
    """``prompt_tokens_details`` (vLLM's ``--enable-prompt-tokens-details``; None: off)."""
    return None if cached is None else {"cached_tokens": cached}


def _frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def full_body(
    req: SimRequest,
    request_id: str,
    model: str,
    counts: list[int],
    finish_reasons: list[str],
    cached: int | None = None,
) -> dict[str, Any]:
    """The non-streaming response (``counts`` and ``finish_reasons`` per choice;
    ``cached``: the prompt tokens found in the prefix cache, reported when not None)."""
    usage: dict[str, Any] = {
        **_usage(req.prompt_tokens, sum(counts)),
        "prompt_tokens_details": _details(cached),
        "completion_tokens_details": None,
    }
    head = {"id": request_id}
    fingerprint = system_fingerprint(model)
    ids = req.return_token_ids
    prompt_ids = list(req.prompt_ids()) if ids else None
    finishes = [req.finish(i, reason) for i, reason in enumerate(finish_reasons)]
    if req.chat:
        choices: list[dict[str, Any]] = [
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": req.answer(count, i),
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": stop_reason,
                "token_ids": req.token_ids(count, i) if ids else None,
                "routed_experts": None,
            }
            for i, (count, (reason, stop_reason)) in enumerate(zip(counts, finishes, strict=True))
        ]
        return {
            **head,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": fingerprint,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    choices = [
        {
            "index": i,
            "text": req.answer(count, i),
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": stop_reason,
            "token_ids": req.token_ids(count, i) if ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids,
            "routed_experts": None,
        }
        for i, (count, (reason, stop_reason)) in enumerate(zip(counts, finishes, strict=True))
    ]
    return {
        **head,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


class StreamFramer:
    """Builds the SSE frames of one streaming response."""

    def __init__(self, req: SimRequest, request_id: str, model: str) -> None:
        self.req = req
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.fingerprint = system_fingerprint(model)
        self.object = "chat.completion.chunk" if req.chat else "text_completion"
        self.counts = [0] * req.n
        self._offsets = [0] * req.n  # completions' text_offset of each choice's next token
        buffer = req.stops.buffer_chars
        self._held = [HeldText(buffer, req.hit(i)) for i in range(req.n)] if req.stops else None
        head = json.dumps(
            {"id": request_id, "object": self.object, "created": self.created, "model": model},
            separators=(",", ":"),
        )[:-1]
        if req.chat:
            self._prefixes = [
                f'data: {head},"choices":[{{"index":{i},"delta":{{"content":"'.encode()
                for i in range(req.n)
            ]
            self._suffix = b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        else:
            self._prefixes = [
                f'data: {head},"choices":[{{"index":{i},"text":"'.encode() for i in range(req.n)
            ]
            self._suffix = (
                b'","logprobs":null,"finish_reason":null,"stop_reason":null,'
                b'"prompt_token_ids":null,"token_ids":null}]}\n\n'
            )

    def _base(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
        }

    def _prompt_ids(self) -> list[int] | None:
        return list(self.req.prompt_ids()) if self.req.return_token_ids else None

    def _running_usage(self, choice: int) -> dict[str, Any]:
        usage: dict[str, Any] = _usage(self.req.prompt_tokens, self.counts[choice])
        if self.req.chat:
            usage["completion_tokens_details"] = None
        return usage

    def opening(self) -> bytes:
        """The chat role frames, one per choice (empty for completions). vLLM sends them
        when the engine returns the request's first output, before that output's tokens."""
        if not self.req.chat:
            return b""
        out = []
        for i in range(self.req.n):
            choice = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            payload: dict[str, Any] = {**self._base(), "choices": [choice]}
            if self.req.continuous_usage:
                payload["usage"] = self._running_usage(i)
            payload["prompt_token_ids"] = self._prompt_ids()
            payload["prompt_text"] = None
            out.append(_frame(payload))
        return b"".join(out)

    def token(self, token: Token) -> bytes:
        """The frame of one output token (with its choice's finish reason if last)."""
        choice = token.choice
        self.counts[choice] += 1
        text = self.req.word(token.index, choice)
        if self._held is not None:  # stop strings: hold back what may start one
            text = self._held[choice].delta(text, last=token.finish_reason is not None)
        ids = self.req.return_token_ids
        if (token.finish_reason is None and not self.req.continuous_usage and not ids
                and self.req.logprobs is None and self.req.echo is None):
            return self._prefixes[choice] + text.encode() + self._suffix
        data: dict[str, Any]
        if self.req.chat:
            data = {"index": choice, "delta": {"content": text},
                    "logprobs": self._logprobs(token, choice)}
        else:
            if token.index == 0 and self.req.echo is not None:
                text = self.req.echo + text
            data = {"index": choice, "text": text, "logprobs": self._logprobs(token, choice)}
        finish_reason, stop_reason = token.finish_reason, None
        if finish_reason is not None:
            finish_reason, stop_reason = self.req.finish(choice, finish_reason)
        data["finish_reason"] = finish_reason
        if finish_reason is not None or not self.req.chat:
            data["stop_reason"] = stop_reason
        if not self.req.chat:  # the prompt's ids with each choice's first token (echo too)
            first = token.index == 0 and (ids or self.req.echo is not None)
            data["prompt_token_ids"] = list(self.req.prompt_ids()) if first else None
        data["token_ids"] = [self.req.token_id(token.index, choice)] if ids else None
        payload: dict[str, Any] = {**self._base(), "choices": [data]}
        if self.req.continuous_usage:
            payload["usage"] = self._running_usage(choice)
        if token.finish_reason is not None and not self.req.include_usage:
            payload["system_fingerprint"] = self.fingerprint
        return _frame(payload)

    def _logprobs(self, token: Token, choice: int) -> dict[str, Any] | None:
        k = self.req.logprobs
        if k is None:
            return None
        word = functools.partial(self.req.word, choice=choice)
        if self.req.chat:
            return logprobs.chat(word, token.index, k)
        out = logprobs.completion(word, token.index, k, self._offsets[choice])
        self._offsets[choice] += len(out["tokens"][0])
        return out

    def closing(self, cached: int | None = None) -> bytes:
        """The usage frame (if asked for; with ``cached`` prompt tokens when not None) and
        ``[DONE]``."""
        if not self.req.include_usage:
            return DONE_FRAME
        usage: dict[str, Any] = _usage(self.req.prompt_tokens, sum(self.counts))
        if cached is not None:
            usage["prompt_tokens_details"] = _details(cached)
        payload = {
            **self._base(),
            "choices": [],
            "usage": usage,
            "system_fingerprint": self.fingerprint,
        }
        return _frame(payload) + DONE_FRAME
