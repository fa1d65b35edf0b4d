"""Config reload, a runtime service: re-read the config file and swap the settings holder
once.

``POST /admin/reload`` (``gateway/http/admin/routes.py``, admin key) and SIGHUP
(``gateway/runtime/serve.py``) both call :func:`reload_settings`. Every setting read while
serving takes effect: the classes (gates, pacing, waits, queue limits, prefill limits),
starvation floors, locality, scrape and batch timing, ``limits.retry_after_s``, … — the
holder (``gateway/core/settings``' ``SettingsHolder``) is swapped and the collaborators
that derive state from it re-derive it. Keys and admin keys are re-read, and the backends
of the models already served are added, removed or re-pointed (queues and connections
stay; the backends added at runtime stay too, merged with the file's by
``gateway/backends/registry.py``), and DNS discovery names take effect at its next turn.
A setting declared ``restart`` (``gateway/core/settings/groups.py``: the store, the listen
socket, the fairness policy, tenants, the upstream client's timeouts, …) and a new model
keep their old values and are reported under ``restart_required``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from gateway.access.auth import KeyRing
from gateway.core.config_file import ConfigFileInvalid, read_config_file
from gateway.core.errors import BadRequest, NoConfigFile
from gateway.core.settings import Settings, leaves, restart_fields, value_at, with_values
from gateway.services import Services

log = structlog.get_logger("fairgate.admin")

ALWAYS_RELOADED = ("api_keys", "admin_keys")
# the configured backends and discovery names: re-applied by a reload that keeps the
# models served (gateway/backends/registry.py merges them with the runtime backends)
BACKEND_FIELDS = ("backends", "discovery")


def _changed(old: Settings, new: Settings, paths: Iterable[str]) -> list[str]:
    return [p for p in paths if value_at(old, p) != value_at(new, p)]


def reloadable() -> list[str]:
    """The settings a reload applies as they change (by path: ``fleet.scrape_interval_s``)."""
    restart = restart_fields()
    return [p for p in leaves() if p not in restart and p not in ALWAYS_RELOADED
            and p not in BACKEND_FIELDS and p != "config_file"]


def _read_config(path: Path, current: Settings) -> Settings:
    """The whole new config, validated (``gateway/core/config_file.py``); ``BadRequest``
    naming the problem otherwise, also when it names no backends or no keys at all, or no
    API key or no admin key where ``current`` has some (a reload must never lock the
    users or the operators out)."""
    def refuse(problem: str) -> BadRequest:
        return BadRequest(f"config file {str(path)!r} {problem}; nothing reloaded, the "
                          "current config stays")

    try:
        new = read_config_file(path)
    except ConfigFileInvalid as exc:
        raise refuse(str(exc)) from None
    if not new.backends and not new.discovery:
        raise refuse("names no backends and no discovery")
    if not new.api_keys and not new.admin_keys:
        raise refuse("names no API keys and no admin keys")
    if current.api_keys and not new.api_keys:
        raise refuse(f"names no API keys where {len(current.api_keys)} are in force: every "
                     "client of the config's keys would get a 401")
    if current.admin_keys and not new.admin_keys:
        raise refuse("names no admin keys: no operator could reload, drain or cancel again "
                     "(a restart turns the admin API off)")
    return new


def reload_settings(svc: Services) -> dict[str, Any]:
    """Re-read the config file and swap ``svc.config`` once; what changed and what needs a
    restart. Raises ``NoConfigFile``/``BadRequest`` and changes nothing when there is no
    file or it is invalid. Also run on SIGHUP (``gateway/runtime/serve.py``)."""
    current = svc.settings
    if current.config_file is None:
        raise NoConfigFile("the gateway was started without a config file: nothing to reload")
    new = _read_config(current.config_file, current)
    restart = _changed(current, new, restart_fields())
    listed = _changed(current, new, BACKEND_FIELDS)
    if new.models() == current.models():  # same models: the pool re-pointed in place
        reloaded_backends = listed
    else:  # a model added or gone: the backend list as it was until a restart
        reloaded_backends, restart = [], [*restart, *listed]
    reloaded = [*ALWAYS_RELOADED, *reloaded_backends, *_changed(current, new, reloadable())]
    keys = KeyRing(new.api_keys, new.admin_keys, svc.keys.runtime)  # before any change
    svc.config.swap(with_values(new, {p: value_at(current, p) for p in restart}))
    # configured and runtime backends merged again (queues and connections stay)
    backends = svc.backends.apply() if "backends" in reloaded_backends else {}
    svc.keys = keys
    log.info("config_reloaded", api_keys=len(new.api_keys), admin_keys=len(new.admin_keys),
             backends=backends, reloaded=reloaded, restart_required=restart)
    return {"reloaded": reloaded, "api_keys": len(new.api_keys), "backends": backends,
            "restart_required": restart}
