"""A reload of a config that would leave the gateway without backends or keys, or that
does not parse, is refused with a 400 naming the problem, and the config in force stays
(issue 29, item 6): the admin can still reload, users are still served. The SIGHUP path
(``gateway/runtime/serve.py``) runs the same ``reload_settings``: checked directly, and
through ``fairgate serve --workers 2`` (POST through one worker, SIGHUP to the supervisor:
every worker keeps the old config)."""

from __future__ import annotations

import signal
from pathlib import Path

import aiohttp
import pytest
import yaml

from gateway.core.errors import BadRequest
from gateway.http.admin.reload import reload_settings
from tests.gateway.conftest import KEYS, MODEL, GatewayFactory, SimFactory, complete
from tests.gateway.test_workers import answered_by, serve
from tests.ops.conftest import ADMIN, admin_call
from tests.ops.test_reload import config

BAD = {
    "empty": (b"", "is empty"),
    "comments only": (b"# nothing here\n# at all\n", "is empty"),
    "a list": (b"- backends\n- api_keys\n", "must hold a mapping of settings, not a list"),
    "a string": (b"just a string\n", "must hold a mapping of settings, not a str"),
    "invalid UTF-8": (b"api_keys: []\nname: \xff\xfe\n", "is not UTF-8 text"),
    "not YAML": (b"backends: [\n", "is invalid"),
    "a huge integer": (b"max_body_bytes: " + b"9" * 5000 + b"\n", "is invalid"),
    # the parser's recursion limit: a RecursionError, answered 500 before
    "nested too deeply": (b"a: " + b"[" * 20_000 + b"]" * 20_000 + b"\n",
                          "is nested too deeply to parse"),
    # pydantic-settings lowercases each name: an AttributeError, answered 500 before
    "a number as a setting name": (b"1: 2\n", "names a setting 1 (int)"),
    "a null setting name": (b"~: 1\n", "names a setting None (NoneType)"),
    # a YAML "billion laughs": 9^8 values once expanded (seconds of validation before)
    "an alias bomb": (b"tenants:\n  - &a [x,x,x,x,x,x,x,x,x]\n" + b"".join(
        b"  - &%c [%s]\n" % (q, b",".join([b"*%c" % p] * 9))
        for p, q in zip(b"abcdefg", b"bcdefgh", strict=True)),
        "values (YAML aliases), more than 1,000,000"),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_a_config_that_would_break_the_gateway_is_refused(
        case: str, tmp_path: Path, sim: SimFactory, gateway: GatewayFactory,
        redis_url: str) -> None:
    backend = await sim(profile="instant")
    path = tmp_path / "fairgate.yaml"
    path.write_text(yaml.safe_dump(config(redis_url, [backend])))
    gw = await gateway([backend], admin_keys=[ADMIN], config_file=path)
    text, problem = BAD[case]
    path.write_bytes(text)
    async with aiohttp.ClientSession() as http:
        status, answer = await admin_call(http, "POST", gw.url + "/admin/reload")
        assert status == 400, (case, status, answer)
        assert problem in answer["error"]["message"], (case, answer)
        with pytest.raises(BadRequest):  # SIGHUP's path: the same refusal
            reload_settings(gw.services)
        # the old config stays: users served, the admin still reloads (a good file)
        await complete(http, gw.url, "sk-alice", 2)
        path.write_text(yaml.safe_dump(config(redis_url, [backend])))
        status, answer = await admin_call(http, "POST", gw.url + "/admin/reload")
        assert status == 200, (case, answer)


@pytest.mark.parametrize(("change", "problem"), [
    ({"backends": []}, "names no backends"),
    ({"api_keys": [], "admin_keys": []}, "names no API keys and no admin keys"),
    # the admin keys gone: the reload locked the operators out of /admin
    ({"admin_keys": []}, "names no admin keys"),
    # issue 29, item 9: ("a", "b:c") and ("a:b", "c") would share one queue
    ({"api_keys": [{"key": "sk-x", "user": "b:c", "tenant": "a"}]},
     "api_keys.0.user: 'b:c' must not contain ':'"),
    ({"api_keys": [{"key": "sk-x", "user": "c", "tenant": "a:b"}]},
     "api_keys.0.tenant: 'a:b' must not contain ':'"),
    ({"tenants": {"a:b": {"weight": 2}}}, "tenants.a:b: 'a:b' must not contain ':'"),
    ({"api_keys": [{"key": "sk-x", "user": "app/alice"}]},
     "api_keys.0.user: 'app/alice' must not contain '/'"),
    # a valid file but for an admin key no digest can be made of: the settings were
    # swapped, then the key ring failed (a 500 and half a reload before)
    ({"admin_keys": [ADMIN, "\udc80"]},
     "holds a string that is not text (a lone surrogate escape) at admin_keys.1"),
    ({"backends": [{"name": "b0", "url": "http://127.0.0.1:9", "model": "m\ud800"}]},
     "(a lone surrogate escape) at backends.0.model"),
    # issue 43: an unknown key anywhere, named with its place (it was dropped unsaid)
    ({"backends": [{"name": "b0", "url": "http://127.0.0.1:9", "model": MODEL,
                    "max_promt_tokens": 10}]},
     "backends.0.max_promt_tokens: unknown key (did you mean max_prompt_tokens?)"),
    ({"api_keys": [{**KEYS[0], "role": "admin"}]}, "api_keys.0.role: unknown key"),
    # settings under which every request of a class, or every client, would fail
    ({"classes": {"batch": {"max_waiting": -5}}},
     "classes.batch.max_waiting: Input should be greater than or equal to 0"),
    ({"classes": {"default": {"max_queue_wait_s": -1}}},
     "classes.default.max_queue_wait_s: Input should be greater than 0"),
    ({"backends": [{"name": "b0", "url": "ftp://127.0.0.1:9", "model": MODEL}]},
     "backends.0.url: must be an http:// or https:// URL with a host"),
    ({"backends": [{"name": "b0", "url": "http://127.0.0.1:9\r\n", "model": MODEL}]},
     "backends.0.url: must not hold a space or a control character"),
    ({"backends": [{"name": "b0", "url": "http://127.0.0.1:9", "model": MODEL},
                   {"name": "b0", "url": "http://127.0.0.1:10", "model": MODEL}]},
     "backends.1.name: 'b0' is also the name of backends.0"),
    ({"api_keys": [*KEYS, {**KEYS[0], "user": "mallory"}]},
     f"api_keys.{len(KEYS)}.key: the same secret as api_keys.0"),
    ({"api_keys": []}, f"names no API keys where {len(KEYS)} are in force"),
])
async def test_a_config_without_backends_or_keys_is_refused(
        change: dict[str, list[object]], problem: str, tmp_path: Path, sim: SimFactory,
        gateway: GatewayFactory, redis_url: str) -> None:
    backend = await sim(profile="instant")
    path = tmp_path / "fairgate.yaml"
    path.write_text(yaml.safe_dump(config(redis_url, [backend])))
    gw = await gateway([backend], admin_keys=[ADMIN], config_file=path)
    path.write_text(yaml.safe_dump({**config(redis_url, [backend]), **change}))
    before = gw.services.settings
    async with aiohttp.ClientSession() as http:
        status, answer = await admin_call(http, "POST", gw.url + "/admin/reload")
        assert status == 400 and problem in answer["error"]["message"], (status, answer)
        with pytest.raises(BadRequest) as refused:  # SIGHUP's path: the same refusal
            reload_settings(gw.services)
        assert refused.value.message == answer["error"]["message"], refused.value.message
        assert gw.services.settings is before, "a refused reload changed the settings"
        await complete(http, gw.url, "sk-alice", 2)


async def test_a_broken_config_leaves_every_worker_on_the_old_one(
        sim: SimFactory, redis_url: str, tmp_path: Path) -> None:
    """``fairgate serve --workers 2``: a broken file is refused by the worker that gets the
    POST (and not passed on), and by each worker on SIGHUP to the supervisor; both keep
    serving the old keys, and the admin key still reloads once the file is fixed."""
    backend = await sim(profile="instant")
    async with serve(backend.url, redis_url, tmp_path, 2, admin_keys=[ADMIN]) as gw:
        path = tmp_path / "fairgate.yaml"
        good = path.read_text()
        async with aiohttp.ClientSession() as http:
            for text in (b"", b"# all gone\n", b"- backends\n", b"api_keys: \xff\n"):
                path.write_bytes(text)
                mark = len(gw.events)
                status, answer = await admin_call(http, "POST", gw.url + "/admin/reload")
                assert status == 400, (text, status, answer)
                gw.proc.send_signal(signal.SIGHUP)
                for worker in (0, 1):
                    failed = await gw.event("config_reload_failed", mark, worker=worker)
                    assert "nothing reloaded" in failed["error"], failed
                assert not any(e["event"] == "config_reloaded" for e in gw.events[mark:]), (
                    text, gw.events[mark:])
            served = await answered_by(gw.url, "sk-alice", 20)
            assert set(served) == {"0", "1"}, f"workers serving the old keys: {served}"
            path.write_text(good)
            status, answer = await admin_call(http, "POST", gw.url + "/admin/reload")
            assert status == 200, answer
