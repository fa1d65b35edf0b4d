"""One HTTP stack for direct and gateway runs: aiohttp, streaming, frame timestamps.

Metric definitions follow ``vllm bench serve``: TTFT is the time to the first content
frame; TPOT = (latency − TTFT) / (output tokens − 1); ITL are the gaps between content
frames; E2E latency runs from sending the request to the end of the stream.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gateway.proxy import endpoints

PROMPT_WORD = " the"  # 4 bytes: the simulator counts one token, Llama's tokenizer too
# The OpenAI endpoints a scenario can run on (``fairgate bench … --endpoint``).
ENDPOINTS = {"chat": endpoints.CHAT.path, "completions": endpoints.COMPLETIONS.path}


@dataclass(frozen=True, slots=True)
class Target:
    """Where requests go: a backend directly, or fairgate (with per-user keys)."""

    name: str  # "direct" or "gateway" (or a variant label such as "vtc")
    url: str
    model: str
    via_gateway: bool

    def headers(self, user: str) -> dict[str, str]:
        return {"Authorization": f"Bearer sk-{user}"} if self.via_gateway else {}


@dataclass(frozen=True, slots=True)
class Spec:
    """One request to send."""

    user: str
    tag: str
    prompt_tokens: int
    max_tokens: int
    chat: bool = False
    deadline_ms: int | None = None  # sent as X-Fairgate-Deadline-Ms (first-token deadline)
    session: str | None = None  # sent as X-Fairgate-Session
    # False: ``"stream": false``, one JSON answer; its first token is the answer read (E2E)
    stream: bool = True


@dataclass(slots=True)
class Result:
    user: str
    tag: str
    prompt_tokens: int
    sent_s: float
    end_s: float = 0.0
    status: int = 0
    first_token_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    cached_tokens: int = 0  # of the prompt, from the backend's prefix cache (its usage)
    # seconds in the gateway's queue (X-Fairgate-Queue-Wait-Ms); None: not via a gateway,
    # or never dispatched (then it waited until its end)
    queue_wait_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.first_token_s is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def latency(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


# Every prompt starts with its own 8 bytes (2 tokens): with automatic prefix caching (the
# simulator's and vLLM's) identical prompts would be nearly free to prefill after the
# first, which no real flood of distinct requests is.
_PROMPT_SEQ = itertools.count(random.randrange(16**6))


def prompt_text(tokens: int) -> str:
    """``tokens`` tokens of text (one per 4 bytes) whose first cache block is this
    prompt's own."""
    if tokens < 2:
        return PROMPT_WORD
    return f" {next(_PROMPT_SEQ) % 16**7:07x}" + PROMPT_WORD * (tokens - 2)


def body_for(spec: Spec, model: str) -> dict[str, Any]:
    text = prompt_text(spec.prompt_tokens)
    body: dict[str, Any] = {
        "model": model, "max_tokens": spec.max_tokens, "stream": spec.stream,
        "ignore_eos": True, "temperature": 0.0,
    }
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def _has_content(obj: dict[str, Any]) -> bool:
    for choice in obj.get("choices") or ():
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if delta.get("content"):
            return True
    return False


def _take_frames(result: Result, frames: bytes, now: float) -> int | None:
    """Record the content frames of a chunk; returns completion tokens from a usage frame."""
    usage_tokens = None
    for frame in frames.split(b"\n\n"):
        if not frame.startswith(b"data: {"):
            continue
        obj = json.loads(frame[6:])
        if "error" in obj:
            result.error = str(obj["error"])[:300]
        if _has_content(obj):
            if result.first_token_s is None:
                result.first_token_s = now
            result.token_times.append(now)
        usage = obj.get("usage")
        if usage:
            usage_tokens = int(usage.get("completion_tokens") or 0)
            result.prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_tokens)
            result.cached_tokens = cached_tokens(usage)
    return usage_tokens


def cached_tokens(usage: dict[str, Any]) -> int:
    """The prompt tokens a usage object says the prefix cache held (0: not reported)."""
    details = usage.get("prompt_tokens_details")
    return int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0


def new_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600),
    )


async def send(session: aiohttp.ClientSession, target: Target, spec: Spec,
               sink: list[Result] | None = None) -> Result:
    """Send one request (streamed unless ``spec.stream`` is False); never raises for HTTP or
    stream errors.

    The result goes into ``sink`` before the request is sent, so a request cancelled at
    the end of a bounded run still counts the tokens it received (marked "cancelled").
    """
    path = ENDPOINTS["chat" if spec.chat else "completions"]
    result = Result(spec.user, spec.tag, spec.prompt_tokens, time.perf_counter())
    if sink is not None:
        sink.append(result)
    usage_tokens: int | None = None
    try:
        headers = target.headers(spec.user)
        if spec.deadline_ms is not None:
            headers["X-Fairgate-Deadline-Ms"] = str(spec.deadline_ms)
        if spec.session is not None and target.via_gateway:
            headers["X-Fairgate-Session"] = spec.session
        async with session.post(target.url + path, json=body_for(spec, target.model),
                                headers=headers) as resp:
            result.status = resp.status
            wait_ms = resp.headers.get("X-Fairgate-Queue-Wait-Ms")
            if wait_ms is not None and wait_ms.isdigit():
                result.queue_wait_s = int(wait_ms) / 1000
            if resp.status != 200:
                result.error = (await resp.text())[:300]
                return result
            if not spec.stream:
                usage_tokens = _take_answer(result, await resp.read(), time.perf_counter())
                return result
            pending = b""
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                pending += chunk
                end = pending.rfind(b"\n\n")
                if end < 0:
                    continue
                frames, pending = pending[:end], pending[end + 2:]
                usage_tokens = _take_frames(result, frames, now) or usage_tokens
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = repr(exc)[:300]
    except asyncio.CancelledError:
        result.error = "cancelled"
        raise
    finally:
        result.end_s = time.perf_counter()
        result.output_tokens = usage_tokens if usage_tokens else len(result.token_times)
    return result


def _take_answer(result: Result, body: bytes, now: float) -> int | None:
    """Record a non-streamed answer, read whole at ``now``: its content counts as one
    token time (TTFT = E2E); returns completion tokens from its usage."""
    obj = json.loads(body)
    if "error" in obj:
        result.error = str(obj["error"])[:300]
    choices = obj.get("choices") or ()
    if any(c.get("text") or (c.get("message") or {}).get("content") for c in choices):
        result.first_token_s = now
        result.token_times.append(now)
    usage = obj.get("usage")
    if not usage:
        return None
    result.prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_tokens)
    result.cached_tokens = cached_tokens(usage)
    return int(usage.get("completion_tokens") or 0)
