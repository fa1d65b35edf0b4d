"""Key lifecycle under hostile sequences (issue 29, items 5 and 8): a rotation ends every
older secret's grace at its own grace (rotating with grace 3600 and then 0 leaves no old
secret working, and revoking kills them all); without ``key_pepper`` the pepper is the
store's, so after Redis restarts empty a replica that started before and one that
started after still agree on every runtime key. Item 9: a key's user or tenant holds no
':' (the separator of Redis key names) or '/' (a trusted key's end users')."""

from __future__ import annotations

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.gateway.conftest import GatewayFactory, SimFactory, until
from tests.gateway.test_runtime_keys import ADMIN, admin, works


async def _rotate(http: aiohttp.ClientSession, url: str, key_id: str, grace_s: float) -> str:
    status, rotated = await admin(http, "POST", url + f"/admin/keys/{key_id}/rotate",
                                  json={"grace_s": grace_s})
    assert status == 200, rotated
    return str(rotated["key"])


async def test_each_rotation_ends_older_secrets_grace(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession,
        redis: aioredis.Redis) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], admin_keys=[ADMIN], key_pepper="test-pepper")
    status, created = await admin(http, "POST", gw.url + "/admin/keys", json={"user": "ivy"})
    assert status == 201, created
    first, key_id = created["key"], created["id"]
    second = await _rotate(http, gw.url, key_id, 3600)
    assert await works(gw, first) and await works(gw, second)
    third = await _rotate(http, gw.url, key_id, 60)  # grace 60 ends the first's 3600 too
    record = await redis.hgetall(f"fg:{{keys}}:id:{key_id}")
    graced = record["old_digest"].split()
    ttls = [await redis.pttl(f"fg:{{keys}}:hash:{d}") for d in graced]
    assert len(graced) == 2 and all(0 < t <= 60_000 for t in ttls), (graced, ttls)
    fourth = await _rotate(http, gw.url, key_id, 0)  # grace 0: every older secret ends

    async def only_fourth() -> bool:
        return [await works(gw, s) for s in (first, second, third, fourth)] == [
            False, False, False, True]

    await until(only_fourth, "only the newest secret works after a rotation with grace 0")
    fifth = await _rotate(http, gw.url, key_id, 3600)
    status, _ = await admin(http, "DELETE", gw.url + f"/admin/keys/{key_id}")
    assert status == 200
    left = [await works(gw, s) for s in (fourth, fifth)]
    assert left == [False, False], f"after revoking, secrets in grace still work: {left}"


async def test_the_pepper_is_the_stores_after_redis_restarts_empty(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession,
        redis: aioredis.Redis) -> None:
    backend = await sim(profile="instant")
    early = await gateway([backend], admin_keys=[ADMIN])  # no key_pepper
    status, created = await admin(http, "POST", early.url + "/admin/keys", json={"user": "a"})
    assert status == 201 and await works(early, created["key"])
    await redis.flushall()  # Redis restarted empty (no AOF)
    late = await gateway([backend], admin_keys=[ADMIN])  # a worker that starts after
    status, created = await admin(http, "POST", late.url + "/admin/keys", json={"user": "b"})
    assert status == 201, created
    secret = created["key"]
    assert await works(late, secret)
    await until(lambda: works(early, secret),
                "a key created on the later worker works on the earlier one")
    status, created = await admin(http, "POST", early.url + "/admin/keys", json={"user": "c"})
    assert status == 201
    await until(lambda: works(late, created["key"]),
                "a key created on the earlier worker works on the later one")


@pytest.mark.parametrize(("body", "field", "separator"), [
    ({"user": "b:c", "tenant": "a"}, "user", ":"),
    ({"user": "c", "tenant": "a:b"}, "tenant", ":"),
    ({"user": "a:b"}, "user", ":"),
    ({"user": "app/alice"}, "user", "/"),
    ({"user": "c", "tenant": "a\tb"}, "tenant", "\t"),  # stored entries' field separator
])
async def test_key_names_cannot_hold_a_key_separator(
        body: dict[str, str], field: str, separator: str, sim: SimFactory,
        gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    """("a", "b:c") and ("a:b", "c") would name one queue, ``q:<class>:a:b:c``."""
    backend = await sim(profile="instant")
    gw = await gateway([backend], admin_keys=[ADMIN])
    status, answer = await admin(http, "POST", gw.url + "/admin/keys", json=body)
    error = answer.get("error", {})
    assert status == 400 and error.get("param") == field, (status, answer)
    expected = ("must be printable" if separator == "\t"
                else f"must not contain {separator!r}")
    assert expected in error["message"], answer
    status, answer = await admin(http, "POST", gw.url + "/admin/keys",
                                 json={**body, field: "a.b"})
    assert status == 201, answer
