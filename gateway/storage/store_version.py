"""The store's server version, checked once at start: fairgate needs Redis 7.0 or later.

Redis 6.2 parses every script fairgate runs, but not ``SET … NX GET`` (7.0), with which
the replicas agree on the runtime keys' pepper (``gateway/access/keyring.py``): on 6.2
``POST /admin/keys`` answered 503 "syntax error" and every key not in the config file a
503 instead of a 401 (which the OpenAI SDK retries), while the failure at start went
unsaid. Valkey 7.2 and later report ``redis_version:7.2.x`` beside their own
``valkey_version``; both are named in the refusal.

A store that cannot be reached at start is not checked (the gateway starts and answers
503 until it is back, as before): only a server that answers is judged.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any

import structlog
import yarl

from gateway.core.errors import StoreUnavailable
from gateway.storage.redis_client import BoundaryCluster, BoundaryRedis

log = structlog.get_logger("fairgate.store")

MIN_VERSION = (7, 0)
MIN_TEXT = "Redis 7.0 (or Valkey 7.2)"
_NUMBERS = re.compile(r"(\d+)\.(\d+)")


class StoreTooOld(Exception):
    """The store's server is older than fairgate needs: one line naming both versions."""


def server_name(info: Mapping[str, Any]) -> str:
    """"Redis 6.2.5", or "Valkey 8.1.0 (redis_version 7.2.4)", from INFO server."""
    redis_version = str(info.get("redis_version", "?"))
    if "valkey_version" in info:
        return f"Valkey {info['valkey_version']} (redis_version {redis_version})"
    return f"Redis {redis_version}"


def version_problem(info: Mapping[str, Any]) -> str | None:
    """Why a server with this INFO server section cannot be fairgate's store, or None.
    A ``redis_version`` that is no version (a proxy's own) is not judged."""
    found = _NUMBERS.match(str(info.get("redis_version", "")))
    if found is None:
        return None
    if (int(found[1]), int(found[2])) >= MIN_VERSION:
        return None
    return f"runs {server_name(info)}; fairgate needs {MIN_TEXT} or later"


def servers(info: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The INFO of each server in ``info``: one server's, or a cluster client's answer
    (each node's INFO by its name)."""
    if "redis_version" in info:
        return [info]
    return [v for v in info.values() if isinstance(v, Mapping) and "redis_version" in v]


async def check_store_version(client: BoundaryRedis, where: str) -> None:
    """Raise :class:`StoreTooOld` when a server of the store at ``where`` is older than
    :data:`MIN_VERSION` (every node of a cluster that answers is asked)."""
    try:
        info = await client.info("server")
    except StoreUnavailable as exc:
        log.warning("store_version_unchecked", store=where, error=exc.message)
        return
    answers = [info]
    if isinstance(client, BoundaryCluster):  # INFO answered by one node: ask each
        answers += [a for a in await asyncio.gather(
            *(client.execute_command("INFO", "server", target_nodes=node)
              for node in client.get_nodes()), return_exceptions=True)
            if isinstance(a, Mapping)]  # a node that cannot be reached is not judged
    for server in (s for answer in answers for s in servers(answer)):
        problem = version_problem(server)
        if problem is not None:
            raise StoreTooOld(f"the store at {_without_password(where)} {problem}")


def _without_password(where: str) -> str:
    try:
        url = yarl.URL(where)
    except ValueError:
        return where
    return str(url.with_password(None)) if url.password else where
