"""The Lua scripts' text and running them: every script starts with the generated key
functions and value readers and the shared library (:func:`load_library`); :class:`Scripts`
registers a set of them on one client and runs them (loading one again after a Redis
restart emptied its script cache). A script takes one named JSON object and returns a
named map (``cjson.encode``): :meth:`Scripts.call`. KEYS only declares the keys it touches
for Redis Cluster; no script reads them by place.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any, cast

import orjson
import redis.asyncio as aioredis
from redis.client import NEVER_DECODE
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from gateway.core.errors import StoreUnavailable
from gateway.storage.keys import lua_prelude
from gateway.storage.values import lua_values

# The library modules (``lua/lib/``), each after the ones it uses.
LIBRARY = ("inflight", "replicas", "pools", "locality", "fairness", "dispatch")


def load_library() -> str:
    """What every script starts with: the generated key functions and value readers
    (``gateway/storage/keys.py``, ``gateway/storage/values.py``), the shared helpers
    (``lua/_lib.lua``)
    and the library modules (``lua/lib/``, :data:`LIBRARY`: the parts of the dispatch
    decision, the in-flight state, the replicas)."""
    lua = resources.files("gateway.storage") / "lua"
    found = {f.name.removesuffix(".lua") for f in (lua / "lib").iterdir()
             if f.name.endswith(".lua")}
    if found != set(LIBRARY):
        raise RuntimeError(f"lua/lib/ holds {sorted(found)}, LIBRARY lists {list(LIBRARY)}")
    return (lua_prelude() + lua_values() + (lua / "_lib.lua").read_text()
            + "".join((lua / "lib" / f"{name}.lua").read_text() for name in LIBRARY))


def load_script(name: str) -> str:
    """A script's text, after :func:`load_library`."""
    return load_library() + (resources.files("gateway.storage") / "lua" / f"{name}.lua").read_text()


def encode_args(args: Mapping[str, Any]) -> bytes | str:
    """A script's named arguments as the JSON object ``cjson.decode`` reads: orjson's,
    the value ``json.dumps`` wrote before. What orjson would write otherwise goes through
    ``json.dumps`` as before: what it refuses (an integer beyond 64 bits, a lone
    surrogate, a key not a string) and a ``null`` (a None, or a non-finite float, which
    orjson writes as ``null`` where ``json.dumps`` writes ``NaN``)."""
    try:
        out = orjson.dumps(args)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(args)
    return json.dumps(args) if b"null" in out else out


# a reply left as bytes: the JSON reader takes them as they come
RAW = {NEVER_DECODE: True}


class Scripts:
    """The scripts ``names`` (``lua/<name>.lua``), registered on ``client``."""

    def __init__(self, client: aioredis.Redis, names: Sequence[str]) -> None:
        self._client = client
        self._scripts: dict[str, AsyncScript] = {
            name: client.register_script(load_script(name)) for name in names}

    async def run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run a script: its reply as sent (bytes, not decoded: :meth:`call` reads the
        JSON from them). A script the server lacks is loaded once, then run again; a
        Redis that restarts in between (its script cache empty again) answers that second
        run with NOSCRIPT too: load once more, then call it unavailable (a script that
        answers NOSCRIPT did not run, so running it again is safe)."""
        script = self._scripts[name]
        try:
            return await self._loaded(script, keys, args)
        except NoScriptError:
            pass
        try:
            return await self._loaded(script, keys, args)
        except NoScriptError as exc:
            raise StoreUnavailable(f"script {name} not loaded: {exc}") from exc

    async def _loaded(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]
                      ) -> Any:
        """EVALSHA, and after NOSCRIPT the script loaded and run once more (what
        redis-py's script object does, without its copies of the arguments)."""
        client = self._client
        try:
            return await client.execute_command(  # type: ignore[no-untyped-call]
                "EVALSHA", script.sha, len(keys), *keys, *args, **RAW)
        except NoScriptError:
            script.sha = await client.script_load(script.script)
            return await client.execute_command(  # type: ignore[no-untyped-call]
                "EVALSHA", script.sha, len(keys), *keys, *args, **RAW)

    async def call(self, name: str, keys: Sequence[str], args: Mapping[str, Any]
                   ) -> dict[str, Any]:
        """Run a script with its named arguments (one JSON object) and decode the named
        map it returns."""
        return cast("dict[str, Any]", orjson.loads(await self.run(name, keys, [encode_args(args)])))
