"""Validation of an incoming body for the OpenAI endpoints fairgate queues and those it
forwards unqueued, each as its entry in ``gateway/proxy/endpoints.py`` declares it.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.core import jsonio
from gateway.core.errors import BadRequest, PayloadTooLarge
from gateway.proxy.endpoints import Endpoint, Frames
from policies.cost import with_output_bound

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


@dataclass(slots=True)
class CompletionRequest:
    """A validated body of one of the queued endpoints, as the backend gets it: when it
    sets several output-token fields (chat: ``max_tokens`` and ``max_completion_tokens``)
    that disagree, each says the smallest (``policies/cost.with_output_bound``), so what
    the backend may generate is what admission reserved."""

    endpoint: Endpoint
    body: dict[str, Any]

    def __post_init__(self) -> None:
        self.body = with_output_bound(self.body, self.endpoint.output_token_fields)

    @property
    def path(self) -> str:
        return self.endpoint.path

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


async def read_completion(request: web.Request, endpoint: Endpoint, max_bytes: int,
                          limits: Limits = NO_LIMITS) -> CompletionRequest:
    body = await read_json_object(request, max_bytes)
    validate_body(body, endpoint, limits)
    return CompletionRequest(endpoint, body)


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


def validate_body(body: dict[str, Any], endpoint: Endpoint, limits: Limits = NO_LIMITS
                  ) -> None:
    """Raises :class:`BadRequest` naming the first field that is wrong."""
    if limits.max_json_depth is not None:
        check_depth(body, limits.max_json_depth)
    check_model(body)
    if endpoint.prompt_field is not None:
        PROMPT_CHECKS[endpoint.prompt_field](body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    if stream and not endpoint.streams:
        raise BadRequest(f"{endpoint.path} is not streamed: 'stream' must be false or "
                         "absent", param="stream")
    _check_output_tokens(body, endpoint.output_token_fields, limits.max_output_tokens)
    _check_sequences(body)
    if endpoint.frames is Frames.CHOICES:
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object", param="stream_options")
    if limits.max_end_user_chars is not None:
        check_end_user(body.get("user"), limits.max_end_user_chars)


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    if not all(isinstance(m, dict) and "role" in m for m in messages):
        raise BadRequest("each message must be an object with a 'role'", param="messages")


def _text_or_array(name: str) -> Callable[[dict[str, Any]], None]:
    def check(body: dict[str, Any]) -> None:
        if not isinstance(body.get(name), str | list):
            raise BadRequest(f"'{name}' must be a string or an array", param=name)
    return check


# the prompt fields an endpoint may declare, each with its check
PROMPT_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "messages": _check_messages, "prompt": _text_or_array("prompt"),
    "input": _text_or_array("input")}


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


def read_session(header: str | None, body: dict[str, Any], endpoint: Endpoint) -> str:
    """A request's session key (sessions on): the ``X-Fairgate-Session`` header, else the
    conversation its endpoint's body names (the Responses API's ``conversation``, an id
    or ``{"id": ...}``), else "" (its user's default session). 1 to 128 characters of
    letters, digits, ``_``, ``.`` and ``-``."""
    if header is not None:
        if not SESSION_KEY.fullmatch(header):
            raise BadRequest(f"header {SESSION_HEADER} must be 1 to 128 characters of "
                             "letters, digits, '_', '.' and '-'")
        return header
    field = endpoint.session_field
    value = body.get(field) if field else None
    if isinstance(value, dict):
        value = value.get("id")
    if value is None:
        return ""
    if not isinstance(value, str) or not SESSION_KEY.fullmatch(value):
        raise BadRequest(f"'{field}' must be a conversation id of 1 to 128 characters of "
                         "letters, digits, '_', '.' and '-' (or an object with such an "
                         "'id')", param=field)
    return value


def validate_unscheduled(body: dict[str, Any], limits: Limits = NO_LIMITS) -> None:
    """``/tokenize`` and ``/detokenize``: only the model to route by (vLLM checks the rest)."""
    if limits.max_json_depth is not None:
        check_depth(body, limits.max_json_depth)
    check_model(body)


def check_model(body: dict[str, Any]) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("you must provide a model parameter", param="model")


def _check_output_tokens(body: dict[str, Any], names: tuple[str, ...], cap: int | None) -> None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(f"'{name}' must be a positive integer", param=name)
        if cap is not None and value > cap:
            raise BadRequest(f"'{name}' must be at most {cap} (got {value})", param=name)


def _check_sequences(body: dict[str, Any]) -> None:
    """``n`` and ``best_of`` (sequences generated, each up to the output bound): whole
    numbers, or vLLM reads ``"8"`` and ``8.0`` as 8 while the reservation counted 1."""
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is None:
            continue
        if (not isinstance(value, int) or isinstance(value, bool)
                or not 1 <= value <= MAX_SEQUENCES):
            raise BadRequest(f"'{name}' must be an integer from 1 to {MAX_SEQUENCES}",
                             param=name)


def check_context(body: dict[str, Any], endpoint: Endpoint, max_model_len: int | None
                  ) -> None:
    """Output limits beyond the model's context length can never be met (vLLM answers
    400): refused before the request waits in the queue."""
    if max_model_len is None:
        return
    for name in endpoint.output_token_fields:
        value = body.get(name)
        if isinstance(value, int) and value > max_model_len:
            raise BadRequest(f"'{name}' ({value}) is larger than the model's context length "
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
