"""A reload of a config that would leave the gateway without backends or keys, or that
does not parse, is refused with a 400 naming the problem, and the config in force stays
(issue 29, item 6): the admin can still reload, users are still served. The SIGHUP path
(``gateway/runtime/serve.py``) runs the same ``reload_settings``: checked directly."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
import yaml

from gateway.core.errors import BadRequest
from gateway.http.admin.reload import reload_settings
from tests.gateway.conftest import GatewayFactory, SimFactory, complete
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
    # issue 29, item 9: ("a", "b:c") and ("a:b", "c") would share one queue
    ({"api_keys": [{"key": "sk-x", "user": "b:c", "tenant": "a"}]},
     "api_keys.0.user: 'b:c' must not contain ':'"),
    ({"api_keys": [{"key": "sk-x", "user": "c", "tenant": "a:b"}]},
     "api_keys.0.tenant: 'a:b' must not contain ':'"),
    ({"tenants": {"a:b": {"weight": 2}}}, "tenants.a:b: 'a:b' must not contain ':'"),
    ({"api_keys": [{"key": "sk-x", "user": "app/alice"}]},
     "api_keys.0.user: 'app/alice' must not contain '/'"),
])
async def test_a_config_without_backends_or_keys_is_refused(
        change: dict[str, list[object]], problem: str, tmp_path: Path, sim: SimFactory,
        gateway: GatewayFactory, redis_url: str) -> None:
    backend = await sim(profile="instant")
    path = tmp_path / "fairgate.yaml"
    path.write_text(yaml.safe_dump(config(redis_url, [backend])))
    gw = await gateway([backend], admin_keys=[ADMIN], config_file=path)
    path.write_text(yaml.safe_dump({**config(redis_url, [backend]), **change}))
    async with aiohttp.ClientSession() as http:
        status, answer = await admin_call(http, "POST", gw.url + "/admin/reload")
        assert status == 400 and problem in answer["error"]["message"], (status, answer)
        await complete(http, gw.url, "sk-alice", 2)
