"""Validation of a Batch API input file (JSONL), line by line.

Each line: ``{"custom_id": str, "method": "POST", "url": <endpoint>, "body": {...}}`` with
a unique ``custom_id``, a ``url`` the Batch API takes (chat, completions, embeddings,
responses: ``BATCHABLE`` in ``gateway/proxy/endpoints.py``), a ``body.model`` fairgate
serves and a body its endpoint accepts, within the request limits (``Limits``: depth,
output tokens, end user), checked as an interactive call's body is, so no accepted line
can fail later on its shape; and, where a model's context length is known (``contexts``),
no output-token field beyond it (a bound that can never be met). Errors name the first bad
lines so a user can fix the file in one go.

Parsing a large file takes seconds of CPU: callers on the event loop run
:func:`summarize_file` and :func:`load_file` in a worker thread (``asyncio.to_thread``).
:func:`scan_lines` streams: only the ``custom_id`` set grows with the file.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.core.errors import BadRequest
from gateway.proxy.completion_request import (
    NO_LIMITS,
    CompletionRequest,
    Limits,
    check_context,
    parse_body,
    parse_json,
)
from gateway.proxy.endpoints import BATCHABLE, BY_PATH

MAX_REPORTED = 10


@dataclass(frozen=True, slots=True)
class BatchLine:
    index: int
    custom_id: str
    url: str
    request: CompletionRequest  # its body, read once as an interactive call's is

    @property
    def model(self) -> str:
        return self.request.model


@dataclass(slots=True)
class FileSummary:
    """A valid input file: its request count and, per url, its first lines (0-based)."""

    requests: int = 0
    lines_by_url: dict[str, list[int]] = field(default_factory=dict)


def _check(obj: Any, models: Collection[str], limits: Limits,
           contexts: Mapping[str, int]) -> CompletionRequest | str:
    """One parsed line's request, or the problem with it."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "'custom_id' must be a non-empty string"
    if obj.get("method") != "POST":
        return "'method' must be \"POST\""
    if obj.get("url") not in BATCHABLE:
        return f"'url' must be one of {', '.join(BATCHABLE)}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "'body' must be an object"
    if body.get("stream"):
        return "streaming is not supported in a batch"
    try:
        creq = parse_body(body, BY_PATH[obj["url"]], limits)
    except BadRequest as exc:
        return "'body': " + exc.message
    if creq.model not in models:
        return f"model {creq.model!r} is not served here"
    try:
        check_context(creq, contexts.get(creq.model))
    except BadRequest as exc:
        return "'body': " + exc.message
    return creq


def _parse(raw: bytes) -> tuple[Any, str | None]:
    """(the line's JSON, None) or (None, what is wrong with it): decoded as a request's
    body is (``completion_request.parse_json``)."""
    try:
        return parse_json(raw, "the line"), None
    except BadRequest as exc:
        return None, exc.message


def scan_lines(raw_lines: Iterable[bytes], models: Collection[str],
               limits: Limits = NO_LIMITS, contexts: Mapping[str, int] | None = None
               ) -> Iterator[BatchLine]:
    """Valid lines in order (blank lines skipped), as they are read; once the input is
    exhausted, raises BadRequest listing the bad lines (or if there were none at all).
    ``contexts``: the context length of each model that has a known one."""
    problems: list[str] = []
    seen: set[str] = set()
    count = 0
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        obj, problem = _parse(raw)
        checked = problem if problem is not None else _check(obj, models, limits,
                                                             contexts or {})
        if not isinstance(checked, str) and obj["custom_id"] in seen:
            checked = f"duplicate custom_id {obj['custom_id']!r}"
        if isinstance(checked, str):
            problems.append(f"line {number}: {checked}")
            if len(problems) >= MAX_REPORTED:
                break
            continue
        seen.add(obj["custom_id"])
        if not problems:
            yield BatchLine(count, obj["custom_id"], obj["url"], checked)
        count += 1
    if problems:
        more = " (first errors shown)" if len(problems) >= MAX_REPORTED else ""
        raise BadRequest("invalid batch input file" + more + ": " + "; ".join(problems),
                         param="file")
    if not count:
        raise BadRequest("the batch input file has no requests", param="file")


def parse_lines(raw_lines: Iterable[bytes], models: Collection[str],
                limits: Limits = NO_LIMITS) -> Iterator[BatchLine]:
    """Every valid line, once the whole input is known to be valid."""
    return iter(list(scan_lines(raw_lines, models, limits)))


def load_file(path: Path, models: Collection[str], limits: Limits = NO_LIMITS
              ) -> list[BatchLine]:
    """Every line of a valid input file (blocking: run it in a worker thread)."""
    with path.open("rb") as fh:
        return list(scan_lines(fh, models, limits))


def summarize_file(path: Path, models: Collection[str], limits: Limits = NO_LIMITS,
                   contexts: Mapping[str, int] | None = None) -> FileSummary:
    """Validate a file without keeping its lines (blocking: run it in a worker thread)."""
    summary = FileSummary()
    with path.open("rb") as fh:
        for line in scan_lines(fh, models, limits, contexts):
            summary.requests += 1
            first = summary.lines_by_url.setdefault(line.url, [])
            if len(first) < MAX_REPORTED:
                first.append(line.index)
    return summary
