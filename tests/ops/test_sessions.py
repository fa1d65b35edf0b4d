"""Dashboard sessions are server-side: random tokens that expire, that logout ends on
every replica, and that end when their admin key is removed by a reload. Keys are held
only as keyed hashes."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import yaml
from structlog.testing import capture_logs

from gateway.access.auth import SESSION_COOKIE, KeyRing
from gateway.core.settings import ApiKey
from gateway.storage.keys import SESSION_PREFIX
from tests.gateway.conftest import KEYS, MODEL, GatewayFactory, SimFactory, assert_error

ADMIN, OTHER_ADMIN = "sk-admin", "sk-admin-2"


async def login(http: aiohttp.ClientSession, url: str, key: str) -> str:
    async with http.post(url + "/dashboard/login", data={"key": key},
                         allow_redirects=False) as resp:
        assert resp.status == 303
        return resp.cookies[SESSION_COOKIE].value


async def state_status(http: aiohttp.ClientSession, url: str, token: str) -> int:
    async with http.get(url + "/admin/state", cookies={SESSION_COOKIE: token}) as resp:
        return resp.status


async def test_sessions_expire_end_at_logout_and_at_key_removal(
        sim: SimFactory, gateway: GatewayFactory, redis_url: str, tmp_path: Path,
        redis: object) -> None:
    backend = await sim(profile="instant")
    path = tmp_path / "fairgate.yaml"

    def write(admins: list[str]) -> None:
        path.write_text(yaml.safe_dump({
            "redis_url": redis_url,
            "backends": [{"name": "b0", "url": backend.url, "model": MODEL}],
            "api_keys": KEYS, "admin_keys": admins}))

    write([ADMIN, OTHER_ADMIN])
    gw = await gateway([backend], admin_keys=[ADMIN, OTHER_ADMIN], config_file=path,
                       session_ttl_s=600)
    client = gw.services.store.client
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        first, second = await login(http, gw.url, ADMIN), await login(http, gw.url, ADMIN)
        assert first != second  # random per login, not derived from the key
        assert ADMIN not in first
        assert await state_status(http, gw.url, first) == 200
        stored = [k async for k in client.scan_iter(SESSION_PREFIX + "*")]
        assert len(stored) == 2 and not any(first in k for k in stored)  # hashed in Redis
        assert all(0 < ttl <= 600 for ttl in [await client.ttl(k) for k in stored])  # expires

        async with http.post(gw.url + "/dashboard/logout",
                             cookies={SESSION_COOKIE: first}, allow_redirects=False) as r:
            assert r.status == 303
        assert await state_status(http, gw.url, first) == 401  # the old cookie is dead
        assert await state_status(http, gw.url, second) == 200

        other = await login(http, gw.url, OTHER_ADMIN)
        write([ADMIN])  # OTHER_ADMIN is revoked
        async with http.post(gw.url + "/admin/reload",
                             headers={"Authorization": f"Bearer {ADMIN}"}) as resp:
            assert resp.status == 200
        assert await state_status(http, gw.url, other) == 401
        assert await state_status(http, gw.url, second) == 200
        assert await state_status(http, gw.url, "forged-token") == 401


async def test_keys_are_held_only_as_keyed_hashes() -> None:
    ring = KeyRing([ApiKey(key="sk-secret-1", user="u")], ["sk-admin-secret"])
    lookup_keys = [*ring._keys, *ring._admin]  # what lookups compare
    assert all(isinstance(k, bytes) and len(k) == 32 for k in lookup_keys)
    assert not any(b"secret" in k for k in lookup_keys)
    assert (await ring.identify("Bearer sk-secret-1")).user == "u"
    assert ring.is_admin("Bearer sk-admin-secret") and not ring.is_admin("Bearer sk-secret-1")
    # another process draws another secret: the hashes are useless elsewhere
    assert set(KeyRing([ApiKey(key="sk-secret-1", user="u")])._keys) != set(ring._keys)


async def test_metrics_can_require_an_admin_key(sim: SimFactory,
                                                gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], admin_keys=[ADMIN], metrics_auth=True)
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as resp:
            assert resp.status == 401 and (await resp.json())["error"]["code"]
        async with http.get(gw.url + "/metrics",
                            headers={"Authorization": "Bearer sk-alice"}) as resp:
            assert resp.status == 403
        async with http.get(gw.url + "/metrics",
                            headers={"Authorization": f"Bearer {ADMIN}"}) as resp:
            assert resp.status == 200 and "fairgate_requests_total" in await resp.text()


MALFORMED_LOGINS = {  # (content type, body): forms that do not parse
    "urlencoded, not UTF-8": ("application/x-www-form-urlencoded", b"key=\xff\xfe"),
    "unknown charset": ("application/x-www-form-urlencoded; charset=nonsense", b"key=a"),
    "multipart without a boundary": ("multipart/form-data", b"--x\r\nkey\r\n--x--\r\n"),
    "multipart, boundary absent": ("multipart/form-data; boundary=B", b"garbage"),
    "multipart part not UTF-8": (
        "multipart/form-data; boundary=B",
        b'--B\r\nContent-Disposition: form-data; name="key"\r\n'
        b"Content-Type: text/plain; charset=utf-8\r\n\r\n\xff\r\n--B--\r\n"),
}


async def test_a_malformed_login_form_is_a_400_without_a_traceback(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], admin_keys=[ADMIN])
    async with aiohttp.ClientSession() as http:
        with capture_logs() as logs:
            for name, (content_type, body) in MALFORMED_LOGINS.items():
                async with http.post(gw.url + "/dashboard/login", data=body,
                                     headers={"Content-Type": content_type}) as resp:
                    answer = await resp.json(content_type=None)
                    assert resp.status == 400, (name, resp.status, answer)
                message = assert_error(answer, type_="invalid_request_error")
                assert message.startswith("malformed login form"), (name, message)
        crashed = [e for e in logs if e["log_level"] == "error"]
        assert crashed == [], crashed
        assert await login(http, gw.url, ADMIN)  # the form still works


async def test_failed_logins_from_one_address_are_throttled(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], admin_keys=[ADMIN], login_max_failures=5,
                       login_failure_window_s=30)
    async with aiohttp.ClientSession() as http:
        statuses = []
        for i in range(8):
            async with http.post(gw.url + "/dashboard/login", data={"key": f"sk-guess-{i}"},
                                 allow_redirects=False) as resp:
                statuses.append(resp.status)
                retry_after = resp.headers.get("Retry-After")
                body = await resp.read()
        assert statuses == [401] * 5 + [429] * 3, statuses
        assert retry_after is not None and 1 <= int(retry_after) <= 30, retry_after
        error = assert_error(json.loads(body), type_="rate_limit_error",
                             code="too_many_login_failures")
        assert "too many failed logins" in error, error
        # the right key waits too while the window lasts: guessing costs the wait
        async with http.post(gw.url + "/dashboard/login", data={"key": ADMIN},
                             allow_redirects=False) as resp:
            assert resp.status == 429, resp.status
