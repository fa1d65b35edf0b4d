"""A config reload swaps the one settings holder, and every consumer reads the new values.

The walk below finds every object the services hold (recursively, through dicts, lists
and attributes): a collaborator that keeps its own ``Settings`` (or a class or tenant
table copied out of one) fails it, and the set of collaborators reading the holder is
enumerated, so a new consumer is added here on purpose.
"""

from __future__ import annotations

import time
import types
import typing
from collections import deque
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.core.config_file import read_config_file
from gateway.core.settings import (
    GROUPS,
    ClassConfig,
    Group,
    ReadsSettings,
    Settings,
    SettingsHolder,
    Tenant,
    leaves,
    value_at,
)
from gateway.reload import reloadable
from gateway.services import Services, request_ttl_s
from loadtest.sim.server import SimServer
from tests.gateway.conftest import KEYS, MODEL, GatewayFactory, SimFactory
from tests.ops.conftest import ADMIN, admin_call

# every collaborator that reads the settings while serving
CONSUMERS = {"AdapterLoads", "AdapterNotes", "Admission", "BackendList", "BackendPool",
             "BatchRunner", "Charging", "Continuations", "Dispatcher", "History", "Inspector",
             "Placement", "Planner", "PoolWatch", "Preemptor", "Quotas", "ReplicaProtocol",
             "RuntimeKeys", "ScrapeLeases", "Scraper", "Snapshots", "StoreOutage", "Waits"}
SETTINGS_COPIES = (Settings, Group, ClassConfig, Tenant)


def config(redis_url: str, backends: list[SimServer], **more: Any) -> dict[str, Any]:
    return {"redis_url": redis_url, "listen": {"host": "127.0.0.1", "port": 0},
            "backends": [{"name": f"b{i}", "url": s.url, "model": MODEL}
                         for i, s in enumerate(backends)],
            "api_keys": KEYS, "admin_keys": [ADMIN], "scrape_interval_s": 0.02,
            "replica_heartbeat_s": 0.2, **more}


def walk(root: object) -> tuple[list[str], list[ReadsSettings], list[tuple[str, float]]]:
    """(paths of settings copies held outside the holder, the objects reading it, every
    number the services hold with where it is)."""
    copies: list[str] = []
    readers: list[ReadsSettings] = []
    numbers: list[tuple[str, float]] = []
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [("services", root)]
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, int | float) and not isinstance(obj, bool):
            numbers.append((path, obj))
            continue
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
    return copies, readers, numbers


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
        assert {"classes", "limits.retry_after_s",
                "fairness.starvation_after_s"} <= set(got["reloaded"]), got
        new = svc.settings
        assert new is not old and new.classes["interactive"].max_waiting == 2, new.classes

        # one holder, no copies: every consumer reads the new settings through it
        copies, readers, _ = walk(svc)
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
        assert svc.keys.runtime.settings.access.key_cache_s == 0.25
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
    assert got["restart_required"] == ["fairness.fairness_scope"], got
    assert "fairness.cost_factors" in got["reloaded"], got
    assert svc.settings.fairness.fairness_scope == "fleet", svc.settings.fairness.fairness_scope
    assert svc.settings.cost_factor(MODEL) == 3.0 and svc.store.queue.fleet == (MODEL,)


# the two values of the reloadable settings no rule below makes (a setting of a new kind
# fails the test until it is given its two values here)
MADE: dict[str, tuple[Any, Any]] = {
    "classes": ({"interactive": {"max_waiting": 4, "max_queue_wait_s": 31.7}},
                {"interactive": {"max_waiting": 2, "max_queue_wait_s": 29.3}}),
    "autoscale": ({"interval_s": 2.17, "headroom": 0.213}, {"interval_s": 3.31, "headroom": 0.3}),
    "adapters": ([{"name": "sql-a", "base_model": MODEL}],
                 [{"name": "sql-b", "base_model": MODEL}]),
    "fairness.cost_factors": ({MODEL: 1.5}, {MODEL: 2.5}),
    "fairness.class_floors": ({"batch": 0.0713}, {"batch": 0.0917}),
    "operations.grafana_url": ("http://grafana.test/a", "http://grafana.test/b"),
}


def _kind(annotation: Any) -> Any:
    present = [a for a in typing.get_args(annotation) if a is not type(None)]
    return present[0] if typing.get_origin(annotation) in (types.UnionType, typing.Union) \
        and len(present) == 1 else annotation


def _two_values(path: str, i: int) -> tuple[Any, Any]:
    """Two valid values of the setting at ``path``, unlike each other and its default:
    numbers a little off the default and unlike any other setting's (so a copy of one
    is found by its value), the other choice of a bool or a Literal."""
    if path in MADE:
        return MADE[path]
    info = leaves()[path]
    kind, default = _kind(info.annotation), info.get_default(call_default_factory=True)
    if kind is bool:
        return (not default, default)
    if typing.get_origin(kind) is typing.Literal:
        return (next(c for c in typing.get_args(kind) if c != default), default)
    group, leaf = path.split(".")
    base = default or 1
    for start, new in ((base * (1.0137 + i / 1409), base * (1.0291 + i / 1409)),
                       (base + 1, base + 2)):
        values = (int(start), int(new)) if kind is int else (round(start, 7), round(new, 7))
        if values[0] == values[1]:
            values = (values[0], values[0] + 1)
        try:
            for value in values:
                GROUPS[group](**{leaf: value})
        except ValueError:
            continue
        return values
    raise AssertionError(f"no two values for {path} ({kind}): add them to MADE")


def _tree(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in values.items():
        group, _, leaf = path.partition(".")
        if leaf:
            out.setdefault(group, {})[leaf] = value
        else:
            out[path] = value
    return out


def _distinct(number: object) -> bool:
    """A number no other part of the gateway would hold by chance."""
    return (isinstance(number, float) and not number.is_integer()) or (
        isinstance(number, int) and not isinstance(number, bool) and number >= 100)


async def test_every_reloadable_setting_reaches_its_readers(
        sim: SimFactory, gateway: GatewayFactory, redis_url: str, tmp_path: Path) -> None:
    """Every setting not declared ``restart`` (enumerated from the model: a new one is
    covered without a word here) is started at one value and reloaded to another: the
    settings every reader uses hold the new value, and no number the services copied
    out of the settings at construction (a scalar in any object, a histogram window's
    span, …) still holds the old one."""
    paths = reloadable()
    assert {"upstream.stream_idle_timeout_s", "pacing.tpot_window_s", "classes"} <= set(paths)
    values = {p: _two_values(p, i) for i, p in enumerate(paths)}
    start = {p: v[0] for p, v in values.items()}
    reload = {p: v[1] for p, v in values.items()}
    backend = await sim()
    path = tmp_path / "fairgate.yaml"
    path.write_text(yaml.safe_dump(config(redis_url, [backend], **_tree(reload))))
    want = read_config_file(path)
    gw = await gateway([backend], admin_keys=[ADMIN], config_file=path, **_tree(start))
    svc: Services = gw.services
    old = svc.settings
    same = [p for p in paths if value_at(old, p) == value_at(want, p)]
    assert same == [], f"not changed by the reload, so not tested: {same}"

    old_numbers = {value_at(old, p): p for p in paths if _distinct(value_at(old, p))}
    _, _, held = walk(svc)
    copied = {old_numbers[v]: where for where, v in held if v in old_numbers}
    # the walk finds numbers derived at construction (it would find a stale one)
    assert {"fairness.starvation_after_s", "pacing.tpot_window_s"} <= set(copied), copied

    async with aiohttp.ClientSession() as http:
        status, got = await admin_call(http, "POST", gw.url + "/admin/reload")
    assert status == 200 and got["restart_required"] == [], got
    missing = sorted(set(paths) - set(got["reloaded"]))
    assert missing == [], f"reported as not reloaded: {missing}"
    new = svc.settings
    stale = {p: value_at(new, p) for p in paths if value_at(new, p) != value_at(want, p)}
    assert stale == {}, f"the settings in force kept old values: {stale}"
    _, readers, held = walk(svc)
    behind = [type(r).__name__ for r in readers if r.settings is not new]
    assert behind == [], f"reading old settings: {behind}"
    kept = {old_numbers[v]: where for where, v in held if v in old_numbers}
    assert kept == {}, f"copies of old values still held: {kept}"
    assert svc.upstream.stream_idle_s == value_at(want, "upstream.stream_idle_timeout_s")
    windows = {w.window_s for h in svc.pool.handles.values()
               for w in (h.windows.tpot, h.windows.ttft)}
    assert windows == {value_at(want, "pacing.tpot_window_s")}, windows
