"""``/openapi.json``: the operations of the endpoint table (``gateway/proxy/endpoints.py``)
generated from it, over ``static/openapi.yaml`` (the shared components and the routes
outside the table: operations, admin, fairgate's extensions), and the Batch API's
endpoints (``CreateBatchRequest.endpoint``) from the table's batchable entries.

A queued or forwarded endpoint's operation is generated whole (its body schema, its
answer, its stream, the errors its kind can answer); a local endpoint's operation is
written in the YAML, and must be there under its path, method and ``operationId``.
"""

from __future__ import annotations

import copy
import functools
import json
from importlib import resources
from typing import Any

import yaml

from gateway.proxy.endpoints import BATCHABLE, ENDPOINTS, Endpoint, Kind

_ERRORS = {  # status: components/responses
    "400": "BadRequest", "401": "Unauthorized", "403": "Forbidden", "404": "NotFound",
    "409": "Conflict", "413": "PayloadTooLarge", "429": "RateLimited",
    "502": "UpstreamError", "503": "Unavailable", "504": "QueueTimeout"}
# a forwarded call is neither queued, limited nor class-checked
_FORWARDED_ERRORS = ("400", "401", "404", "413", "502", "503")


def _ref(kind: str, name: str) -> dict[str, str]:
    return {"$ref": f"#/components/{kind}/{name}"}


def operation(endpoint: Endpoint) -> dict[str, Any]:
    """The OpenAPI operation of a queued or forwarded endpoint."""
    answer: dict[str, Any] = {
        "application/json": {"schema": (_ref("schemas", endpoint.response_schema)
                                        if endpoint.response_schema else {"type": "object"})}}
    if endpoint.streams:
        answer["text/event-stream"] = {"schema": {"type": "string"}}
    ok: dict[str, Any] = {"description": "The backend's answer" + (
        " (`stream` false) or its SSE stream (`stream` true)" if endpoint.streams else ""),
        "content": answer}
    op: dict[str, Any] = {"operationId": endpoint.operation_id, "tags": ["inference"],
                          "summary": endpoint.summary}
    if endpoint.queued:
        op["parameters"] = [_ref("parameters", "PriorityClass"),
                            _ref("parameters", "DeadlineMs")]
        ok["headers"] = {"X-Request-Id": _ref("headers", "RequestId"),
                         "X-Fairgate-Queue-Wait-Ms": _ref("headers", "QueueWaitMs")}
    if endpoint.request_schema is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": _ref("schemas", endpoint.request_schema)}}}
    errors = _ERRORS if endpoint.queued else {s: _ERRORS[s] for s in _FORWARDED_ERRORS}
    op["responses"] = {"200": ok, **{status: _ref("responses", name)
                                     for status, name in errors.items()},
                       "default": _ref("responses", "Error")}
    return op


def build(base: dict[str, Any], endpoints: tuple[Endpoint, ...] = ENDPOINTS
          ) -> dict[str, Any]:
    """``base`` (the YAML) with the table's generated operations; raises
    :class:`ValueError` when the YAML writes a generated operation or lacks a local one."""
    spec = copy.deepcopy(base)
    paths: dict[str, Any] = spec.setdefault("paths", {})
    for endpoint in endpoints:
        method = endpoint.method.lower()
        item = paths.setdefault(endpoint.path, {})
        if endpoint.kind is Kind.LOCAL:
            written = item.get(method, {}).get("operationId")
            if written != endpoint.operation_id:
                raise ValueError(f"openapi.yaml: {endpoint.method} {endpoint.path} must be "
                                 f"operation {endpoint.operation_id!r} (found {written!r})")
        elif method in item:
            raise ValueError(f"openapi.yaml describes {endpoint.method} {endpoint.path}, "
                             "which the endpoint table generates")
        else:
            item[method] = operation(endpoint)
    batch = spec.get("components", {}).get("schemas", {}).get("CreateBatchRequest")
    if batch is not None:
        batch["properties"]["endpoint"]["enum"] = list(BATCHABLE)
    return spec


@functools.cache
def document() -> dict[str, Any]:
    text = (resources.files("gateway.http") / "static" / "openapi.yaml").read_text()
    spec: dict[str, Any] = build(yaml.safe_load(text))
    return spec


@functools.cache
def openapi_json() -> bytes:
    return json.dumps(document()).encode()
