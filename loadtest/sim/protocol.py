"""OpenAI request parsing, token-count approximations and vLLM-style errors.

Validation follows vLLM 0.32 (checked against its source and recorded answers in
``tests/data/vllm-0.32-conformance.json``), in vLLM's order:

1. body types (pydantic): a wrong type answers 400 ``type: "Bad Request"``, ``param:
   "body.<field>"``, message ``1 validation error: {...}``; invalid JSON likewise
   (``json_invalid``);
2. ``stream_options`` without ``stream`` → 400;
3. ``max_tokens`` (or ``max_completion_tokens``) above ``max_model_len`` → 400;
4. a prompt longer than ``max_model_len`` → 400 ``param: "input_tokens"``, or, for prompt
   text of more than ``max_model_len`` x (the longest token: 4 characters here)
   characters, ``param: "input_text"`` before any tokenization;
5. ``max_tokens`` is clamped to ``max_model_len - prompt_tokens`` (never a 400 for the
   sum), then sampling checks: ``n >= 1``, ``0 <= temperature <= 2``,
   ``max_tokens >= 1``, and ``n == 1`` under greedy sampling (``temperature`` 0).

Token counts (no tokenizer; deterministic and documented):

- a prompt string costs ``ceil(len(utf8 bytes) / 4)`` tokens (at least 1); a prompt given
  as token ids costs one token per id;
- a chat request costs, per message, ``4 + ceil(len(utf8 content) / 4)`` tokens, plus 3
  for the assistant reply header (like OpenAI's cookbook formula);
- the prompt's token ids (``SimRequest.prompt_ids()``, for the prefix cache) are
  ``loadtest/sim/tokenizer.py``'s for the same split, so equal text prefixes share ids;
- the output length of each of the ``n`` choices is ``max_tokens`` with ``ignore_eos``;
  otherwise a seeded draw from ``hash(seed, prompt, choice)`` uniform in [16, 512]
  (with a ``seed`` in the body, choice ``i`` draws as choice 0 with ``seed + i``, as
  vLLM seeds a request's children),
  capped by ``max_tokens`` (whose default is ``max_model_len - prompt_tokens``). It ends
  with ``finish_reason`` "length" when the cap cut it, else "stop".
- the output text is one filler word per token, chosen from that hash; each generated
  token is a word token (``loadtest/sim/tokenizer.py``) whose id carries its answer's
  state. The draw is seeded with the prompt's text as its tokens decode (a chat's
  template text, a token-id prompt's decoded bytes), so a prompt sent as text, as
  messages or as the same token ids gets the same answer; a token-id prompt that ends
  with a word token continues that answer: the next words, stopping where the
  uninterrupted answer would have stopped (or at ``max_tokens``). This is what makes a
  continuation exact (``return_token_ids`` returns the prompt's and the generated ids).
- ``stop`` strings and ``stop_token_ids`` end an answer earlier, as vLLM ends it
  (``loadtest/sim/stops.py``): the choice's token count is cut at the stopping token.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from loadtest.sim import tokenizer
from loadtest.sim.stops import NO_STOPS, StopHit, Stops, find_stop

PRIORITY_HEADER = "X-Vllm-Priority"
CHARS_PER_TOKEN = 4
CHAT_MESSAGE_OVERHEAD = 4
CHAT_REPLY_OVERHEAD = 3
MIN_DRAW, MAX_DRAW = 16, 512
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
GREEDY_EPS = 1e-5  # vLLM: a temperature below this is greedy sampling
FILLER = tokenizer.FILLER
VALIDATION_TYPE = "Bad Request"  # vLLM's ``type`` for body (pydantic) validation errors


class SimError(Exception):
    """An OpenAI-style error response, shaped like vLLM's ``ErrorResponse``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self._type = error_type

    @property
    def error_type(self) -> str:
        """vLLM's ``type`` for this error."""
        if self._type is not None:
            return self._type
        return {404: "NotFoundError", 500: "InternalServerError"}.get(
            self.status, "BadRequestError"
        )

    def body(self) -> dict[str, Any]:
        """The JSON body vLLM answers with: ``{"error": {message, type, param, code}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            },
        }


def validation_error(param: str, message: str, value: Any = None) -> SimError:
    """vLLM's ``VLLMValidationError`` text: ``message (parameter=..., value=...)``."""
    extras = [f"parameter={param}"]
    if value is not None:
        extras.append(f"value={value}")
    return SimError(400, f"{message} ({', '.join(extras)})", param=param)


def body_error(field: str, kind: str, msg: str, value: Any) -> SimError:
    """A pydantic body validation error as vLLM's handler renders it."""
    detail = {"type": kind, "loc": f"body.{field}", "msg": msg, "input": value}
    return SimError(
        400, f"1 validation error:\n  {detail}", param=f"body.{field}", error_type=VALIDATION_TYPE
    )


@dataclass(frozen=True)
class SimRequest:
    """The fields of a completion or chat request the simulator acts on."""

    chat: bool
    prompt_key: bytes
    prompt_tokens: int
    max_tokens: int
    output_tokens: tuple[int, ...]  # per choice
    priority: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    seed_hash: int
    prompt: Prompt | None = field(default=None, compare=False, repr=False)
    bases: tuple[int, ...] = ()  # per choice: the answer's first filler word
    naturals: tuple[int, ...] = ()  # per choice: where the answer stops by itself
    start: int = 0  # position of the first generated token (a continued answer's)
    return_token_ids: bool = False
    stops: Stops = NO_STOPS
    hits: tuple[StopHit | None, ...] = ()  # per choice: where a stop ended it (None: none)

    def hit(self, choice: int) -> StopHit | None:
        """Where ``stop``/``stop_token_ids`` ended ``choice`` (None: they did not)."""
        return self.hits[choice] if self.hits else None

    def finish(self, choice: int, reason: str) -> tuple[str, str | int | None]:
        """``finish_reason`` and ``stop_reason`` of a finished ``choice`` whose engine
        reason was ``reason`` (a stop string or token id wins over the length cap)."""
        hit = self.hit(choice)
        return (reason, None) if hit is None else ("stop", hit.reason)

    def answer(self, count: int, choice: int = 0) -> str:
        """The text of ``choice`` after ``count`` tokens, cut where a stop ended it."""
        text = self.text(count, choice)
        hit = self.hit(choice)
        return text if hit is None or count < hit.tokens else text[: hit.chars]

    def prompt_ids(self) -> tuple[int, ...]:
        """The prompt's token ids (derived on demand: only the prefix cache needs them)."""
        return () if self.prompt is None else self.prompt.token_ids()

    @property
    def n(self) -> int:
        """Number of choices."""
        return len(self.output_tokens)

    def _base(self, choice: int) -> int:
        if self.bases:
            return self.bases[choice]
        return (self.seed_hash + 7 * choice) % len(FILLER)

    def word(self, index: int, choice: int = 0) -> str:
        """The filler text of output token ``index`` of ``choice``."""
        return tokenizer.word_text(self._base(choice), self.start + index)

    def token_id(self, index: int, choice: int = 0) -> int:
        """The id of output token ``index`` of ``choice`` (a word token)."""
        natural = self.naturals[choice] if self.naturals else 0
        return tokenizer.word_token(self._base(choice), natural, self.start + index)

    def token_ids(self, count: int, choice: int = 0) -> list[int]:
        """The first ``count`` tokens' ids of ``choice``."""
        return [self.token_id(i, choice) for i in range(count)]

    def text(self, count: int, choice: int = 0) -> str:
        """The first ``count`` tokens' text of ``choice``."""
        return "".join(self.word(i, choice) for i in range(count))


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object body or raise vLLM's 400."""
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise body_error("0", "json_invalid", "JSON decode error", "<bytes>") from exc
    except json.JSONDecodeError as exc:
        detail = {
            "type": "json_invalid", "loc": f"body.{exc.pos}", "msg": "JSON decode error",
            "input": "<dict of 0 items>", "ctx": {"error": exc.msg},
        }  # fmt: skip
        raise SimError(
            400, f"1 validation error:\n  {detail}", param=f"body.{exc.pos}",
            error_type=VALIDATION_TYPE,
        ) from exc  # fmt: skip
    if not isinstance(body, dict):
        raise body_error("", "model_attributes_type", "Input should be a valid dictionary", body)
    return body


def _int_field(body: dict[str, Any], name: str) -> int | None:
    """An optional integer field, with pydantic's lax coercion (``"5"``, ``5.0``)."""
    value = body.get(name)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise body_error(
            name, "int_from_float", "Input should be a valid integer, got a number with a "
            "fractional part", value,
        )  # fmt: skip
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise body_error(
                name, "int_parsing",
                "Input should be a valid integer, unable to parse string as an integer", value,
            ) from None  # fmt: skip
    raise body_error(name, "int_type", "Input should be a valid integer", value)


def _float_field(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise body_error(
                name, "float_parsing",
                "Input should be a valid number, unable to parse string as a number", value,
            ) from None  # fmt: skip
    raise body_error(name, "float_type", "Input should be a valid number", value)


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as the simulator sees it."""

    key: bytes  # what the output draw is seeded with
    tokens: int
    chars: int | None  # characters of prompt text (None for token ids)
    body: Any = field(default=None, compare=False, repr=False)  # messages, text or ids

    def token_ids(self) -> tuple[int, ...]:
        """The prompt's token ids (``tokens`` of them)."""
        if isinstance(self.body, str):
            return tuple(tokenizer.encode(self.body))
        if isinstance(self.body, list) and self.chars is None:
            return tuple(self.body)
        if isinstance(self.body, list):
            return tuple(tokenizer.encode_chat(self.body))
        return ()


def _prompt(body: dict[str, Any], chat: bool) -> Prompt:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise body_error("messages", "list_type", "Input should be a valid list", messages)
        if not messages:
            raise SimError(
                400,
                "Cannot apply chat template to an empty conversation. Provide at least one "
                "message.",
            )
        key = tokenizer.chat_text(messages).encode()
        tokens = CHAT_REPLY_OVERHEAD
        chars = CHAT_REPLY_OVERHEAD * CHARS_PER_TOKEN
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            text = content if isinstance(content, str) else ""
            tokens += CHAT_MESSAGE_OVERHEAD + -(-len(text.encode()) // CHARS_PER_TOKEN)
            chars += CHAT_MESSAGE_OVERHEAD * CHARS_PER_TOKEN + len(text)
        return Prompt(key, tokens, chars, messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if prompt is None or prompt == "" or prompt == []:
        raise validation_error(
            "prompt", "Either prompt or prompt_embeds must be provided and non-empty."
        )
    if isinstance(prompt, str):
        data = prompt.encode()
        return Prompt(data, max(1, -(-len(data) // CHARS_PER_TOKEN)), len(prompt), prompt)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return Prompt(_ids_key(prompt), len(prompt), None, prompt)
    # vLLM batches several prompts in one request; the simulator serves one.
    raise SimError(
        400, "'prompt' must be a string or a list of token ids (one prompt)", param="prompt"
    )


def _ids_key(ids: list[int]) -> bytes:
    """A token-id prompt's seed: its decoded bytes (the same as its text's), or, with an id
    outside the vocabulary, its JSON."""
    try:
        return b"".join(tokenizer.token_bytes(t) for t in ids)
    except ValueError:
        return json.dumps(ids).encode()


def _seed_hash(key: bytes, seed: int, choice: int) -> int:
    salt = seed.to_bytes(8, "big", signed=True)
    data = key if choice == 0 else key + b"#" + str(choice).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=salt).digest(), "big")


def _draws(key: bytes, seed: int, body_seed: Any, n: int
           ) -> tuple[list[int], tuple[int, ...]]:
    """Each choice's draw and first filler word. With a ``seed`` in the body, choice ``i``
    draws as choice 0 of the same request with ``seed + i`` (vLLM gives child ``i`` of a
    request the seed ``seed + i``: ``v1/engine/parallel_sampling.py``)."""
    if isinstance(body_seed, int) and not isinstance(body_seed, bool):
        hashes = [_seed_hash(key + b"@" + str(body_seed + i).encode(), seed, 0)
                  for i in range(n)]
        return hashes, tuple(h % len(FILLER) for h in hashes)
    hashes = [_seed_hash(key, seed, i) for i in range(n)]
    return hashes, tuple((hashes[0] + 7 * i) % len(FILLER) for i in range(n))


def _check_context(prompt: Prompt, model_len: int) -> None:
    """vLLM's prompt length checks: characters before tokenizing, then tokens."""
    max_chars = model_len * CHARS_PER_TOKEN  # vLLM: max_model_len x the longest token
    if prompt.chars is not None and prompt.chars > max_chars:
        raise validation_error(
            "input_text",
            f"This model's maximum context length is {model_len} tokens. However, your "
            f"prompt contains {prompt.chars} characters (more than {max_chars} characters, "
            f"which is the upper bound for {model_len} input tokens). Please reduce the "
            "length of the input prompt.",
            prompt.chars,
        )
    if prompt.tokens > model_len:
        # vLLM tokenizes text up to max_model_len + 1 tokens, hence "at least".
        count = prompt.tokens if prompt.chars is None else min(prompt.tokens, model_len + 1)
        qualifier = "at least " if prompt.chars is not None and count == model_len + 1 else ""
        raise validation_error(
            "input_tokens",
            f"This model's maximum context length is {model_len} tokens. However, your "
            f"prompt contains {qualifier}{count} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            count,
        )


def _check_sampling(n: int, temperature: float | None, max_tokens: int) -> None:
    """vLLM's ``SamplingParams`` checks, in its order."""
    if n < 1:
        raise SimError(400, f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise SimError(400, f"n must be at most {MAX_N}, got {n}.")
    if temperature is not None and temperature < 0.0:
        raise validation_error(
            "temperature", f"temperature must be non-negative, got {temperature}.", temperature
        )
    if temperature is not None and temperature > 2.0:
        raise validation_error(
            "temperature", f"temperature must be in [0, 2], got {temperature}.", temperature
        )
    if max_tokens < 1:
        raise validation_error(
            "max_tokens", f"max_tokens must be at least 1, got {max_tokens}.", max_tokens
        )
    if n > 1 and temperature is not None and temperature < GREEDY_EPS:
        raise SimError(400, f"n must be 1 when using greedy sampling, got {n}.")


def parse_request(
    body: dict[str, Any],
    *,
    chat: bool,
    headers_priority: str | None,
    model_len: int,
    seed: int,
) -> SimRequest:
    """Validate a request body and derive token counts; raise ``SimError`` on bad input."""
    n = _int_field(body, "n")
    priority = _int_field(body, "priority") or 0
    temperature = _float_field(body, "temperature")
    limit_name = "max_tokens"
    max_tokens = _int_field(body, "max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        limit_name = "max_completion_tokens"
        max_tokens = _int_field(body, "max_completion_tokens")
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None and not stream:
        raise validation_error(
            "stream_options", "Stream options can only be defined when `stream=True`."
        )
    if headers_priority is not None:
        try:
            priority = int(headers_priority)
        except ValueError as exc:
            raise SimError(400, f"{PRIORITY_HEADER} must be an integer") from exc
    if max_tokens is not None and max_tokens > model_len:
        raise validation_error(
            limit_name,
            f"{limit_name}={max_tokens} cannot be greater than max_model_len={model_len}. "
            "Please request fewer output tokens.",
            max_tokens,
        )
    prompt = _prompt(body, chat)
    key, prompt_tokens = prompt.key, prompt.tokens
    _check_context(prompt, model_len)
    room = model_len - prompt_tokens
    max_tokens = room if max_tokens is None else min(max_tokens, room)
    n = 1 if n is None else n
    _check_sampling(n, temperature, max_tokens)
    hashes, bases = _draws(key, seed, body.get("seed"), n)
    naturals = tuple(MIN_DRAW + h % (MAX_DRAW - MIN_DRAW + 1) for h in hashes)
    start = 0
    state = _continued(prompt)
    if state is not None:  # the prompt ends inside an answer: continue it
        base, natural, index = state
        bases, naturals, start = (base,) * n, (natural,) * n, index + 1
    if body.get("ignore_eos"):
        outputs = tuple(max_tokens for _ in hashes)
    else:
        outputs = tuple(min(max(1, natural - start), max_tokens) for natural in naturals)
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    continuous = include_usage and bool(options and options.get("continuous_usage_stats"))
    req = SimRequest(
        chat=chat,
        prompt_key=key,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        output_tokens=outputs,
        priority=priority,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        seed_hash=hashes[0],
        prompt=prompt,
        bases=bases,
        naturals=naturals,
        start=start,
        return_token_ids=bool(body.get("return_token_ids")),
        stops=parse_stops(body),
    )
    return _stopped(req) if req.stops else req


def _stopped(req: SimRequest) -> SimRequest:
    """``req`` with each choice cut where its stop strings or stop token ids end it."""
    hits = tuple(
        find_stop(req.stops, count, functools.partial(req.word, choice=i),
                  functools.partial(req.token_id, choice=i))
        for i, count in enumerate(req.output_tokens)
    )  # fmt: skip
    outputs = tuple(
        c if h is None else h.tokens for c, h in zip(req.output_tokens, hits, strict=True)
    )
    return dataclasses.replace(req, output_tokens=outputs, hits=hits)


def parse_stops(body: dict[str, Any]) -> Stops:
    """``stop``, ``stop_token_ids`` and ``include_stop_str_in_output`` of a request body
    (``loadtest/sim/stops.py``), checked as vLLM checks them."""
    stop = body.get("stop")
    if stop is None:
        strings: tuple[str, ...] = ()
    elif isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        strings = tuple(stop)
    else:
        raise body_error("stop", "list_type", "Input should be a valid list", stop)
    if any(not s for s in strings):
        raise SimError(400, "stop cannot contain an empty string.")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise body_error("stop_token_ids", "list_type", "Input should be a valid list", ids)
    return Stops(strings, frozenset(ids), bool(body.get("include_stop_str_in_output")))


def _continued(prompt: Prompt) -> tuple[int, int, int] | None:
    """The state of the answer a token-id prompt ends inside, if it does."""
    ids = prompt.body
    if prompt.chars is not None or not isinstance(ids, list) or not ids:
        return None
    return tokenizer.word_state(ids[-1])
