"""OpenAI Files API storage: bytes on disk under ``data_dir/files``, metadata in Redis.

A user sees only their own files; someone else's id answers 404 as if it did not exist.
An upload is refused (413) when it is larger than ``max_file_bytes`` or would take the
user's files past ``max_files_bytes_per_user``; files the gateway writes (batch results)
count towards that quota but are never refused.
"""

from __future__ import annotations

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
from gateway.storage.keys import file_meta, user_files


class FileQuotaExceeded(PayloadTooLarge):
    code = "file_quota_exceeded"


def _over_quota(quota: int, used: int) -> FileQuotaExceeded:
    return FileQuotaExceeded(
        f"this upload would take your files past their quota of {quota} bytes "
        f"({used} bytes in use); delete files you no longer need", param="file")


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
        root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.jsonl"

    async def save(self, user: str, filename: str, purpose: str,
                   chunks: AsyncIterator[bytes], quota: int | None = None) -> FileMeta:
        """Stream an upload to disk (size-capped, and within the user's ``quota`` of bytes
        over all their files), then record it."""
        room = None
        if quota is not None:
            used = await self.used_bytes(user)
            room = quota - used
            if room <= 0:
                raise _over_quota(quota, used)
        file_id = "file-" + uuid.uuid4().hex
        tmp = self.root / f".{file_id}.part"
        size = 0
        try:
            with tmp.open("wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise PayloadTooLarge(f"file is larger than {self.max_bytes} bytes",
                                              param="file")
                    if room is not None and quota is not None and size > room:
                        raise _over_quota(quota, quota - room)
                    out.write(chunk)
            os.replace(tmp, self.path(file_id))
        finally:
            tmp.unlink(missing_ok=True)
        return await self._record(FileMeta(file_id, user, filename, purpose, size,
                                           int(time.time())))

    async def used_bytes(self, user: str) -> int:
        return sum(meta.bytes for meta in await self.owned(user))

    async def create(self, user: str, filename: str, purpose: str, data: bytes) -> FileMeta:
        file_id = "file-" + uuid.uuid4().hex
        tmp = self.root / f".{file_id}.part"
        tmp.write_bytes(data)
        os.replace(tmp, self.path(file_id))
        return await self._record(FileMeta(file_id, user, filename, purpose, len(data),
                                           int(time.time())))

    async def _record(self, meta: FileMeta) -> FileMeta:
        pipe = self.client.pipeline(transaction=True)
        pipe.set(file_meta(meta.id), json.dumps(asdict(meta)))
        pipe.zadd(user_files(meta.user), {meta.id: time.time()})
        await pipe.execute()
        return meta

    async def get(self, user: str, file_id: str) -> FileMeta:
        raw = await self.client.get(file_meta(file_id))
        meta = FileMeta(**json.loads(raw)) if raw else None
        if meta is None or meta.user != user:
            raise NotFound(f"No such File object: {file_id}", param="file_id")
        return meta

    async def owned(self, user: str, purpose: str | None = None) -> list[FileMeta]:
        ids = await self.client.zrevrange(user_files(user), 0, -1)
        raws = await self.client.mget([file_meta(i) for i in ids]) if ids else []
        metas = [FileMeta(**json.loads(r)) for r in raws if r]
        return [m for m in metas if purpose is None or m.purpose == purpose]

    async def delete(self, user: str, file_id: str) -> None:
        meta = await self.get(user, file_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(file_meta(meta.id))
        pipe.zrem(user_files(user), meta.id)
        await pipe.execute()
        self.path(meta.id).unlink(missing_ok=True)
