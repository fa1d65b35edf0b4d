"""``gateway/core/jsonio.py``: orjson's speed, the standard library's answers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.core import jsonio

SAME = [
    b'{"model": "m", "messages": [{"role": "user", "content": "hi \\u00e9 \xc3\xa9"}]}',
    b'[1, -0, 0.1, 1e308, -2.5e-7, 9223372036854775807, -9223372036854775808]',
    b'{"a": 1, "a": 2}',  # the last one wins in both
    b'  "\\ud83d\\ude00 \\/ \\u0000"  ',
    b"true", b"null", b"[]", b"{}",
]


@pytest.mark.parametrize("raw", SAME)
def test_loads_reads_what_json_reads(raw: bytes) -> None:
    got, want = jsonio.loads(raw), json.loads(raw)
    assert got == want and type(got) is type(want), f"{raw!r}: {got!r} vs json's {want!r}"


@pytest.mark.parametrize("raw", [
    b"123456789012345678901234567890",  # orjson alone: a float
    b'{"seed": 18446744073709551616}',
    b'"\\ud800"',  # a lone surrogate: orjson refuses it
    b"\xef\xbb\xbf{}",  # a byte-order mark: json takes it
    b"NaN",  # json reads it (parse_json refuses it after)
])
def test_loads_gives_json_s_answer_where_orjson_differs(raw: bytes) -> None:
    got = jsonio.loads(raw)
    assert repr(got) == repr(json.loads(raw)), f"{raw[:40]!r}: {got!r}"


@pytest.mark.parametrize("raw", [b"{not json", b"[1,]", b"", b'"\xff"'])
def test_loads_raises_json_s_error(raw: bytes) -> None:
    with pytest.raises(ValueError) as got:
        jsonio.loads(raw)
    with pytest.raises(ValueError) as want:
        json.loads(raw)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value), (
        f"{raw!r}: {got.value!r} vs json's {want.value!r}")


def test_loads_raises_json_s_error_for_deep_nesting() -> None:
    with pytest.raises(RecursionError):
        jsonio.loads(b"[" * 2000 + b"]" * 2000)


@pytest.mark.parametrize("value", [
    {"model": "m", "messages": [{"role": "user", "content": "é \n \u2028"}], "n": 1.5},
    {"seed": 2**70, "x": -(2**80)},  # beyond 64 bits: json writes it
    {"text": "\ud800"},  # a lone surrogate: json escapes it
    [None, True, False, 0, -1, 1e-7],
    json.loads("[" * 300 + "]" * 300),  # deeper than orjson writes
])
def test_dumps_writes_the_same_value(value: Any) -> None:
    data = jsonio.dumps(value)
    assert isinstance(data, bytes)
    back = json.loads(data)
    assert back == value, f"{value!r} came back as {back!r} from {data[:80]!r}"
