"""A config reload swaps the one settings holder, and every consumer reads the new values.

The walk below finds every object the services hold (recursively, through dicts, lists
and attributes): a collaborator that keeps its own ``Settings`` (or a class or tenant
table copied out of one) fails it, and the set of collaborators reading the holder is
enumerated, so a new consumer is added here on purpose.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.core.settings import ClassConfig, ReadsSettings, Settings, SettingsHolder, Tenant
from gateway.services import Services, request_ttl_s
from loadtest.sim.server import SimServer
from tests.gateway.conftest import KEYS, MODEL, GatewayFactory, SimFactory
from tests.ops.conftest import ADMIN, admin_call

# every collaborator that reads the settings while serving
CONSUMERS = {"AdapterLoads", "Admission", "BackendList", "BackendPool", "BatchRunner",
             "Dispatcher", "History", "Inspector", "Planner", "PoolWatch", "Preemptor",
             "Quotas", "ReplicaProtocol", "RuntimeKeys", "ScrapeLeases", "Scraper", "Snapshots",
             "StoreOutage", "Waits"}
SETTINGS_COPIES = (Settings, ClassConfig, Tenant)


def config(redis_url: str, backends: list[SimServer], **more: Any) -> dict[str, Any]:
    return {"redis_url": redis_url, "listen": {"host": "127.0.0.1", "port": 0},
            "backends": [{"name": f"b{i}", "url": s.url, "model": MODEL}
                         for i, s in enumerate(backends)],
            "api_keys": KEYS, "admin_keys": [ADMIN], "scrape_interval_s": 0.02,
            "replica_heartbeat_s": 0.2, **more}


def walk(root: object) -> tuple[list[str], list[ReadsSettings]]:
    """(paths of settings copies held outside the holder, the objects reading it)."""
    copies: list[str] = []
    readers: list[ReadsSettings] = []
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [("services", root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or isinstance(obj, SettingsHolder):
            continue
        seen.add(id(obj))
        if isinstance(obj, SETTINGS_COPIES):
            copies.append(f"{path}: {type(obj).__name__}")
            continue
        if isinstance(obj, ReadsSettings):
            readers.append(obj)
        if isinstance(obj, dict):
            stack += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif type(obj).__module__.split(".")[0] in ("gateway", "policies"):
            names = set(getattr(obj, "__dict__", {}))
            for cls in type(obj).__mro__:
                names.update(getattr(cls, "__slots__", ()))
            stack += [(f"{path}.{n}", getattr(obj, n)) for n in names if hasattr(obj, n)]
    return copies, readers


async def test_a_reload_reaches_every_consumer(sim: SimFactory, gateway: GatewayFactory,
                                               redis_url: str, tmp_path: Path) -> None:
    backend = await sim()
    path = tmp_path / "fairgate.yaml"
    path.write_text(yaml.safe_dump(config(redis_url, [backend])))
    gw = await gateway([backend], admin_keys=[ADMIN], config_file=path)
    svc: Services = gw.services
    old = svc.settings
    assert old.classes["interactive"].max_waiting == 3, old.classes["interactive"]

    path.write_text(yaml.safe_dump(config(
        redis_url, [backend], retry_after_s=4, starvation_after_s=5.0, key_cache_s=0.25,
        quota_lease_s=9.0, batch_poll_s=0.5, max_queued_per_user=7,
        classes={"interactive": {"max_waiting": 2, "max_queue_wait_s": 0.5,
                                 "max_waiting_prefill_tokens": 1234}})))
    async with aiohttp.ClientSession() as http:
        status, got = await admin_call(http, "POST", gw.url + "/admin/reload")
        assert status == 200, got
        assert got["restart_required"] == [], got
        assert {"classes", "retry_after_s", "starvation_after_s"} <= set(got["reloaded"]), got
        new = svc.settings
        assert new is not old and new.classes["interactive"].max_waiting == 2, new.classes

        # one holder, no copies: every consumer reads the new settings through it
        copies, readers = walk(svc)
        assert copies == [], f"settings copied outside the holder: {copies}"
        names = {type(r).__name__ for r in readers}
        assert names == CONSUMERS, f"consumers found {sorted(names)}"
        stale = [type(r).__name__ for r in readers if r.settings is not new]
        assert stale == [], f"reading old settings: {stale}"

        # what the consumers derived from the settings is re-derived
        handle = svc.pool.handles["b0"]
        assert svc.pool.gate_policies["interactive"].max_waiting == 2, svc.pool.gate_policies
        targets = svc.pool.pacing_targets
        assert targets is not None and targets["interactive"].ceiling == 2, targets
        assert handle.pacing["interactive"].allowance <= 2, handle.pacing["interactive"]
        assert handle.fit.prefill_limits["interactive"] == 1234, handle.fit
        assert svc.dispatcher.planner.floors.after_s == 5.0, svc.dispatcher.planner.floors
        assert svc.store.queue.request_ttl_s == request_ttl_s(new), svc.store.queue.request_ttl_s
        assert svc.admission.waits.retry_after(None) == 4
        assert svc.quotas.lease_s == 9.0 and svc.keys.runtime is not None
        assert svc.keys.runtime.settings.key_cache_s == 0.25
        status, backends = await admin_call(http, "GET", gw.url + "/admin/backends")
        shown = backends["data"][0]["prefill"]["limits"]["interactive"]
        assert shown == 1234, backends["data"][0]

        # end to end: the class's new queue limit times a request out, with the new floor
        assert (await admin_call(http, "POST", gw.url + "/admin/backends/b0/drain"))[0] == 200
        began = time.monotonic()
        async with http.post(gw.url + "/v1/completions",
                             json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                             headers={"Authorization": "Bearer sk-alice"}) as resp:
            took = time.monotonic() - began
            body = await resp.json()
            assert resp.status == 504, body
            assert int(resp.headers["Retry-After"]) >= 4, dict(resp.headers)
        assert took < 5, f"timed out after {took:.1f}s, not the reloaded 0.5 s"


async def test_cost_factors_reload_and_the_fairness_scope_needs_a_restart(
        sim: SimFactory, gateway: GatewayFactory, redis_url: str, tmp_path: Path) -> None:
    """The scope is wired into the store at start (which models' counters are one); the
    cost factors are read per request, so a reload applies them."""
    backend = await sim()
    path = tmp_path / "fairgate.yaml"
    fleet = {"fairness_scope": "fleet", "cost_factors": {MODEL: 2.0}}
    path.write_text(yaml.safe_dump(config(redis_url, [backend], **fleet)))
    gw = await gateway([backend], admin_keys=[ADMIN], config_file=path, **fleet)
    svc: Services = gw.services
    assert svc.store.queue.fleet == (MODEL,) and svc.settings.cost_factor(MODEL) == 2.0
    path.write_text(yaml.safe_dump(config(redis_url, [backend], fairness_scope="model",
                                          cost_factors={MODEL: 3.0})))
    async with aiohttp.ClientSession() as http:
        status, got = await admin_call(http, "POST", gw.url + "/admin/reload")
    assert status == 200, got
    assert got["restart_required"] == ["fairness_scope"], got
    assert "cost_factors" in got["reloaded"], got
    assert svc.settings.fairness_scope == "fleet", svc.settings.fairness_scope
    assert svc.settings.cost_factor(MODEL) == 3.0 and svc.store.queue.fleet == (MODEL,)
