"""JSON on the request path: orjson where it reads and writes what the standard library
would, the standard library for the rest.

orjson is several times faster than ``json`` but not the same on every input: it reads an
integer beyond 64 bits as a float, and refuses what ``json`` takes (a lone surrogate
escape, a UTF-8 byte-order mark, ``NaN``). So :func:`loads` sends a text
with a run of 19 or more digits (an integer that may not fit) to ``json`` at once, and
reads whatever orjson refuses again with ``json``, whose answer or error stands: a
``json`` error is what the caller sees either way. :func:`dumps` writes compact UTF-8 (the
same JSON value as ``json.dumps``); what orjson cannot write (an integer beyond 64 bits, a
lone surrogate, nesting deeper than 255) ``json.dumps`` writes as before, or raises its error.
Neither is for non-finite floats: orjson writes them as ``null``, and what these carry
never holds one (a body's ``NaN`` is refused when it is read,
``gateway/proxy/completion_request.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson

# every digit read as "0", every other byte as " ": a run of 19 digits is then a substring
# (several times faster than a regular expression's scan)
_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"0" * 19


def plain(raw: bytes) -> bool:
    """Does orjson read whatever JSON ``raw`` holds as ``json`` would? It does unless
    ``raw`` has a run of 19 or more digits (one check for several texts it holds)."""
    return _LONG_RUN not in raw.translate(_DIGITS)


def loads(raw: bytes, fallback: Callable[[bytes], Any] = json.loads,
          plain: bool = False) -> Any:
    """``raw`` decoded; ``fallback`` (``json.loads`` or a caller's variant of it) reads
    what orjson would read differently or refuses, and raises its own errors.
    ``plain``: :func:`plain` is known to hold for ``raw`` (checked on a text holding it)."""
    if plain or _LONG_RUN not in raw.translate(_DIGITS):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return fallback(raw)


def dumps(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError: a big integer, a surrogate, deep nesting
        return json.dumps(value).encode()
