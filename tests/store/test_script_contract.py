"""The Lua contract, named both ways: every script takes one JSON object (``ARGV[1]``,
fields by name) and returns one JSON object, and never indexes ``KEYS`` (it only declares
the keys a call touches, for Redis Cluster) nor any other ``ARGV``
(``docs/redis-schema.md``)."""

from __future__ import annotations

import re
from importlib import resources

import pytest

INDEXED = re.compile(r"\bKEYS\s*\[|\bARGV\s*\[\s*(?!1\s*\])")


def scripts() -> dict[str, str]:
    lua = resources.files("gateway.storage") / "lua"
    return {f.name.removesuffix(".lua"): f.read_text() for f in lua.iterdir()
            if f.name.endswith(".lua") and not f.name.startswith("_")}


def code(text: str) -> str:
    """The script without its comments."""
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


def main_chunk(body: str) -> list[str]:
    """The script's lines outside its local functions (each opened at the start of a line
    and closed by an ``end`` alone there)."""
    lines, inside = [], False
    for line in body.splitlines():
        if line.startswith("local function "):
            inside = True
        elif inside and line.rstrip() == "end":
            inside = False
        elif not inside:
            lines.append(line)
    return lines


@pytest.mark.parametrize("name", sorted(scripts()))
def test_a_script_takes_one_named_object_and_returns_a_named_map(name: str) -> None:
    body = code(scripts()[name])
    assert "cjson.decode(ARGV[1])" in body, f"{name}.lua does not read one JSON object"
    indexed = [m.group(0) for m in INDEXED.finditer(body)]
    assert indexed == [], f"{name}.lua indexes KEYS or ARGV by position: {indexed}"
    # a return of the main chunk (not of an inline function) hands back cjson.encode's
    # map, or a local holding one
    encoded = set(re.findall(r"local (\w+) = cjson\.encode\(", body))
    returns = [line.strip() for line in main_chunk(body)
               if re.search(r"\breturn\b", line) and "function(" not in line]
    plain = [r for r in returns if "cjson.encode(" not in r
             and not any(re.search(rf"\breturn {v}\b", r) for v in encoded)]
    assert returns and not plain, f"{name}.lua returns something other than a named map: {plain}"


def test_the_library_modules_index_no_keys_or_arguments() -> None:
    lua = resources.files("gateway.storage") / "lua"
    for f in [lua / "_lib.lua", *(lua / "lib").iterdir()]:
        indexed = [m.group(0) for m in re.finditer(r"\b(KEYS|ARGV)\s*\[", code(f.read_text()))]
        assert indexed == [], f"{f.name} reads KEYS or ARGV: {indexed}"
