"""API keys at runtime (``/admin/keys``): create, list, revoke, rotate, a key's limits."""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.core.config_file import describe
from gateway.core.errors import BadRequest, KeyInConfig, NotFound
from gateway.core.settings import ApiKey, UsageLimits, check_name
from gateway.http.admin.access import admin_services
from gateway.http.routes import key_usage
from gateway.proxy.completion_request import parse_json
from gateway.services import Services
from policies.classes import CLASS_ORDER, DEFAULT_CLASS

NAME = re.compile(r"[A-Za-z0-9._@-]{1,128}")  # no ':' or '/' (settings.NAME_SEPARATORS)


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user: str
    tenant: str | None = None
    priority_class: str = DEFAULT_CLASS.name
    weight: float = Field(1.0, gt=0, le=1000, allow_inf_nan=False)
    trusted_end_users: bool = False
    limits: UsageLimits | None = None

    @field_validator("user", "tenant")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not NAME.fullmatch(value):
            check_name(value)
            raise ValueError("1-128 characters of letters, digits and ._@-")
        return value

    @field_validator("priority_class")
    @classmethod
    def _known_class(cls, value: str) -> str:
        if value not in CLASS_ORDER:
            raise ValueError(f"must be one of {', '.join(CLASS_ORDER)}")
        return value


class Rotation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grace_s: float | None = Field(None, ge=0, le=30 * 86400, allow_inf_nan=False)


async def read_body(request: web.Request, model: type[BaseModel], empty_ok: bool = False) -> Any:
    """The body validated by ``model``; a 400 naming the first field at fault."""
    raw = await request.read()
    if not raw.strip() and empty_ok:
        raw = b"{}"
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        param = ".".join(map(str, errors[0]["loc"])) if errors else None
        raise BadRequest(f"invalid request body: {describe(exc, model)}", param=param) from None


def _config_key(svc: Services, key_id: str) -> ApiKey | None:
    return next((k for k in svc.keys.config_keys() if k.id == key_id), None)


def config_key_record(key: ApiKey) -> dict[str, Any]:
    return {"id": key.id, "object": "fairgate.api_key", "prefix": key.key[:3] + "…",
            "user": key.user, "tenant": key.tenant_name, "priority_class": key.priority_class,
            "weight": key.weight, "trusted_end_users": key.trusted_end_users,
            "limits": key.limits.model_dump(exclude_none=True) if key.limits else {},
            "source": "config", "created": None, "rotated": None, "last_used": None}


def _runtime(svc: Services) -> Any:
    if svc.keys.runtime is None:  # always built by gateway/services.py
        raise NotFound("runtime keys are not available")
    return svc.keys.runtime


async def create_key(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    new = await read_body(request, NewKey)
    record, secret = await _runtime(svc).create(new.user, new.tenant, new.priority_class,
                                                new.weight, new.limits, new.trusted_end_users)
    return web.json_response({**record, "key": secret}, status=201)


async def list_keys(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    data = [config_key_record(k) for k in svc.keys.config_keys()]
    data += await _runtime(svc).records()
    return web.json_response({"object": "list", "data": data})


async def revoke_key(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    key_id = request.match_info["id"]
    if _config_key(svc, key_id) is not None:
        raise KeyInConfig(f"key {key_id} is defined in the config file: remove it there "
                          "and reload")
    if not await _runtime(svc).revoke(key_id):
        raise NotFound(f"no key {key_id!r}", param="id")
    return web.json_response({"id": key_id, "object": "fairgate.api_key", "deleted": True})


async def rotate_key(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    key_id = request.match_info["id"]
    rotation = await read_body(request, Rotation, empty_ok=True)
    if _config_key(svc, key_id) is not None:
        raise KeyInConfig(f"key {key_id} is defined in the config file: change it there "
                          "and reload")
    grace_s = (svc.settings.access.key_rotate_grace_s if rotation.grace_s is None
               else rotation.grace_s)
    rotated = await _runtime(svc).rotate(key_id, grace_s)
    if rotated is None:
        raise NotFound(f"no key {key_id!r}", param="id")
    record, secret = rotated
    return web.json_response({**record, "key": secret, "previous_key_valid_s": grace_s})


async def key_limits(request: web.Request) -> web.Response:
    """A key's limits and budgets, and its tenant's, with what is left of them now."""
    svc = await admin_services(request)
    key_id = request.match_info["id"]
    key = await svc.keys.find(key_id)
    if key is None:
        raise NotFound(f"no key {key_id!r}", param="id")
    return web.json_response(await key_usage(svc, key))
