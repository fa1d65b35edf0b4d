"""Schemathesis checks for fairgate, loaded by the CLI (``hooks`` in schemathesis.toml).

- ``no_server_error``: no 5xx answer;
- ``openai_error_body``: every 4xx/5xx answer is exactly OpenAI's error object,
  ``{"error": {"message": str, "type": str, "param": str | null, "code": str | null}}``.

Both skip the answers of the defects listed in ``KNOWN_DEFECTS``, each matched as
narrowly as possible and reproduced by a strict xfail test in ``test_http_fuzz.py``:
when a defect is fixed that test passes (and so fails), and its entry here goes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import schemathesis
from schemathesis import Case, CheckContext, Response

from gateway.proxy.endpoints import ENDPOINTS, Kind

FIELDS = {"message", "type", "param", "code"}
# the operations whose backend answers reach the client as the backend sent them: every
# queued or forwarded entry of the endpoint table
FORWARDED = {f"{e.method} {e.path}" for e in ENDPOINTS if e.kind is not Kind.LOCAL}


def error_shape_problem(status: int, content_type: str, raw: bytes) -> str | None:
    """Why an error answer is not OpenAI's error object, or None when it is."""
    if not content_type.startswith("application/json"):
        return f"{status} with Content-Type {content_type!r}, not application/json"
    try:
        body: Any = json.loads(raw)
    except ValueError:
        return f"{status} with a body that is not JSON: {raw[:200]!r}"
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return f"{status} body is not {{'error': {{...}}}}: {body!r:.300}"
    err = body["error"]
    if set(err) != FIELDS:
        return f"{status} error has fields {sorted(err)}, not {sorted(FIELDS)}"
    for name in ("message", "type"):
        if not isinstance(err[name], str) or not err[name]:
            return f"{status} error {name!r} is not a non-empty string: {err[name]!r}"
    for name in ("param", "code"):
        if err[name] is not None and not isinstance(err[name], str):
            return f"{status} error {name!r} is neither a string nor null: {err[name]!r}"
    return None


def _json(response: Response) -> Any:
    try:
        return json.loads(response.content)
    except ValueError:
        return None


def backend_error_integer_code(case: Case, response: Response) -> bool:
    """BY DESIGN: a backend's own error passes through byte for byte (gateway/proxy/upstream.py,
    issue 10: "relay vLLM's OpenAI errors untouched"), and vLLM (≥ 0.10, like the
    simulator) sends ``"code"`` as the integer HTTP status where OpenAI's format has a
    string or null; the openai SDK reads it either way. E.g. ``stream_options`` with
    ``stream: false``: vLLM's 400 ``{"error": {..., "code": 400}}``."""
    body = _json(response)
    err = body.get("error") if isinstance(body, dict) else None
    return (case.operation.label in FORWARDED
            and isinstance(err, dict) and set(err) == FIELDS
            and type(err["code"]) is int and err["code"] == response.status_code)


KNOWN_DEFECTS: list[Callable[[Case, Response], bool]] = [
    backend_error_integer_code,
]


def known_defect(case: Case, response: Response) -> bool:
    return any(matches(case, response) for matches in KNOWN_DEFECTS)


@schemathesis.check
def no_server_error(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """No 5xx: fairgate's backend is healthy and Redis is up throughout the run."""
    if response.status_code >= 500 and not known_defect(case, response):
        raise AssertionError(f"server error {response.status_code}: "
                             f"{response.content[:300]!r}")
    return None


@schemathesis.check
def openai_error_body(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """A 4xx/5xx answer carries OpenAI's error object."""
    if response.status_code < 400:
        return None
    content_type = next((values[0] for name, values in response.headers.items()
                         if name.lower() == "content-type" and values), "")
    problem = error_shape_problem(response.status_code, content_type, response.content)
    if problem is not None and not known_defect(case, response):
        raise AssertionError(problem)
    return None
