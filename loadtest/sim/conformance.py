"""Does the simulator speak exactly like vLLM? Scripted requests and structural comparison.

``record(base_url)`` sends the same script to any OpenAI-compatible vLLM server (real or
simulated) and returns a JSON-ready transcript with every generated value masked:

- chat and completions, streamed and not, usage off / ``include_usage`` /
  ``continuous_usage_stats``, ``n`` = 2;
- 400s for bad parameters (a value vLLM's sampling checks reject, a wrong type, invalid
  JSON, ``stream_options`` without ``stream``, an empty conversation), ``max_tokens``
  over ``max_model_len``, a prompt over the context length (streamed and not), a 404
  for an unknown model, and a prompt + ``max_tokens`` over the context (vLLM clamps);
- an abort: a stream the client drops after two frames (what was sent, whether any
  per-request metric counted it, whether the server went idle);
- a stream queued behind a full engine: whether its headers and which frames arrived
  while it waited (vLLM: the headers, no frame: the chat role frame comes with the first
  output), and whether the role frame came together with the first token;
- ``/health``, ``/v1/models`` and the ``vllm:*`` metric families (type, label names, the
  values of enumerated labels, histogram buckets).

``compare(expected, actual)`` lists every structural difference that ``ALLOWED`` does not
excuse. ``tests/e2e_vllm/test_conformance.py`` runs the script against a real vLLM and
the simulator (and re-records ``tests/data/vllm-0.32-conformance.json``);
``tests/sim/test_conformance.py`` checks the simulator against that recording.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.proxy import endpoints

# ---------------------------------------------------------------------------------------
# The allow-list: every difference between vLLM and the simulator the comparison excuses.
# ---------------------------------------------------------------------------------------
ALLOWED: dict[str, str] = {
    # Generated values: text, ids, timestamps, token counts (the simulator has no
    # tokenizer, so prompt token counts differ) and error wording with those counts.
    "masked values": "every string and number except the literal keys below is masked",
    # vLLM's API server merges several tokens into one frame when it falls behind the
    # engine (seen on 2 cores), so only the pattern of frames is compared: runs of
    # identical masked frames count as one.
    "frames per token": "consecutive identical masked frames are collapsed",
    # Further behind, it merges the last token too: every token and the finish reason
    # arrive in one frame (seen in CI on a loaded machine), where the simulator sends a
    # token frame and then the finishing one.
    "merged finish": "where vLLM sent a choice's last token with its finish reason in one "
                     "frame, the other side's token frame just before its finishing frame "
                     "is not counted",
    # Log probabilities name generated tokens: completions' top_logprobs dict keys and
    # chat's token bytes are generated values too.
    "log-probability tokens": "a top_logprobs dict masks to one '<str>' entry, bytes to "
                              "'<bytes>', a list of per-token entries (and prompt ids) to "
                              "its first",
    # vLLM's incremental detokenizer can hold back a partial character and send a token
    # frame with empty text; the simulator's filler words are never empty.
    "empty token text": "delta.content / text '' and '<str>' compare equal in token frames",
    # With n > 1 the choices' frames interleave in whatever order the engine returns
    # them; frames are compared per choice index.
    "choice interleaving": "frames are grouped by choice index before comparing",
    # Only vLLM's own families are compared: process_*, python_*, http_* come from the
    # Python runtime and FastAPI's instrumentator; *_created are prometheus_client's
    # creation timestamps (single-process mode only).
    "non-vllm metric families": "only vllm:* families, without *_created",
}
# vLLM families the simulator does not export, each with the reason.
ALLOWED_MISSING_FAMILIES: dict[str, str] = {
    "vllm:external_prefix_cache_queries": "no KV connector modelled",
    "vllm:external_prefix_cache_hits": "no KV connector modelled",
    "vllm:mm_cache_queries": "text only: no multimodal cache",
    "vllm:mm_cache_hits": "text only: no multimodal cache",
    "vllm:estimated_flops_per_gpu": "MFU estimates: not modelled",
    "vllm:estimated_read_bytes_per_gpu": "MFU estimates: not modelled",
    "vllm:estimated_write_bytes_per_gpu": "MFU estimates: not modelled",
    "vllm:admission_rejections": "no --max-num-queued-reqs admission cap in the simulator",
    "vllm:cache_config_info": "an info gauge of ~40 engine config labels: not modelled",
}
# Keys whose values are compared literally; everything else is masked.
LITERAL_KEYS = frozenset(
    {"object", "role", "finish_reason", "stop_reason", "type", "code", "param", "index",
     "owned_by", "organization"}
)  # fmt: skip
# Lists with an entry per token: a frame of several tokens (vLLM behind its engine) masks
# like a frame of one (``ALLOWED["frames per token"]``); prompt ids count the simulator's
# tokens (``ALLOWED["masked values"]``).
PER_TOKEN_LISTS = frozenset({"text_offset", "token_logprobs", "tokens", "top_logprobs",
                             "content", "prompt_token_ids"})
# Label values compared literally (the enumerations clients filter on).
ENUM_LABELS = frozenset({"finished_reason", "reason", "sleep_state", "source"})

CHAT = endpoints.CHAT.path
COMPLETIONS = endpoints.COMPLETIONS.path
ABORT_AFTER_FRAMES = 2
QUEUED_OBSERVE_S = 0.5
QUEUED_ATTEMPTS = 3
# A starved API server (a loaded 2-core runner) can let the engine run a dropped request's
# ~2,000 tokens to their end before it notices the disconnect: seen once in 12 attempts at
# load 6 (1,078 tokens generated before the abort), and three attempts in a row once on a
# loaded CI run. An attempt that ended that way says nothing about aborts.
ABORT_ATTEMPTS = 8
IDLE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Case:
    """One scripted request; ``body`` gets ``model`` added unless ``with_model`` is off."""

    name: str
    path: str
    body: dict[str, Any]
    raw: bytes | None = None  # sent verbatim instead of ``body``
    with_model: bool = True
    note: str = ""

    def payload(self, model: str) -> bytes:
        if self.raw is not None:
            return self.raw
        body = {"model": model, **self.body} if self.with_model else dict(self.body)
        return json.dumps(body).encode()

    def describe(self) -> dict[str, Any]:
        """The request as stored in a transcript (long prompts abbreviated)."""
        if self.raw is not None:
            return {"path": self.path, "raw": self.raw.decode(errors="replace")}
        body: dict[str, Any] = {}
        for key, value in self.body.items():
            if key == "prompt" and isinstance(value, list) and len(value) > 8:
                body[key] = f"<{len(value)} token ids>"
            elif isinstance(value, str) and len(value) > 80:
                body[key] = f"<{len(value)} characters>"
            elif key == "messages" and len(json.dumps(value)) > 200:
                body[key] = f"<{len(value)} message(s), {len(json.dumps(value))} bytes>"
            else:
                body[key] = value
        return {"path": self.path, "body": body, **({"note": self.note} if self.note else {})}


def _chat(content: str = "hello there") -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def script(max_model_len: int) -> list[Case]:
    """The scripted requests (prompts sized from the server's ``max_model_len``)."""
    short = {"max_tokens": 4, "ignore_eos": True, "temperature": 0.0}
    usage = {"stream_options": {"include_usage": True}}
    cont = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chat = {"messages": _chat(), **short}
    cmpl = {"prompt": "the fair queue", **short}
    # Over the context in any tokenizer: ~4 characters per token for the simulator, far
    # more tokens than that for a real one.
    too_long = "word " * (max_model_len * 2)
    # Token ids count the same everywhere: a prompt 8 short of the context.
    near_full = [100 + i % 1000 for i in range(max_model_len - 8)]
    over_full = [100 + i % 1000 for i in range(max_model_len + 7)]
    sampled = {"temperature": 1.0}
    return [
        Case("chat_stream", CHAT, {**chat, "stream": True}),
        Case("chat_stream_usage", CHAT, {**chat, "stream": True, **usage}),
        Case("chat_stream_continuous_usage", CHAT, {**chat, "stream": True, **cont}),
        Case("chat_nonstream", CHAT, chat),
        Case("chat_stream_n2", CHAT, {**chat, **sampled, "stream": True, "n": 2, **usage}),
        Case("chat_nonstream_n2", CHAT, {**chat, **sampled, "n": 2}),
        Case("chat_n2_greedy", CHAT, {**chat, "n": 2}, note="n > 1 needs sampling"),
        Case("chat_no_model", CHAT, chat, with_model=False, note="model is optional"),
        Case("completion_stream", COMPLETIONS, {**cmpl, "stream": True}),
        Case("completion_stream_usage", COMPLETIONS, {**cmpl, "stream": True, **usage}),
        Case("completion_stream_continuous_usage", COMPLETIONS, {**cmpl, "stream": True, **cont}),
        Case("completion_nonstream", COMPLETIONS, cmpl),
        Case("completion_stream_n2", COMPLETIONS,
             {**cmpl, **sampled, "stream": True, "n": 2, **usage}),
        Case("completion_nonstream_n2", COMPLETIONS, {**cmpl, **sampled, "n": 2}),
        Case("completion_clamped_to_context", COMPLETIONS,
             {"prompt": near_full, "max_tokens": 100, "ignore_eos": True},
             note="prompt + max_tokens over the context: max_tokens is clamped, no 400"),
        Case("chat_bad_temperature", CHAT, {**chat, "temperature": -1}),
        Case("completion_bad_max_tokens", COMPLETIONS, {**cmpl, "max_tokens": -1}),
        Case("completion_bad_n", COMPLETIONS, {**cmpl, "n": 0}),
        Case("chat_wrong_type", CHAT, {**chat, "max_tokens": "many"}),
        Case("completion_invalid_json", COMPLETIONS, {}, raw=b'{"model": "x", "prompt": '),
        Case("completion_stream_options_without_stream", COMPLETIONS, {**cmpl, **usage}),
        Case("chat_empty_messages", CHAT, {**chat, "messages": []}),
        Case("chat_max_tokens_over_model_len", CHAT, {**chat, "max_tokens": max_model_len + 1}),
        Case("completion_prompt_over_context", COMPLETIONS, {**cmpl, "prompt": too_long}),
        Case("completion_prompt_ids_over_context", COMPLETIONS, {**cmpl, "prompt": over_full}),
        Case("chat_prompt_over_context", CHAT, {**chat, "messages": _chat(too_long)}),
        Case("chat_stream_prompt_over_context", CHAT,
             {**chat, "messages": _chat(too_long), "stream": True}),
        Case("completion_unknown_model", COMPLETIONS, {**cmpl, "model": "no-such-model"},
             with_model=False),
        Case("completion_stream_logprobs", COMPLETIONS,
             {**cmpl, "stream": True, "logprobs": 2, **usage}),
        Case("chat_stream_logprobs", CHAT,
             {**chat, "stream": True, "logprobs": True, "top_logprobs": 2, **usage}),
        Case("completion_stream_echo", COMPLETIONS, {**cmpl, "stream": True, "echo": True}),
        Case("completion_stream_prompt_logprobs", COMPLETIONS,
             {**cmpl, "stream": True, "prompt_logprobs": 1}),
        Case("completion_suffix", COMPLETIONS, {**cmpl, "suffix": "the end"},
             note="only models with a fill-in-the-middle renderer take a suffix"),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------
# Masking
# ---------------------------------------------------------------------------------------
def mask(value: Any, key: str | None = None) -> Any:
    """Replace generated values by their kind; keep structure and ``LITERAL_KEYS``.

    Strings become ``"<str>"`` (``""`` stays ``""``; an ``id`` keeps its prefix, e.g.
    ``"chatcmpl-<str>"``), numbers ``"<int>"`` / ``"<float>"``; ``None`` and booleans stay.
    """
    if isinstance(value, dict):
        if key == "top_logprobs" and all(isinstance(v, float) for v in value.values()):
            return {"<str>": "<float>"} if value else {}  # keyed by generated tokens
        return {k: mask(v, k) for k, v in value.items()}
    if key == "bytes" and isinstance(value, list):  # a generated token's UTF-8 bytes
        return "<bytes>"
    if key in PER_TOKEN_LISTS and isinstance(value, list) and value:
        return [mask(value[0], key)]
    if isinstance(value, list):
        return [mask(v, key) for v in value]
    if value is None or isinstance(value, bool) or key in LITERAL_KEYS:
        return value
    if isinstance(value, int):
        return "<int>"
    if isinstance(value, float):
        return "<float>"
    if isinstance(value, str):
        if not value:
            return ""
        if key == "id" and "-" in value:
            return value.split("-", 1)[0] + "-<str>"
        return "<str>"
    return f"<{type(value).__name__}>"


def mask_frame(data: bytes) -> Any:
    """One SSE frame's masked payload (``"[DONE]"`` stays as it is)."""
    text = data.decode()
    if not text.startswith("data: "):
        return {"<non-data line>": mask(text)}
    payload = text[len("data: "):]
    if payload == "[DONE]":
        return "[DONE]"
    try:
        return mask(json.loads(payload))
    except ValueError:
        return {"<not json>": "<str>"}


# ---------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------
@dataclass
class _Reader:
    """Reads an SSE body, keeping each frame with its arrival time."""

    frames: list[tuple[float, bytes]] = field(default_factory=list)
    pending: bytes = b""

    def feed(self, chunk: bytes) -> None:
        now = time.monotonic()
        self.pending += chunk
        while b"\n\n" in self.pending:
            frame, self.pending = self.pending.split(b"\n\n", 1)
            if frame.strip():
                self.frames.append((now, frame))


async def _post(
    http: aiohttp.ClientSession, base: str, case: Case, model: str
) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    async with http.post(base + case.path, data=case.payload(model), headers=headers) as resp:
        out: dict[str, Any] = {
            "request": case.describe(),
            "status": resp.status,
            "content_type": resp.headers.get("Content-Type", ""),
        }
        if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            reader = _Reader()
            async for chunk in resp.content.iter_any():
                reader.feed(chunk)
            out["frames"] = [mask_frame(f) for _, f in reader.frames]
        else:
            raw = await resp.read()
            try:
                out["body"] = mask(json.loads(raw))
            except ValueError:
                out["body"] = mask(raw.decode(errors="replace"))
        return out


async def _scrape(http: aiohttp.ClientSession, base: str) -> str:
    async with http.get(base + "/metrics") as resp:
        return await resp.text()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _gauge(text: str, name: str) -> float:
    return sum(v for (n, _), v in _samples(text).items() if n == name)


def _success(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (name, labels), value in _samples(text).items():
        if name == "vllm:request_success_total":
            reason = dict(labels).get("finished_reason", "")
            out[reason] = out.get(reason, 0.0) + value
    return out


async def _wait_idle(http: aiohttp.ClientSession, base: str) -> bool:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            text = await _scrape(http, base)
            if _gauge(text, "vllm:num_requests_running") == 0 and \
                    _gauge(text, "vllm:num_requests_waiting") == 0:  # fmt: skip
                return True
        await asyncio.sleep(0.1)
    return False


async def _abort_case(
    http: aiohttp.ClientSession, base: str, model: str, max_model_len: int
) -> dict[str, Any]:
    """A chat stream dropped by the client after ``ABORT_AFTER_FRAMES`` frames.

    A busy API server may notice the disconnect only after the request finished (then it
    counts as "length" and says nothing about aborts): up to ``ABORT_ATTEMPTS`` attempts.
    """
    out: dict[str, Any] = {}
    for attempt in range(1, ABORT_ATTEMPTS + 1):
        out = await _abort_attempt(http, base, model, max_model_len)
        if "length" not in out["request_success_delta"]:
            break
        print(f"{base}: abort attempt {attempt} of {ABORT_ATTEMPTS} ran to its end "
              f"(the server noticed the disconnect too late)", flush=True)
    return out


async def _abort_attempt(
    http: aiohttp.ClientSession, base: str, model: str, max_model_len: int
) -> dict[str, Any]:
    case = Case("abort_chat_stream", CHAT, {
        "messages": _chat(), "max_tokens": max_model_len - 32, "ignore_eos": True,
        "stream": True,
    }, note=f"the client disconnects after {ABORT_AFTER_FRAMES} frames")  # fmt: skip
    await _wait_idle(http, base)
    before = _success(await _scrape(http, base))
    reader = _Reader()
    resp = await http.post(base + case.path, data=case.payload(model),
                           headers={"Content-Type": "application/json"})
    status = resp.status
    try:
        async for chunk in resp.content.iter_any():
            reader.feed(chunk)
            if len(reader.frames) >= ABORT_AFTER_FRAMES:
                break
    finally:
        resp.close()  # drops the connection: the server aborts the request
    idle = await _wait_idle(http, base)
    after = _success(await _scrape(http, base))
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {
        "request": case.describe(),
        "status": status,
        "frames": [mask_frame(f) for _, f in reader.frames[:ABORT_AFTER_FRAMES]],
        "request_success_delta": {k: v for k, v in sorted(delta.items()) if v},
        "idle_after": idle,
    }


async def _queued_case(
    http: aiohttp.ClientSession, base: str, model: str, fill: int, max_model_len: int
) -> dict[str, Any]:
    """A chat stream sent while ``fill`` long requests occupy every engine slot.

    On two busy cores vLLM's API server can take longer to hand the probe to the engine
    than the flood takes to finish; then the probe never waited and the attempt says
    nothing. Up to ``QUEUED_ATTEMPTS`` attempts.
    """
    out: dict[str, Any] = {}
    for _ in range(QUEUED_ATTEMPTS):
        out = await _queued_attempt(http, base, model, fill, max_model_len)
        if out["waited_in_engine_queue"]:
            break
    return out


async def _queued_attempt(
    http: aiohttp.ClientSession, base: str, model: str, fill: int, max_model_len: int
) -> dict[str, Any]:
    case = Case("queued_chat_stream", CHAT, {
        "messages": _chat(), "max_tokens": 4, "ignore_eos": True, "stream": True,
    }, note=f"sent while {fill} long streams fill the engine (max_num_seqs); they are "
            "dropped once it has waited")  # fmt: skip
    await _wait_idle(http, base)
    flood_body = json.dumps({
        "model": model, "prompt": "flood", "max_tokens": max_model_len - 32,
        "ignore_eos": True, "stream": True,
    }).encode()  # fmt: skip
    headers = {"Content-Type": "application/json"}
    flood: list[aiohttp.ClientResponse] = []
    probe_task: asyncio.Task[None] | None = None
    reader = _Reader()
    released_at: list[float] = []
    headers_at: list[float] = []
    out: dict[str, Any] = {"request": case.describe()}
    try:
        # Each flood request is running once its first frame arrived.
        for _ in range(fill):
            resp = await http.post(base + COMPLETIONS, data=flood_body, headers=headers)
            flood.append(resp)
        for resp in flood:
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), IDLE_TIMEOUT_S)

        async def probe() -> None:
            async with http.post(base + case.path, data=case.payload(model),
                                 headers=headers) as resp:
                headers_at.append(time.monotonic())
                out["status"] = resp.status
                async for chunk in resp.content.iter_any():
                    reader.feed(chunk)

        probe_task = asyncio.create_task(probe())
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        waiting = 0.0
        while waiting < 1 and time.monotonic() < deadline:
            waiting = _gauge(await _scrape(http, base), "vllm:num_requests_waiting")
            if waiting < 1:
                await asyncio.sleep(0.05)
        await asyncio.sleep(QUEUED_OBSERVE_S)
        # Still queued when the flood is dropped? (A flood stream may end or be preempted
        # early on a busy host and let the probe in: then the attempt says nothing.) Frames
        # that came before this check came while the probe was queued.
        released_at.append(time.monotonic())
        still = _gauge(await _scrape(http, base), "vllm:num_requests_waiting")
        out["waited_in_engine_queue"] = waiting >= 1 and still >= 1
        for resp in flood:
            resp.close()
        await asyncio.wait_for(probe_task, IDLE_TIMEOUT_S)
    finally:
        for resp in flood:
            resp.close()
        if probe_task is not None and not probe_task.done():
            probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe_task
    release = released_at[0] if released_at else float("inf")
    # Status line and headers go out at accept (a streaming response starts at once).
    out["headers_while_queued"] = bool(headers_at) and headers_at[0] < release
    out["frames_while_queued"] = [mask_frame(f) for t, f in reader.frames if t < release]
    out["frames"] = [mask_frame(f) for _, f in reader.frames]
    # The role frame (first) and the first token frame (second) arrive together.
    times = [t for t, _ in reader.frames]
    out["role_frame_with_first_token"] = len(times) >= 2 and times[1] - times[0] < 0.25
    await _wait_idle(http, base)
    return out


def metric_shape(text: str) -> dict[str, Any]:
    """``vllm:*`` families: type, label names, enumerated label values, buckets."""
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        name = family.name
        if not name.startswith("vllm:") or name.endswith("_created"):
            continue
        labels: set[str] = set()
        values: dict[str, set[str]] = {}
        buckets: list[str] = []
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            for key, value in s.labels.items():
                if key == "le":
                    if value not in buckets:
                        buckets.append(value)
                    continue
                labels.add(key)
                if key in ENUM_LABELS:
                    values.setdefault(key, set()).add(value)
        entry: dict[str, Any] = {"type": family.type, "labels": sorted(labels)}
        if values:
            entry["label_values"] = {k: sorted(v) for k, v in sorted(values.items())}
        if buckets:
            entry["buckets"] = buckets
        out[name] = entry
    return dict(sorted(out.items()))


async def record(base: str, *, fill: int) -> dict[str, Any]:
    """Run the whole script against the server at ``base`` (no ``/v1``).

    ``fill`` is the server's ``max_num_seqs``: that many long streams occupy the engine
    for the queued case.
    """
    timeout = aiohttp.ClientTimeout(total=600, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        async with http.get(base + "/v1/models") as resp:
            models = await resp.json()
        model = models["data"][0]["id"]
        max_model_len = int(models["data"][0]["max_model_len"])
        async with http.get(base + "/health") as resp:
            health = {"status": resp.status, "body": mask((await resp.read()).decode())}
        cases: dict[str, Any] = {}
        for case in script(max_model_len):
            cases[case.name] = await _post(http, base, case, model)
        cases["abort_chat_stream"] = await _abort_case(http, base, model, max_model_len)
        cases["queued_chat_stream"] = await _queued_case(http, base, model, fill, max_model_len)
        await _wait_idle(http, base)
        metrics = metric_shape(await _scrape(http, base))
    return {
        "server": {"max_model_len": max_model_len, "max_num_seqs": fill},
        "health": health,
        "models": mask(models),
        "cases": cases,
        "metrics": metrics,
    }


# ---------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------
def _is_token_frame(frame: Any) -> bool:
    if not isinstance(frame, dict):
        return False
    choices = frame.get("choices")
    if not choices:
        return False
    return "role" not in (choices[0].get("delta") or {})


def _normalize_frame(frame: Any) -> Any:
    """Token text '' and '<str>' compare equal (``ALLOWED['empty token text']``)."""
    if not _is_token_frame(frame):
        return frame
    frame = json.loads(json.dumps(frame))
    for choice in frame["choices"]:
        if choice.get("text") == "":
            choice["text"] = "<str>"
        delta = choice.get("delta")
        if isinstance(delta, dict) and delta.get("content") == "":
            delta["content"] = "<str>"
    return frame


def _unfinished(frame: Any) -> Any:
    """A token frame as it was before its choices got their finish reason."""
    frame = json.loads(json.dumps(frame))
    for choice in frame["choices"]:
        choice["finish_reason"] = None
        if "stop_reason" in choice:
            choice["stop_reason"] = None
    return frame


def normalize_frames(frames: list[Any], merge_finish: bool = False) -> dict[str, list[Any]]:
    """Group by choice index, then collapse runs of identical frames; with
    ``merge_finish``, also a token frame into the finishing frame after it (see
    ``ALLOWED``)."""
    groups: dict[str, list[Any]] = {}
    for frame in frames:
        choices = frame.get("choices") if isinstance(frame, dict) else None
        key = f"choice {choices[0].get('index')}" if choices else "no choice"
        frame = _normalize_frame(frame)
        group = groups.setdefault(key, [])
        if merge_finish and group and _is_token_frame(frame) and group[-1] != frame \
                and group[-1] == _unfinished(frame):
            group.pop()
        if not group or group[-1] != frame:
            group.append(frame)
    return groups


def _diff(path: str, want: Any, got: Any, out: list[str]) -> None:
    if isinstance(want, dict) and isinstance(got, dict):
        if list(want) != list(got) and set(want) == set(got):
            out.append(f"{path}: key order {list(got)} != {list(want)}")
        for key in want:
            if key not in got:
                out.append(f"{path}.{key}: missing (vLLM: {json.dumps(want[key])[:120]})")
            else:
                _diff(f"{path}.{key}", want[key], got[key], out)
        for key in got:
            if key not in want:
                out.append(f"{path}.{key}: unexpected (got {json.dumps(got[key])[:120]})")
        return
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            out.append(f"{path}: {len(got)} items != {len(want)}: got "
                       f"{json.dumps(got)[:300]}, vLLM {json.dumps(want)[:300]}")
            return
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            _diff(f"{path}[{i}]", w, g, out)
        return
    if want != got:
        out.append(f"{path}: got {json.dumps(got)[:120]}, vLLM {json.dumps(want)[:120]}")


def _normalize_case(case: dict[str, Any], merge_finish: bool = False) -> dict[str, Any]:
    case = dict(case)
    case.pop("request", None)
    for key in ("frames", "frames_while_queued"):
        if key in case:
            case[key] = normalize_frames(case[key], merge_finish)
    return case


def _compare_case(name: str, want: dict[str, Any], got: dict[str, Any], out: list[str]) -> None:
    """One case's differences. Where vLLM sent a token frame before a finishing frame the
    frames compare strictly; where it did not (its last token came with the finish
    reason, ``ALLOWED['merged finish']``), the other side's are merged alike."""
    strict = _normalize_case(want)
    vllm_merged = _normalize_case(want, merge_finish=True) == strict
    _diff(f"cases.{name}", strict, _normalize_case(got, merge_finish=vllm_merged), out)


def compare(
    expected: dict[str, Any],
    actual: dict[str, Any],
    missing_families: Collection[str] = tuple(ALLOWED_MISSING_FAMILIES),
) -> list[str]:
    """Differences of ``actual`` from ``expected`` (the vLLM transcript) not in ``ALLOWED``.

    ``missing_families``: vLLM families ``actual`` may lack (pass ``()`` to compare two
    vLLM transcripts).
    """
    out: list[str] = []
    _diff("health", expected["health"], actual["health"], out)
    _diff("models", expected["models"], actual["models"], out)
    for name, want in expected["cases"].items():
        got = actual["cases"].get(name)
        if got is None:
            out.append(f"cases.{name}: not run")
            continue
        _compare_case(name, want, got, out)
    want_metrics = {k: v for k, v in expected["metrics"].items()
                    if k not in missing_families}  # fmt: skip
    _diff("metrics", want_metrics, actual["metrics"], out)
    return out
