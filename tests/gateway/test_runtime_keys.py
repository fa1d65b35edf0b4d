"""API keys created, listed, rotated and revoked at runtime, on two gateway replicas
sharing one Redis, used through the real openai SDK."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from gateway.http.server import GatewayServer
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, call, until

ADMIN = "sk-admin"


async def works(gw: GatewayServer, key: str) -> bool:
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    try:
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                        extra_body={"ignore_eos": True})
        return True
    except openai.AuthenticationError:
        return False
    finally:
        await client.close()


async def admin(http: aiohttp.ClientSession, method: str, url: str,
                json: Any = None) -> tuple[int, dict[str, Any]]:
    status, body, _ = await call(http, method, url, key=ADMIN, json=json)
    return status, body


async def test_key_lifecycle_across_two_replicas(sim: SimFactory, gateway: GatewayFactory,
                                                 http: aiohttp.ClientSession,
                                                 redis: aioredis.Redis) -> None:
    backend = await sim(profile="instant")
    a = await gateway([backend], admin_keys=[ADMIN], key_pepper="test-pepper")
    b = await gateway([backend], admin_keys=[ADMIN], key_pepper="test-pepper")

    status, created = await admin(http, "POST", a.url + "/admin/keys", json={
        "user": "erin", "tenant": "research", "priority_class": "interactive",
        "weight": 2, "limits": {"rpm": 100, "daily_tokens": 100000}})
    assert status == 201, created
    secret, key_id = created["key"], created["id"]
    assert secret.startswith("sk-fg-") and created["prefix"] == secret[:10]
    assert created["tenant"] == "research" and created["limits"]["rpm"] == 100

    # the other replica accepts it (within its cache lifetime of a negative lookup)
    await until(lambda: works(b, secret), "the new key works on replica b")
    assert await works(a, secret)

    # Redis holds no secret in clear, only its keyed hash
    dump = [await redis.dump(k) for k in await redis.keys("*")]
    assert not any(d is not None and secret.encode() in d for d in dump)

    # listing: config keys and runtime keys, no secret, last use recorded
    status, listing = await admin(http, "GET", b.url + "/admin/keys")
    assert status == 200
    rows = {row["id"]: row for row in listing["data"]}
    assert "key" not in rows[key_id] and "digest" not in rows[key_id]
    assert rows[key_id]["user"] == "erin" and rows[key_id]["last_used"] is not None
    assert rows[key_id]["created"] > 0
    assert any(r["source"] == "config" and r["user"] == "alice" for r in listing["data"])
    assert secret not in str(listing)

    # a user's key may not manage keys
    status, body, _ = await call(http, "POST", a.url + "/admin/keys", key=secret,
                                 json={"user": "mallory"})
    assert status == 403, body
    status, body, _ = await call(http, "POST", a.url + "/admin/keys", key=ADMIN,
                                 json={"user": "x", "priority_class": "platinum"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"

    # rotate with a grace period: old and new secrets both work on both replicas
    status, rotated = await admin(http, "POST", a.url + f"/admin/keys/{key_id}/rotate",
                                  json={"grace_s": 600})
    assert status == 200, rotated
    new_secret = rotated["key"]
    assert new_secret != secret and rotated["id"] == key_id
    assert await works(b, secret)
    await until(lambda: works(b, new_secret), "the rotated secret works on replica b")

    # rotate without grace: the previous secret stops on the other replica too
    status, rotated = await admin(http, "POST", b.url + f"/admin/keys/{key_id}/rotate",
                                  json={"grace_s": 0})
    third = rotated["key"]

    async def refused(gw: GatewayServer, key: str) -> bool:
        return not await works(gw, key)

    await until(lambda: refused(a, new_secret), "the rotated-out secret refused on a")
    assert await works(a, third)

    # revocation on a: b refuses the key within its cache lifetime (key_cache_s ≤ 1 s)
    status, body = await admin(http, "DELETE", a.url + f"/admin/keys/{key_id}")
    assert status == 200 and body["deleted"] is True
    assert not await works(a, third)  # this replica at once
    await until(lambda: refused(b, third), "the revoked key refused on b")
    assert not await works(b, secret)  # the grace-period secret went with it
    status, body = await admin(http, "DELETE", a.url + f"/admin/keys/{key_id}")
    assert status == 404
    status, listing = await admin(http, "GET", a.url + "/admin/keys")
    assert key_id not in {row["id"] for row in listing["data"]}

    # config keys keep working and cannot be revoked at runtime
    assert await works(b, "sk-alice")
    cfg_id = next(r["id"] for r in listing["data"] if r["user"] == "alice")
    status, body = await admin(http, "DELETE", a.url + f"/admin/keys/{cfg_id}")
    assert status == 409 and body["error"]["code"] == "key_in_config"


async def test_key_cache_lifetime_is_bounded(sim: SimFactory,
                                             gateway: GatewayFactory) -> None:
    """What makes a revocation reach every replica within 1 s without a reload."""
    from pydantic import ValidationError

    from gateway.core.settings import load_settings

    with pytest.raises(ValidationError):
        load_settings(None, key_cache_s=2.0)
    backend = await sim(profile="instant")
    gw = await gateway([backend])
    runtime = gw.services.keys.runtime
    assert runtime is not None and runtime.settings.access.key_cache_s <= 1.0
