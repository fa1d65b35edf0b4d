"""An owner's stored-bytes counter on a real Redis: ``file_bytes.lua`` checks and reserves
in one step, ``file_delete.lua`` gives a file's bytes back once, and a missing counter
starts from the owner's records (files stored before the counter existed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.batch.files import FileMeta, FileQuotaExceeded, FileStore
from gateway.storage.keys import user_file_bytes

OWNER = "A/alice"


async def chunks(data: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]
        await asyncio.sleep(0)  # another upload may reserve between two chunks


async def counted(redis: aioredis.Redis) -> int | None:
    raw = await redis.get(user_file_bytes(OWNER))
    return None if raw is None else int(raw)


async def test_concurrent_reservations_stop_at_the_quota(redis: aioredis.Redis,
                                                         tmp_path: Path) -> None:
    files = FileStore(redis, tmp_path, 10**6)
    outcomes = await asyncio.gather(*(files._reserve(OWNER, 1000, 10_000, 0)
                                      for _ in range(50)), return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, FileQuotaExceeded)]
    assert len(refused) == 40, f"{50 - len(refused)} reservations of 1000 B taken"
    assert await counted(redis) == 10_000, await counted(redis)
    assert "10000 bytes in use" in refused[0].message, refused[0].message


async def test_uploads_reserve_whole_when_they_can_and_chunk_by_chunk_else(
        redis: aioredis.Redis, tmp_path: Path) -> None:
    files = FileStore(redis, tmp_path, 10**6)
    data = b"x" * 4000
    # the form around it makes 4100 B expected: no room for that, the file still fits
    await files.save(OWNER, "a", "batch", chunks(data), quota=8000)
    assert await counted(redis) == 4000
    exact = await files.save(OWNER, "b", "batch", chunks(data), quota=8000, expected=4100)
    assert exact.bytes == 4000 and await counted(redis) == 8000, await counted(redis)
    with pytest.raises(FileQuotaExceeded) as err:
        await files.save(OWNER, "c", "batch", chunks(data), quota=8000, expected=4100)
    assert "(8000 bytes in use" in err.value.message, err.value.message
    assert await counted(redis) == 8000, "a refused upload kept part of its reservation"
    await files.delete(OWNER, exact.id)
    # room for one (a quota of 8100): of two racing, the one that reserved whole wins,
    # the other finds no room for its first chunk; the form's 100 B go back after
    won = await asyncio.gather(
        files.save(OWNER, "d", "batch", chunks(data), quota=8100, expected=4100),
        files.save(OWNER, "e", "batch", chunks(data), quota=8100, expected=4100),
        return_exceptions=True)
    assert sorted(type(o).__name__ for o in won) == ["FileMeta", "FileQuotaExceeded"], won
    assert await counted(redis) == 8000, await counted(redis)


async def test_a_file_deleted_twice_at_once_gives_its_bytes_back_once(
        redis: aioredis.Redis, tmp_path: Path) -> None:
    files = FileStore(redis, tmp_path, 10**6)
    kept = await files.create(OWNER, "kept", "batch", b"k" * 300)
    gone = await files.create(OWNER, "gone", "batch", b"g" * 500)
    assert await counted(redis) == 800
    await asyncio.gather(files.delete(OWNER, gone.id), files.delete(OWNER, gone.id),
                         return_exceptions=True)
    assert await counted(redis) == 300, await counted(redis)
    await files.delete(OWNER, kept.id)
    assert await counted(redis) is None  # nothing stored: no counter left behind


async def test_a_missing_counter_starts_from_the_files_on_record(
        redis: aioredis.Redis, tmp_path: Path) -> None:
    """Files recorded before the counter existed (or after Redis lost it) count."""
    files = FileStore(redis, tmp_path, 10**6)
    await files._record(FileMeta("file-old", OWNER, "old", "batch", 7000, 0))
    await files._give_back(OWNER, 100)  # no counter: nothing to give back from
    assert await counted(redis) is None
    with pytest.raises(FileQuotaExceeded) as err:
        await files.save(OWNER, "new", "batch", chunks(b"n" * 4000), quota=10_000)
    assert "7000 bytes in use" in err.value.message, err.value.message
    assert await counted(redis) == 7000, await counted(redis)
