"""OpenAI Files (``/v1/files``) and Batches (``/v1/batches``) routes.

A user sees only their own files and batches, those of its owner id (``ApiKey.owner``:
the user in its tenant, so a user of the same name in another tenant is someone else):
any other id answers 404.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.batch.files import FileMeta
from gateway.batch.input import summarize_file
from gateway.batch.records import FINAL, WINDOW_S
from gateway.core.errors import BadRequest
from gateway.http.routes import add_endpoint_routes
from gateway.proxy.completion_request import Limits, parse_json
from gateway.proxy.endpoints import BATCHABLE, BATCHES, FILES
from gateway.services import SERVICES, Services

CHUNK = 64 * 1024
MAX_METADATA_PAIRS = 16  # OpenAI's limits on batch metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


async def _user(request: web.Request) -> str:
    """The calling key's owner id: what its files and batches are stored under."""
    key = await request.app[SERVICES].keys.identify(request.headers.get("Authorization"))
    return key.owner


async def _chunks(part: BodyPartReader) -> AsyncIterator[bytes]:
    while chunk := await part.read_chunk(CHUNK):
        yield chunk


async def upload_file(request: web.Request) -> web.Response:
    user = await _user(request)
    svc = request.app[SERVICES]
    if not request.content_type.startswith("multipart/"):
        raise BadRequest("upload a file as multipart/form-data with fields 'purpose' and 'file'")
    meta = await _receive(request, svc, user)
    try:  # parsing takes seconds for a large file: off the event loop
        await asyncio.to_thread(summarize_file, svc.files.path(meta.id), svc.settings.models(),
                                Limits.of(svc.settings), _contexts(svc))
    except BaseException:  # a file that failed validation is not kept, whatever failed
        await asyncio.shield(svc.files.delete(user, meta.id))
        raise
    return web.json_response(meta.to_openai())


def _contexts(svc: Services) -> dict[str, int]:
    """Each model's context length, where a backend reported it: a line asking for more
    output than that could never be served."""
    known = {model: svc.pool.max_model_len(model) for model in svc.settings.models()}
    return {model: length for model, length in known.items() if length}


async def _receive(request: web.Request, svc: Services, user: str) -> FileMeta:
    """The uploaded file, stored; a malformed multipart body (no or bad boundary, cut
    short, broken part headers) is a 400 and leaves nothing behind."""
    purpose: str | None = None
    meta: FileMeta | None = None
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                if purpose != "batch":
                    raise BadRequest("'purpose' must be \"batch\" and come before 'file'",
                                     param="purpose")
                if meta is not None:
                    raise BadRequest("send one 'file' per upload", param="file")
                meta = await svc.files.save(user, part.filename or "upload.jsonl", purpose,
                                            _chunks(part),
                                            quota=svc.settings.batch.max_files_bytes_per_user,
                                            expected=request.content_length)
    except (ValueError, HttpProcessingError) as exc:
        if meta is not None:
            await svc.files.delete(user, meta.id)
        raise BadRequest(f"malformed multipart/form-data body: {exc}") from None
    except BaseException:
        if meta is not None:
            await asyncio.shield(svc.files.delete(user, meta.id))
        raise
    if meta is None:
        raise BadRequest("missing 'file' field", param="file")
    return meta


async def list_files(request: web.Request) -> web.Response:
    user = await _user(request)
    metas = await request.app[SERVICES].files.owned(user, request.query.get("purpose"))
    return web.json_response({"object": "list", "data": [m.to_openai() for m in metas],
                              "has_more": False})


async def get_file(request: web.Request) -> web.Response:
    user = await _user(request)
    meta = await request.app[SERVICES].files.get(user, request.match_info["file_id"])
    return web.json_response(meta.to_openai())


async def file_content(request: web.Request) -> web.StreamResponse:
    svc = request.app[SERVICES]
    meta = await svc.files.get(await _user(request), request.match_info["file_id"])
    return web.FileResponse(svc.files.path(meta.id),
                            headers={"Content-Type": "application/jsonl"})


async def delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    await request.app[SERVICES].files.delete(await _user(request), file_id)
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


async def _json_body(request: web.Request) -> dict[str, Any]:
    body = parse_json(await request.read())
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _check_create(body: dict[str, Any]) -> tuple[str, str, str, dict[str, str] | None]:
    file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
    window, metadata = body.get("completion_window", "24h"), body.get("metadata")
    if not isinstance(file_id, str) or not file_id:
        raise BadRequest("'input_file_id' is required", param="input_file_id")
    if endpoint not in BATCHABLE:
        raise BadRequest(f"'endpoint' must be one of {', '.join(BATCHABLE)}", param="endpoint")
    if not isinstance(window, str) or window not in WINDOW_S:
        raise BadRequest("'completion_window' must be \"24h\"", param="completion_window")
    if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_PAIRS
            and all(isinstance(k, str) and isinstance(v, str)
                    and len(k) <= MAX_METADATA_KEY_CHARS and len(v) <= MAX_METADATA_VALUE_CHARS
                    for k, v in metadata.items())):
        raise BadRequest(f"'metadata' must map at most {MAX_METADATA_PAIRS} strings of at most "
                         f"{MAX_METADATA_KEY_CHARS} characters to strings of at most "
                         f"{MAX_METADATA_VALUE_CHARS}", param="metadata")
    return file_id, endpoint, window, metadata


async def create_batch(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    key = await svc.keys.identify(request.headers.get("Authorization"))
    file_id, endpoint, window, metadata = _check_create(await _json_body(request))
    meta = await svc.files.get(key.owner, file_id)
    if meta.purpose != "batch":
        raise BadRequest(f"file {file_id} was not uploaded with purpose \"batch\"",
                         param="input_file_id")
    summary = await asyncio.to_thread(summarize_file, svc.files.path(file_id),
                                      svc.settings.models(), Limits.of(svc.settings),
                                      _contexts(svc))
    wrong = sorted((index, url) for url, first in summary.lines_by_url.items()
                   if url != endpoint for index in first)[:10]
    if wrong:
        listed = ", ".join(f"line {index + 1} ({url})" for index, url in wrong)
        raise BadRequest(f"every line's url must match the batch endpoint {endpoint}: {listed}",
                         param="endpoint")
    batch = await svc.batches.create(key.user, file_id, endpoint, window, metadata,
                                     summary.requests, key.weight, key.id,
                                     key.tenant_name)
    svc.batch_runner.wake()
    return web.json_response(batch)


async def get_batch(request: web.Request) -> web.Response:
    user = await _user(request)
    batch = await request.app[SERVICES].batches.get(user, request.match_info["batch_id"])
    return web.json_response(batch)


async def list_batches(request: web.Request) -> web.Response:
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        raise BadRequest("'limit' must be an integer", param="limit") from None
    if not 1 <= limit <= 100:
        raise BadRequest("'limit' must be between 1 and 100", param="limit")
    data, more = await request.app[SERVICES].batches.page(await _user(request), limit,
                                                        request.query.get("after"))
    return web.json_response({"object": "list", "data": data,
                              "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None, "has_more": more})


async def cancel_batch(request: web.Request) -> web.Response:
    user, batch_id = await _user(request), request.match_info["batch_id"]
    svc = request.app[SERVICES]
    batch = await svc.batches.get(user, batch_id)
    if batch["status"] in FINAL:
        raise BadRequest(f"batch {batch_id} is already {batch['status']}", param="batch_id")
    await svc.batches.transition(batch_id, ("validating", "in_progress", "finalizing"),
                                 "cancelling", "cancelling_at")
    svc.batch_runner.wake()
    return web.json_response(await svc.batches.get(user, batch_id))


def add_batch_routes(app: web.Application) -> None:
    add_endpoint_routes(app, {
        "createFile": upload_file, "listFiles": list_files, "retrieveFile": get_file,
        "downloadFile": file_content, "deleteFile": delete_file,
        "createBatch": create_batch, "listBatches": list_batches,
        "retrieveBatch": get_batch, "cancelBatch": cancel_batch}, FILES + BATCHES)
