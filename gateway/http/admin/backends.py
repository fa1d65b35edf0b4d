"""Backends at runtime (``POST /admin/backends``, ``DELETE /admin/backends/{name}``).

The backend list and its rules are ``gateway/backends/registry.py``'s; these handlers
validate the operator's input and answer with the backend's state. A new backend joins
a model the gateway serves; its name is unique across the config file, the admin API and
DNS discovery. A removal drains first (running answers move after ``grace_s``, default
0) and answers 202 while requests still run there, 200 once it is gone.
"""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web
from pydantic import Field

from gateway.backends.registry import ADMIN
from gateway.core.backend_names import BackendName
from gateway.core.errors import BadRequest
from gateway.core.settings import Backend
from gateway.http.admin.access import admin_services
from gateway.http.admin.keys import read_body
from gateway.http.admin.ops import MAX_GRACE_S
from gateway.proxy.completion_request import read_json_object

MAX_REMOVE_BODY_BYTES = 4096


class NewBackend(Backend):
    """A backend as ``POST /admin/backends`` takes it: its name and URL checked as the
    config file's are (``gateway/core/backend_names.py``)."""

    name: BackendName
    model: str = Field(min_length=1)


def _grace_s(body: dict[str, Any]) -> float:
    for name in body:
        if name != "grace_s":
            raise BadRequest(f"unknown removal option {name!r} (known: grace_s)", param=name)
    grace = body.get("grace_s", 0.0)
    if (isinstance(grace, bool) or not isinstance(grace, int | float)
            or not math.isfinite(grace) or not 0 <= grace <= MAX_GRACE_S):
        raise BadRequest(f"grace_s must be a number of seconds from 0 to {MAX_GRACE_S:g}",
                         param="grace_s")
    return float(grace)


async def add_backend(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    new: NewBackend = await read_body(request, NewBackend)
    served = svc.settings.models()
    if new.model not in served:
        raise BadRequest(f"model {new.model!r} is not served here (served: "
                         f"{', '.join(served)}); a backend added at runtime serves a model "
                         "of the config", param="model")
    await svc.backends.add(Backend(**new.model_dump()), ADMIN)
    svc.dispatcher.wake()
    return web.json_response(await svc.inspector.backend(new.name), status=201)


async def remove_backend(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    name = request.match_info["name"]
    grace_s = 0.0
    if request.body_exists:
        grace_s = _grace_s(await read_json_object(request, MAX_REMOVE_BODY_BYTES))
    entry = await svc.backends.remove(name, grace_s, ADMIN)
    svc.dispatcher.wake()
    if entry is None or name not in svc.pool.handles:
        return web.json_response({"name": name, "object": "fairgate.backend",
                                  "removed": True})
    row = await svc.inspector.backend(name)
    return web.json_response({**row, "removed": False}, status=202)
