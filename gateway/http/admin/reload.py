"""Config reload: re-read the config file and swap the settings holder once.

``POST /admin/reload`` (admin key) and SIGHUP (``gateway/core/worker_signals.py``) both land
here. Every setting read while serving takes effect: the classes (gates, pacing, waits,
queue limits, prefill limits), starvation floors, locality, scrape and batch timing,
``retry_after_s``, … — the holder (``gateway/settings.SettingsHolder``) is swapped and the
collaborators that derive state from it re-derive it. Keys and admin keys are re-read,
and the backends of the models already served are added, removed or re-pointed (queues
and connections stay; the backends added at runtime stay too, merged with the file's by
``gateway/backends/registry.py``), and DNS discovery names take effect at its next turn.
What is wired at start (Redis, the listen socket, the fairness policy, tenants, a new
model, timeouts of open connections, …) keeps its old value and is reported under
``restart_required``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from gateway.access.auth import KeyRing
from gateway.core.config_file import ConfigFileInvalid, read_config_file
from gateway.core.errors import BadRequest, NoConfigFile
from gateway.core.settings import Settings
from gateway.core.worker_signals import reload_siblings
from gateway.http.admin.access import admin_services
from gateway.services import Services

log = structlog.get_logger("fairgate.admin")

# settings wired into something built once at start: a change needs a restart
RESTART_FIELDS = ("fairness", "fairness_scope", "redis_url", "redis_sentinel", "redis_cluster",
                  "listen", "replica_id",
                  "vtc_input_weight", "vtc_output_weight", "priority_class_gap", "tenants",
                  "key_pepper", "workers", "data_dir", "max_file_bytes",
                  "usage_retention_days", "session_ttl_s", "upstream_timeout_s",
                  "max_request_s", "upstream_keepalive_s", "metrics_top_users",
                  "metrics_user_idle_s", "max_body_bytes", "client_idle_timeout_s",
                  "max_client_connections", "min_body_bytes_per_s",
                  "max_unauthenticated_connections", "log_level", "event_loop",
                  "log_sample_above_per_s")
ALWAYS_RELOADED = ("api_keys", "admin_keys")
# the configured backends and discovery names: re-applied by a reload that keeps the
# models served (gateway/backends/registry.py merges them with the runtime backends)
BACKEND_FIELDS = ("backends", "discovery")


def _changed(old: Settings, new: Settings, fields: tuple[str, ...] | list[str]
             ) -> list[str]:
    return [f for f in fields if getattr(old, f) != getattr(new, f)]


async def reload_config(request: web.Request) -> web.Response:
    report = reload_settings(await admin_services(request))
    reload_siblings()  # the other workers of `fairgate serve --workers N` reload too
    return web.json_response(report)


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
    file or it is invalid. Also run on SIGHUP (``gateway/core/worker_signals.py``)."""
    current = svc.settings
    if current.config_file is None:
        raise NoConfigFile("the gateway was started without a config file: nothing to reload")
    new = _read_config(current.config_file, current)
    restart = _changed(current, new, RESTART_FIELDS)
    listed = _changed(current, new, BACKEND_FIELDS)
    if new.models() == current.models():  # same models: the pool re-pointed in place
        reloaded_backends = listed
    else:  # a model added or gone: the backend list as it was until a restart
        reloaded_backends, restart = [], [*restart, *listed]
    live = [f for f in Settings.model_fields
            if f not in RESTART_FIELDS and f not in ALWAYS_RELOADED and f not in BACKEND_FIELDS]
    reloaded = [*ALWAYS_RELOADED, *reloaded_backends, *_changed(current, new, live)]
    keys = KeyRing(new.api_keys, new.admin_keys, svc.keys.runtime)  # before any change
    svc.config.swap(new.model_copy(update={f: getattr(current, f) for f in restart}))
    # configured and runtime backends merged again (queues and connections stay)
    backends = svc.backends.apply() if "backends" in reloaded_backends else {}
    svc.keys = keys
    log.info("config_reloaded", api_keys=len(new.api_keys), admin_keys=len(new.admin_keys),
             backends=backends, reloaded=reloaded, restart_required=restart)
    return {"reloaded": reloaded, "api_keys": len(new.api_keys), "backends": backends,
            "restart_required": restart}
