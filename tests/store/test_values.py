"""The values in Redis have one owner (gateway/storage/values.py): the packed entries round-trip
in Python and in the generated Lua alike, and the scripts name no request-hash field it
does not declare."""

from __future__ import annotations

import re
from importlib import resources

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from gateway.storage.values import GRANT, PREFILL, RECORDS, REQUEST_FIELDS, Record, lua_values

# a field value never holds its record's separator (ids, backend names, numbers)
TEXT = st.text(st.characters(blacklist_characters="\t \n", blacklist_categories=("Cs",)),
               min_size=1, max_size=12)


@given(st.sampled_from(RECORDS), st.data())
def test_an_entry_decodes_to_what_was_encoded(record: Record, data: st.DataObject) -> None:
    values = data.draw(st.tuples(*(TEXT for _ in record.fields)))
    assert record.decode(record.encode(*values)) == dict(zip(record.fields, values, strict=True))


def test_an_entry_with_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="grant"):
        GRANT.decode("only\ttwo")
    with pytest.raises(ValueError, match="prefill"):
        PREFILL.encode(1)


async def test_the_lua_builders_and_readers_agree_with_python(redis: aioredis.Redis) -> None:
    script = lua_values() + """
    local g = grant_entry(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[7])
    local p = prefill_entry(ARGV[5], ARGV[6])
    return {g, grant_request_id(g), grant_backend(g), grant_rank(g), grant_pushed_at(g),
            grant_charged(g), p, prefill_tokens(p), prefill_dispatched_at(p)}
    """
    out = await redis.eval(script, 0, "r-1", "b0", "2", "1764600000.5", "812", "1764600001.25",
                           "340")
    assert out[0] == GRANT.encode("r-1", "b0", "2", "1764600000.5", "340"), out
    assert out[1:6] == ["r-1", "b0", "2", "1764600000.5", "340"], out
    assert out[6] == PREFILL.encode(812, "1764600001.25"), out
    assert out[7:] == ["812", "1764600001.25"], out


# The scripts' request hashes: `req`, key_request(...), and these KEYS of a script.
REQUEST_KEYS: dict[str, str] = {}
HASH_CALL = re.compile(r"(?:redis\.call\('(HSET|HSETNX|HGET|HMGET|HDEL)',|(request_get)\()\s*"
                       r"(key_request\([^)]*\)|[^,]+?),\s*([^)]*)\)")


def test_the_scripts_name_only_declared_request_fields() -> None:
    lua = resources.files("gateway.storage") / "lua"
    scripts = [f for f in lua.iterdir() if f.name.endswith(".lua")]
    scripts += [f for f in (lua / "lib").iterdir() if f.name.endswith(".lua")]
    named: dict[str, set[str]] = {}
    for script in scripts:
        text = script.read_text()
        for command, reader, target, rest in HASH_CALL.findall(re.sub(r"\s+", " ", text)):
            command, target = command or reader, target.strip()
            if target == "req" or target.startswith("key_request(") or \
                    target == REQUEST_KEYS.get(script.name):
                args = [a.strip() for a in rest.split(",")]
                if command in ("HSET", "HSETNX"):
                    args = args[::2]  # field, value, field, value, ...
                for arg in args:
                    if field := re.fullmatch(r"'([a-z_]+)'", arg):
                        named.setdefault(field.group(1), set()).add(script.name)
    assert {"owner", "cost", "started", "held_at", "ptok"} <= set(named), named
    undeclared = {f: sorted(s) for f, s in named.items() if f not in REQUEST_FIELDS}
    assert not undeclared, (
        f"request fields in the scripts, not in gateway/storage/values.py: {undeclared}")
