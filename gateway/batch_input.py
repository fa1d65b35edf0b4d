"""Validation of a Batch API input file (JSONL), line by line.

Each line: ``{"custom_id": str, "method": "POST", "url": <endpoint>, "body": {...}}`` with
a unique ``custom_id`` and a ``body.model`` fairgate serves. Errors name the first bad
lines so a user can fix the file in one go.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from gateway.completion_request import CHAT, COMPLETIONS
from gateway.errors import BadRequest

ENDPOINTS = (CHAT, COMPLETIONS)
MAX_REPORTED = 10


@dataclass(frozen=True, slots=True)
class BatchLine:
    index: int
    custom_id: str
    url: str
    body: dict[str, Any]

    @property
    def model(self) -> str:
        return str(self.body["model"])


def _check(obj: Any, models: Collection[str]) -> str | None:
    """The problem with one parsed line, or None."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "'custom_id' must be a non-empty string"
    if obj.get("method") != "POST":
        return "'method' must be \"POST\""
    if obj.get("url") not in ENDPOINTS:
        return f"'url' must be one of {', '.join(ENDPOINTS)}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "'body' must be an object"
    if body.get("stream"):
        return "streaming is not supported in a batch"
    if body.get("model") not in models:
        return f"model {body.get('model')!r} is not served here"
    return None


def parse_lines(raw_lines: Iterable[bytes], models: Collection[str]) -> Iterator[BatchLine]:
    """Valid lines in order (blank lines skipped); raises BadRequest listing bad lines."""
    problems: list[str] = []
    seen: set[str] = set()
    parsed: list[BatchLine] = []
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            problems.append(f"line {number}: not valid JSON")
            continue
        problem = _check(obj, models)
        if problem is None and obj["custom_id"] in seen:
            problem = f"duplicate custom_id {obj['custom_id']!r}"
        if problem is not None:
            problems.append(f"line {number}: {problem}")
            if len(problems) >= MAX_REPORTED:
                break
            continue
        seen.add(obj["custom_id"])
        parsed.append(BatchLine(len(parsed), obj["custom_id"], obj["url"], obj["body"]))
    if problems:
        more = " (first errors shown)" if len(problems) >= MAX_REPORTED else ""
        raise BadRequest("invalid batch input file" + more + ": " + "; ".join(problems),
                         param="file")
    if not parsed:
        raise BadRequest("the batch input file has no requests", param="file")
    return iter(parsed)
