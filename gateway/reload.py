"""Config reload: re-read the config file and swap in what may change without a restart.

``POST /admin/reload`` (admin key) and SIGHUP (``gateway/worker_signals.py``) both land
here. A reload re-reads ``api_keys``, ``admin_keys`` and ``backends`` (added, removed or
re-pointed backends of the models already served: queues and connections stay) and swaps
in new settings; a new model, or changed classes, fairness, Redis or listen settings are
reported under ``restart_required`` and not applied.
"""

from __future__ import annotations

from typing import Any

import structlog
import yaml
from aiohttp import web
from pydantic import ValidationError

from gateway.admin_access import admin_services
from gateway.auth import KeyRing
from gateway.errors import BadRequest, NoConfigFile
from gateway.services import Services
from gateway.settings import Settings, load_settings
from gateway.worker_signals import reload_siblings

log = structlog.get_logger("fairgate.admin")

RESTART_FIELDS = ("backends", "classes", "fairness", "redis_url", "listen", "replica_id",
                  "vtc_input_weight", "vtc_output_weight", "priority_class_gap", "tenants",
                  "key_pepper")


def _changed(old: Settings, new: Settings) -> list[str]:
    return [f for f in RESTART_FIELDS if getattr(old, f) != getattr(new, f)]


async def reload_config(request: web.Request) -> web.Response:
    report = reload_settings(await admin_services(request))
    reload_siblings()  # the other workers of `fairgate serve --workers N` reload too
    return web.json_response(report)


def reload_settings(svc: Services) -> dict[str, Any]:
    """Re-read the config file into ``svc`` (keys, admin keys, backends); what changed and
    what needs a restart. Raises ``NoConfigFile``/``BadRequest`` and changes nothing when
    there is no file or it is invalid. Also run on SIGHUP (``gateway/worker_signals.py``)."""
    current = svc.settings
    if current.config_file is None:
        raise NoConfigFile("the gateway was started without a config file: nothing to reload")
    try:
        new = load_settings(current.config_file)
    except (ValidationError, FileNotFoundError, yaml.YAMLError) as exc:
        raise BadRequest(f"config file {str(current.config_file)!r} is invalid; "
                         f"nothing reloaded: {exc}") from None
    restart = _changed(current, new)
    reloaded = ["api_keys", "admin_keys"]
    update: dict[str, object] = {"api_keys": new.api_keys, "admin_keys": new.admin_keys}
    backends: dict[str, list[str]] = {}
    if "backends" in restart and new.models() == current.models():
        # same models: re-point the pool in place; queues and connections stay
        backends = svc.pool.reconcile(new.backends)
        update["backends"] = new.backends
        restart.remove("backends")
        reloaded.append("backends")
    svc.settings = current.model_copy(update=update)
    svc.keys = KeyRing(new.api_keys, new.admin_keys, svc.keys.runtime)
    log.info("config_reloaded", api_keys=len(new.api_keys), admin_keys=len(new.admin_keys),
             backends=backends, restart_required=restart)
    return {"reloaded": reloaded, "api_keys": len(new.api_keys), "backends": backends,
            "restart_required": restart}
