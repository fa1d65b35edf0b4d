"""OpenAI Files API storage: bytes on disk under ``data_dir/files``, metadata in Redis.

Files belong to an owner (``ApiKey.owner``: the user in its tenant), who alone sees them;
someone else's id answers 404 as if it did not exist. An upload is refused (413) when it
is larger than ``max_file_bytes`` or would take the owner's files past
``max_files_bytes_per_user``: each chunk is reserved on the owner's stored-bytes counter
before it is written, check and reservation in one script (``file_bytes.lua``), so uploads
in parallel never store more than the quota together; a failed upload gives back what it
reserved, a deleted file its bytes. Files the gateway writes (batch results) count
towards that quota but are never refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from gateway.core.errors import NotFound, PayloadTooLarge
from gateway.storage.keys import file_meta, user_file_bytes, user_files
from gateway.storage.scripts import load_script


class FileQuotaExceeded(PayloadTooLarge):
    code = "file_quota_exceeded"


def _over_quota(quota: int, used: int) -> FileQuotaExceeded:
    return FileQuotaExceeded(
        f"this upload would take your files past their quota of {quota} bytes "
        f"({used} bytes in use or being uploaded); delete files you no longer need",
        param="file")


@dataclass(frozen=True, slots=True)
class FileMeta:
    id: str
    user: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "status_details": None}


class FileStore:
    def __init__(self, client: aioredis.Redis, root: Path, max_bytes: int) -> None:
        self.client: Any = client  # redis-py's asyncio stubs: ``Awaitable[T] | T``
        self.root = root
        self.max_bytes = max_bytes
        self._bytes = client.register_script(load_script("file_bytes"))
        self._delete = client.register_script(load_script("file_delete"))
        root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.jsonl"

    async def save(self, owner: str, filename: str, purpose: str,
                   chunks: AsyncIterator[bytes], quota: int | None = None,
                   expected: int | None = None) -> FileMeta:
        """Stream an upload to disk (size-capped, and within the owner's ``quota`` of bytes
        over all their files), then record it.

        Within a quota, ``expected`` (the request's Content-Length: the file and the form
        around it) is reserved at once, so of uploads racing for the last room those that
        fit whole win it; when it does not fit (or is unknown), each chunk is reserved as
        it comes, so a file that fits exactly is still taken. What was reserved beyond
        the file's size is given back when it is recorded, all of it when it fails."""
        file_id = "file-" + uuid.uuid4().hex
        tmp = self.root / f".{file_id}.part"
        on_record = await self._on_record(owner)
        size = reserved = 0
        try:
            if quota is not None and expected is not None and 0 < expected <= self.max_bytes:
                with contextlib.suppress(FileQuotaExceeded):
                    await self._reserve(owner, expected, quota, on_record)
                    reserved = expected
            with tmp.open("wb") as out:
                async for chunk in chunks:
                    if size + len(chunk) > self.max_bytes:
                        raise PayloadTooLarge(f"file is larger than {self.max_bytes} bytes",
                                              param="file")
                    if quota is not None and size + len(chunk) > reserved:
                        await self._reserve(owner, size + len(chunk) - reserved, quota,
                                            on_record, reserved)
                        reserved = size + len(chunk)
                    size += len(chunk)
                    out.write(chunk)
            if quota is None:
                await self._reserve(owner, size, None, on_record)
                reserved = size
            os.replace(tmp, self.path(file_id))
            meta = await self._record(FileMeta(file_id, owner, filename, purpose, size,
                                               int(time.time())))
        except BaseException:
            if reserved:  # whatever failed (a cancelled upload too), its reservation goes back
                await asyncio.shield(self._give_back(owner, reserved))
            self.path(file_id).unlink(missing_ok=True)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        if reserved > size:  # the form around the file
            await asyncio.shield(self._give_back(owner, reserved - size))
        return meta

    async def _on_record(self, owner: str) -> int | None:
        """The bytes of the owner's recorded files when its counter is missing (none
        yet, or Redis lost it), to start it from; None when it exists."""
        if await self.client.exists(user_file_bytes(owner)):
            return None
        return await self.used_bytes(owner)

    async def _reserve(self, owner: str, size: int, quota: int | None,
                       on_record: int | None, own: int = 0) -> None:
        """Reserve ``size`` more bytes for ``owner`` within ``quota`` (``own``: what this
        upload holds already, left out of the bytes a refusal names)."""
        ok, counted = await self._bytes(keys=[user_file_bytes(owner)], args=[
            size, "" if quota is None else quota, "" if on_record is None else on_record])
        if not ok and quota is not None:
            raise _over_quota(quota, int(counted) - own)

    async def _give_back(self, owner: str, size: int) -> None:
        await self._bytes(keys=[user_file_bytes(owner)], args=[-size, "", ""])

    async def used_bytes(self, owner: str) -> int:
        """The bytes of the owner's recorded files (not those of uploads in progress)."""
        return sum(meta.bytes for meta in await self.owned(owner))

    async def create(self, owner: str, filename: str, purpose: str, data: bytes) -> FileMeta:
        """A file the gateway writes for ``owner``: counted, never refused."""
        file_id = "file-" + uuid.uuid4().hex
        tmp = self.root / f".{file_id}.part"
        tmp.write_bytes(data)
        os.replace(tmp, self.path(file_id))
        await self._reserve(owner, len(data), None, await self._on_record(owner))
        return await self._record(FileMeta(file_id, owner, filename, purpose, len(data),
                                           int(time.time())))

    async def _record(self, meta: FileMeta) -> FileMeta:
        pipe = self.client.pipeline(transaction=True)
        pipe.set(file_meta(meta.id), json.dumps(asdict(meta)))
        pipe.zadd(user_files(meta.user), {meta.id: time.time()})
        await pipe.execute()
        return meta

    async def get(self, owner: str, file_id: str) -> FileMeta:
        raw = await self.client.get(file_meta(file_id))
        meta = FileMeta(**json.loads(raw)) if raw else None
        if meta is None or meta.user != owner:
            raise NotFound(f"No such File object: {file_id}", param="file_id")
        return meta

    async def owned(self, owner: str, purpose: str | None = None) -> list[FileMeta]:
        ids = await self.client.zrevrange(user_files(owner), 0, -1)
        raws = await self.client.mget([file_meta(i) for i in ids]) if ids else []
        metas = [FileMeta(**json.loads(r)) for r in raws if r]
        return [m for m in metas if (purpose is None or m.purpose == purpose)
                and m.user == owner]

    async def delete(self, owner: str, file_id: str) -> None:
        meta = await self.get(owner, file_id)
        await self._delete(keys=[file_meta(meta.id), user_files(owner),
                                 user_file_bytes(owner)], args=[meta.id])
        self.path(meta.id).unlink(missing_ok=True)
