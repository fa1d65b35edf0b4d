"""A body of the OpenAI endpoints fairgate queues, read once into its typed
:class:`CompletionRequest` (:func:`parse_body`), and the check of those it forwards
unqueued, each as its entry in ``gateway/proxy/endpoints.py`` declares it (the entry's
prompt reader reads its prompt). No other module reads a body's shape: admission,
limits, cost, locality, continuation, the relay and batch lines read the typed value.

Only what fairgate needs is checked (the model it routes by, the endpoint's prompt field,
``stream``, its output-token fields and the sequences it asks for (``n``, ``best_of``),
the end user); every other field passes through to vLLM untouched.
:class:`Limits` bounds what a client may send beyond the body's size (settings
``max_json_depth``, ``max_output_tokens``, ``max_end_user_chars``): nesting depth (deeper
JSON would make encoding it for the backend recurse past Python's limit), requested
output tokens, and the end-user id (``user``: a Redis key and a metrics label for trusted
keys), which must also be printable text. The header ``X-Fairgate-Deadline-Ms`` (a
first-token deadline, milliseconds from arrival) is read here too, and with sessions on a
request's session key (``X-Fairgate-Session``, or the Responses API's ``conversation``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.core import jsonio
from gateway.core.errors import BadRequest, PayloadTooLarge
from gateway.proxy.endpoints import CHAT, COMPLETIONS, Endpoint, Frames
from gateway.proxy.stop_strings import StopStrings
from policies.request import NO_PROMPT, Output, Prompt

if TYPE_CHECKING:
    from gateway.core.settings import Settings

DEADLINE_HEADER = "X-Fairgate-Deadline-Ms"
SESSION_HEADER = "X-Fairgate-Session"
SESSION_KEY = re.compile(r"[A-Za-z0-9_.-]{1,128}")
MAX_DEADLINE_MS = 86_400_000  # one day, batch's longest queue wait
# n, best_of: OpenAI's bound on n; what a request reserves is multiplied by them
MAX_SEQUENCES = 128


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on a body beyond its size; ``None``: unchecked."""

    max_json_depth: int | None = None  # the body object is depth 1
    max_output_tokens: int | None = None  # max_tokens, max_completion_tokens, max_output_tokens
    max_end_user_chars: int | None = None  # body field ``user``

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(settings.limits.max_json_depth, settings.limits.max_output_tokens,
                   settings.limits.max_end_user_chars)


NO_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """The one typed value a body of a queued endpoint is read into, once, at the edge
    (:func:`parse_body`): everything fairgate reads of it — its prompt
    (``policies/request.Prompt``: the estimate, the reservation, the prefix chain), its
    output (``policies/request.Output``), ``stream``, the end user, its conversation
    (a session key) and what a continuation needs — and ``body``, what the backend gets.
    No other module reads a body's shape.

    When a body sets several output-token fields (chat: ``max_tokens`` and
    ``max_completion_tokens``) that disagree, ``body`` has each say the smallest, so what
    the backend may generate is what admission reserved."""

    endpoint: Endpoint
    body: dict[str, Any]  # as the backend gets it
    model: str  # as named: a base model or a LoRA adapter (routes resolve it)
    prompt: Prompt
    output: Output
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage (chat, completions)
    end_user: str | None = None  # ``user``
    conversation: Any = None  # the entry's session field as sent (read_session checks it)

    @property
    def path(self) -> str:
        return self.endpoint.path

    # what a continuation (gateway/proxy/continuation.py) needs: read only for a stream
    # that may be continued, so not on every request's path
    @property
    def unresumable(self) -> str | None:
        """Why a continuation could not reproduce its answer; None: it can."""
        return _unresumable(self.endpoint, self.body)

    @property
    def replayable(self) -> bool:
        """Not continued from token ids only for fields a replay of the request reproduces
        (:data:`REPLAYED`: tools, structured output; ``gateway/proxy/replay.py``)."""
        if not any(self.body.get(name) is not None for name in REPLAYED):
            return False
        if self.body.get("n") not in (None, 1) or self.body.get("best_of") not in (None, 1) \
                or any(self.body.get(name) for name in REPLAY_DROPS):
            return False  # a replay seams one choice's text, nothing per token
        rest = {k: v for k, v in self.body.items() if k not in REPLAYED}
        return _unresumable(self.endpoint, rest) is None

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling parameters a continuation copies as they are."""
        return {name: self.body[name] for name in SAMPLING if name in self.body}

    @property
    def choices(self) -> tuple[int, int]:
        """(``n``, prompts): a stream's choices are ``n`` per prompt, prompt ``p``'s
        choice ``k`` at index ``p * n + k`` (a completions batch has several prompts)."""
        n = self.body.get("n")
        prompt = self.body.get("prompt")
        prompts = (len(prompt) if self.endpoint is COMPLETIONS and isinstance(prompt, list)
                   and prompt and not isinstance(prompt[0], int) else 1)
        return (n if isinstance(n, int) and n > 1 else 1), prompts

    @property
    def min_tokens(self) -> int:
        value = self.body.get("min_tokens")
        return value if isinstance(value, int) and value > 0 else 0

    @property
    def stop_strings(self) -> StopStrings | None:
        return StopStrings.of(self.body)

    @property
    def logprobs(self) -> int | None:
        """The top log probabilities asked per token (completions: ``logprobs``; chat:
        ``top_logprobs`` once ``logprobs`` is true, 0 without it); None: none asked."""
        if self.endpoint is CHAT:
            top = self.body.get("top_logprobs")
            return (top if isinstance(top, int) else 0) if self.body.get(
                "logprobs") is True else None
        value = self.body.get("logprobs")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def echo(self) -> str | None:
        """The prompt text a completion echoes (``echo`` with a text prompt)."""
        if self.endpoint is not COMPLETIONS or not self.body.get("echo"):
            return None
        return _prompt_text(self.body.get("prompt"))

    @property
    def return_token_ids(self) -> bool:
        """The client asked for the token ids itself."""
        return bool(self.body.get("return_token_ids"))

    def forwarded(self, token_ids: bool = False) -> dict[str, Any]:
        """What the backend gets for a client's call (a copy of ``body``): a stream always
        reports its usage (the relay drops it unless the client asked); ``token_ids``: a
        continuable stream's token ids too."""
        body = dict(self.body)
        if self.stream and self.endpoint.stream_usage_option:
            body["stream_options"] = {**(body.get("stream_options") or {}),
                                      "include_usage": True}
        if token_ids:
            body["return_token_ids"] = True
        return body

    def fetched(self) -> dict[str, Any]:
        """What the backend gets for a call whose answer stays in fairgate (a batch
        line): never streamed."""
        return {**self.body, "stream": False} if self.endpoint.streams else dict(self.body)

    @property
    def output_field(self) -> str | None:
        """The first output-token field it sets (what a 400 about its bound names)."""
        return next((f for f in self.endpoint.output_token_fields
                     if self.body.get(f) is not None), None)


def parse_body(body: dict[str, Any], endpoint: Endpoint, limits: Limits = NO_LIMITS
               ) -> CompletionRequest:
    """``body`` checked (:class:`BadRequest` naming the first field that is wrong) and
    read into its :class:`CompletionRequest`: its prompt by the endpoint's prompt reader
    (``gateway/proxy/endpoints.py``), the rest as the entry's fields declare."""
    if limits.max_json_depth is not None:
        check_depth(body, limits.max_json_depth)
    check_model(body)
    prompt = endpoint.read_prompt(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    if stream and not endpoint.streams:
        raise BadRequest(f"{endpoint.path} is not streamed: 'stream' must be false or "
                         "absent", param="stream")
    fields = endpoint.output_token_fields
    bound = _check_output_tokens(body, fields, limits.max_output_tokens)
    sequences = _check_sequences(body)
    include_usage = False
    if endpoint.frames is Frames.CHOICES:
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object", param="stream_options")
        include_usage = bool((options or {}).get("include_usage"))
    user = body.get("user")
    if limits.max_end_user_chars is not None:
        check_end_user(user, limits.max_end_user_chars)
    conversation = body.get(endpoint.session_field) if endpoint.session_field else None
    if bound is not None and any(f in body and body[f] != bound for f in fields):
        # every field says the smallest (a copy: the client's body is not changed)
        body = {**body, **{f: bound for f in fields if f in body}}
    return CompletionRequest(
        endpoint, body, str(body["model"]), prompt or NO_PROMPT,
        Output(bool(fields), bound, sequences), stream, include_usage,
        user if isinstance(user, str) and user else None, conversation)


async def read_completion(request: web.Request, endpoint: Endpoint, max_bytes: int,
                          limits: Limits = NO_LIMITS) -> CompletionRequest:
    return parse_body(await read_json_object(request, max_bytes), endpoint, limits)


async def read_json_object(request: web.Request, max_bytes: int) -> dict[str, Any]:
    """The request's body, a JSON object of at most ``max_bytes`` bytes (a body that stops
    arriving is cut on every route: ``gateway/http/client_guard.py``)."""
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
    body = parse_json(b"".join(parts))
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


class _NotANumber(ValueError):
    """``NaN``, ``Infinity`` or ``-Infinity``: Python's json reads them, JSON has none."""


def _constant(name: str) -> float:
    raise _NotANumber(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]}{'…' if len(text) > 20 else ''} does not fit a "
                         "64-bit float")
    return value


class _LoneSurrogate(ValueError):
    """A ``\\ud800``-style escape with no partner: no UTF-8 text holds it (vLLM's
    tokenizer fails on it with a 500), so it is refused where it is read."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


def _strict_loads(raw: bytes | str) -> Any:
    value = json.loads(raw, parse_constant=_constant, parse_float=_finite)
    # orjson refuses a lone surrogate, so a body holding one is read here, and only here
    where = _lone_surrogate(value)
    if where is not None:
        raise _LoneSurrogate(where)
    return value


def _lone_surrogate(value: Any) -> str | None:
    """Where in ``value`` a string (or an object's key) holds a lone surrogate, as
    ``messages[0].content``; None: nowhere."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and not _utf8(item):
                return path or "(the body)"
        elif isinstance(item, dict):
            for key, child in item.items():
                at = f"{path}.{key}" if path else str(key)
                if not _utf8(key):
                    return path or "(the body)"
                stack.append((at, child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item)
                         if isinstance(child, (str, dict, list)))
    return None


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def parse_json(raw: bytes | str, what: str = "request body") -> Any:
    """``raw`` decoded, or :class:`BadRequest` saying why not: not JSON, not UTF-8, nested
    deeper than the decoder goes, a string holding a lone surrogate escape (``"\\ud800"``:
    no UTF-8 text holds it, and vLLM answers it 500), a number that is not one (``NaN``,
    ``Infinity``: Python reads them, JSON has none) or does not fit (a float beyond
    ±1.8e308, an integer longer than Python converts: ``sys.get_int_max_str_digits()``,
    4,300 digits). Every JSON a client sends (bodies, batch input lines) is read here:
    what the gateway computes with is a number, and what it forwards to vLLM standard
    JSON."""
    try:
        if isinstance(raw, bytes):  # orjson reads none of those (``gateway/core/jsonio.py``)
            return jsonio.loads(raw, _strict_loads)
        return _strict_loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:  # e.g. "[[[[…": nested deeper than the decoder can go
        raise BadRequest(f"{what} is not valid JSON: nested too deeply") from None
    except _NotANumber as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from None
    except _LoneSurrogate as exc:
        top = exc.where.split(".", 1)[0].split("[", 1)[0]
        raise BadRequest(f"{what} is not valid UTF-8 text: '{exc.where}' holds a lone "
                         "surrogate escape (\\ud800-\\udfff without its pair)",
                         param=top if top != "(the body)" else None) from None
    except ValueError as exc:  # "Exceeds the limit (4300 digits) for integer string …", 1e400
        raise BadRequest(f"{what} holds a number too large: {exc}") from None


def read_deadline_ms(value: str | None) -> int | None:
    """The ``X-Fairgate-Deadline-Ms`` header: a whole number of milliseconds from 1 to
    ``MAX_DEADLINE_MS``, or absent (None)."""
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 12:
        raise BadRequest(f"header {DEADLINE_HEADER} must be a positive integer "
                         "(milliseconds)")
    deadline = int(text)
    if not 1 <= deadline <= MAX_DEADLINE_MS:
        raise BadRequest(f"header {DEADLINE_HEADER} must be between 1 and "
                         f"{MAX_DEADLINE_MS} milliseconds (got {deadline})")
    return deadline


def read_session(header: str | None, creq: CompletionRequest) -> str:
    """A request's session key (sessions on): the ``X-Fairgate-Session`` header, else the
    conversation its endpoint's body names (the Responses API's ``conversation``, an id
    or ``{"id": ...}``), else "" (its user's default session). 1 to 128 characters of
    letters, digits, ``_``, ``.`` and ``-``."""
    if header is not None:
        if not SESSION_KEY.fullmatch(header):
            raise BadRequest(f"header {SESSION_HEADER} must be 1 to 128 characters of "
                             "letters, digits, '_', '.' and '-'")
        return header
    field, value = creq.endpoint.session_field, creq.conversation
    if isinstance(value, dict):
        value = value.get("id")
    if value is None:
        return ""
    if not isinstance(value, str) or not SESSION_KEY.fullmatch(value):
        raise BadRequest(f"'{field}' must be a conversation id of 1 to 128 characters of "
                         "letters, digits, '_', '.' and '-' (or an object with such an "
                         "'id')", param=field)
    return value


def validate_unscheduled(body: dict[str, Any], limits: Limits = NO_LIMITS) -> str:
    """``/tokenize`` and ``/detokenize``: only the model to route by, returned (vLLM
    checks the rest)."""
    if limits.max_json_depth is not None:
        check_depth(body, limits.max_json_depth)
    check_model(body)
    return str(body["model"])


def check_model(body: dict[str, Any]) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("you must provide a model parameter", param="model")


def _check_output_tokens(body: dict[str, Any], names: tuple[str, ...], cap: int | None
                         ) -> int | None:
    """The effective output bound: the smallest of the output-token fields ``names`` the
    body sets (each a positive integer, at most ``cap``); None when it sets none (the
    model's context bounds it). The backend may honour another one (vLLM takes
    ``max_completion_tokens`` over ``max_tokens``): :func:`parse_body` makes every field
    say this one."""
    bound: int | None = None
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(f"'{name}' must be a positive integer", param=name)
        if cap is not None and value > cap:
            raise BadRequest(f"'{name}' must be at most {cap} (got {value})", param=name)
        bound = value if bound is None else min(bound, value)
    return bound


def _check_sequences(body: dict[str, Any]) -> int:
    """``n`` and ``best_of`` (sequences generated, each up to the output bound): whole
    numbers, or vLLM reads ``"8"`` and ``8.0`` as 8 while the reservation counted 1. The
    sequences each prompt generates: the larger of them."""
    sequences = 1
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is None:
            continue
        if (not isinstance(value, int) or isinstance(value, bool)
                or not 1 <= value <= MAX_SEQUENCES):
            raise BadRequest(f"'{name}' must be an integer from 1 to {MAX_SEQUENCES}",
                             param=name)
        sequences = max(sequences, value)
    return sequences


# copied to a continuation as they are: they shape each next token the same way
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
            "repetition_penalty", "skip_special_tokens", "spaces_between_special_tokens",
            "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "user",
            "cache_salt", "presence_penalty", "frequency_penalty")
# counted over the generated tokens only: a continuation emulates them (gateway/proxy/penalties.py)
PENALTIES = ("presence_penalty", "frequency_penalty")
# framing and prompt construction: a continuation sends the prompt's ids instead
NEUTRAL = frozenset(("model", "messages", "prompt", "stream", "stream_options", "max_tokens",
                     "max_completion_tokens", "n", "priority", "return_token_ids",
                     "min_tokens", "add_generation_prompt", "continue_final_message",
                     "add_special_tokens", "chat_template", "chat_template_kwargs",
                     "documents", "request_id", "metadata", "store", "service_tier",
                     "parallel_tool_calls", "tool_choice", "echo", "logprobs",
                     "top_logprobs", "prompt_logprobs",
                     # read for a continuation (gateway/proxy/continuation.py); a suffix is
                     # in the prompt's ids (vLLM renders it into the prompt)
                     "stop", "suffix",
                     # vLLM 0.32 ignores it on chat and completions (not a field there)
                     "best_of"))


# server state a token-id prompt cannot carry (vLLM's tool parser, a structured-output
# grammar): such a stream is continued by sending the request again (a replay)
REPLAYED = frozenset(("tools", "tool_choice", "parallel_tool_calls", "response_format",
                      "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "guided_whitespace_pattern",
                      "guided_decoding_backend", "structural_tag"))
# what a replay's frames would not carry across the seam (whatever continues them else)
REPLAY_DROPS = ("logprobs", "top_logprobs", "prompt_logprobs", "echo")


def _unresumable(endpoint: Endpoint, body: dict[str, Any]) -> str | None:
    """Why a continuation (``gateway/proxy/continuation.py``) could not reproduce this
    request's answer; ``None``: it can.

    Every field outside :data:`SAMPLING` and :data:`NEUTRAL` that is set (not null,
    false, zero or empty) counts: structured output (``response_format``, ``guided_*``,
    ``structured_outputs``), ``tools``, ``echo`` without a text prompt and anything
    fairgate does not know; and presence or frequency penalties beside a
    ``repetition_penalty`` (the bias that emulates them would be scaled). ``n`` > 1 and a
    batch of prompts continue each choice on its own (``gateway/proxy/choices.py``);
    ``stop`` strings, log probabilities, a text prompt's ``echo`` and ``suffix`` are
    continued (``gateway/proxy/stop_strings.py``, ``gateway/proxy/logprobs.py``)."""
    if endpoint not in (CHAT, COMPLETIONS):
        return f"{endpoint.path} is not continued"
    if any(body.get(name) for name in PENALTIES) and body.get("repetition_penalty") not in (
            None, 1, 1.0):
        # vLLM scales the logits (the emulating logit_bias too) by it after the bias
        return "repetition_penalty with presence or frequency penalties"
    if (why := _echo_unresumable(endpoint, body) or _one_choice_only(endpoint, body)):
        return why
    if body.get("tool_choice") not in (None, "none"):
        return "tool_choice is set"
    return _set_unknown(body)


def _echo_unresumable(endpoint: Endpoint, body: dict[str, Any]) -> str | None:
    """``echo``: fairgate puts the echoed prompt back itself (vLLM echoes none when asked
    for ``return_token_ids``), so only a completion's text prompt can be echoed."""
    if not body.get("echo"):
        return None
    if endpoint is not COMPLETIONS or _prompt_text(body.get("prompt")) is None:
        return "echo is set without a text prompt"
    return None


def _one_choice_only(endpoint: Endpoint, body: dict[str, Any]) -> str | None:
    """``stop`` strings, log probabilities and ``echo`` are continued for one choice
    (``gateway/proxy/continuation.py``), not yet for several (``choices.py``)."""
    prompt = body.get("prompt")
    several = body.get("n") not in (None, 1) or (
        endpoint is COMPLETIONS and isinstance(prompt, list) and len(prompt) > 1
        and not isinstance(prompt[0], int))
    if several:
        for name in ("stop", "logprobs", "echo"):
            if body.get(name):
                return f"{name} with several choices"
    return None


def _prompt_text(prompt: Any) -> str | None:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def _set_unknown(body: dict[str, Any]) -> str | None:
    """The first field outside :data:`SAMPLING` and :data:`NEUTRAL` that is set."""
    for name, value in body.items():
        if name in NEUTRAL or name in SAMPLING:
            continue
        if value is None or value is False or value == 0 or value == [] or value == {}:
            continue
        if name == "response_format" and isinstance(value, dict) and value.get(
                "type") == "text":
            continue
        return f"{name} is set"
    return None


def check_context(creq: CompletionRequest, max_model_len: int | None) -> None:
    """An output bound beyond the model's context length can never be met (vLLM answers
    400): refused before the request waits in the queue."""
    bound = creq.output.bound
    if max_model_len is None or bound is None or bound <= max_model_len:
        return
    name = creq.output_field
    raise BadRequest(f"'{name}' ({bound}) is larger than the model's context length "
                     f"({max_model_len} tokens)", param=name)


def check_end_user(user: Any, max_chars: int) -> None:
    """``user`` names the end user: a string of at most ``max_chars`` printable characters
    (no control or format characters, no lone surrogates), or absent/null."""
    if user is None:
        return
    if not isinstance(user, str):
        raise BadRequest("'user' must be a string", param="user")
    if len(user) > max_chars:
        raise BadRequest(f"'user' must be at most {max_chars} characters "
                         f"(got {len(user)})", param="user")
    if not user.isprintable():
        raise BadRequest("'user' must be printable text, without control characters",
                         param="user")


_CONTAINERS = frozenset((dict, list))


def check_depth(body: dict[str, Any], max_depth: int) -> None:
    """Raises :class:`BadRequest` (``param``: the top-level field) when ``body`` nests
    deeper than ``max_depth`` levels. Iterative: any depth that decoded is safe here."""
    for name, value in body.items():
        if type(value) not in _CONTAINERS:
            continue
        stack: list[tuple[Any, int]] = [(value, 2)]
        while stack:
            item, depth = stack.pop()
            if depth > max_depth:
                raise BadRequest(f"request body is nested too deeply: '{name}' goes deeper "
                                 f"than {max_depth} levels", param=name)
            children = item.values() if type(item) is dict else item
            if _CONTAINERS.isdisjoint(map(type, children)):  # C speed: token id lists
                continue
            stack.extend((c, depth + 1) for c in children if type(c) in _CONTAINERS)
