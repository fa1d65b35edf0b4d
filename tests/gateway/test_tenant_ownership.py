"""What a user owns is its tenant's user's (issue 43, item 1): two keys of user ``alice``
in tenants A and B are two owners. Through real HTTP with the openai SDK: B's alice can
neither list, read, download nor delete A's alice's files, nor see, list or cancel her
batches, nor read the status of her queued request or her usage; A's alice still can.
Records stored before owners named their tenant stay readable by the owner they were."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.core.settings import owner_id
from gateway.http.server import GatewayServer
from gateway.storage.keys import BatchKeys, ModelKeys, user_batches
from loadtest.sim.server import SimServer
from tests.batch.test_batch_api import client, jsonl
from tests.gateway.conftest import (
    CHAT,
    KEYS,
    MODEL,
    BusyFactory,
    GatewayFactory,
    SimFactory,
    assert_error,
    call,
    until,
)

K = ModelKeys(MODEL)
TENANT_KEYS = [*KEYS,
               {"key": "sk-a-alice", "user": "alice", "tenant": "A",
                "priority_class": "interactive", "limits": {"daily_tokens": 100_000}},
               {"key": "sk-b-alice", "user": "alice", "tenant": "B",
                "priority_class": "interactive", "limits": {"daily_tokens": 100_000}}]


@pytest.fixture
async def rig(sim: SimFactory, gateway: GatewayFactory, tmp_path: Path
              ) -> tuple[GatewayServer, SimServer]:
    backend = await sim(max_num_seqs=1)
    return await gateway([backend], api_keys=TENANT_KEYS, data_dir=tmp_path,
                         batch_poll_s=0.05,
                         classes={"interactive": {"max_waiting": 1}}), backend


@pytest.fixture
def gw(rig: tuple[GatewayServer, SimServer]) -> GatewayServer:
    return rig[0]


def test_the_owner_is_the_user_in_its_tenant_and_the_bare_user_in_its_own() -> None:
    assert owner_id("alice", "A") == "A/alice"
    assert owner_id("alice", None) == "alice"
    assert owner_id("alice", "alice") == "alice"  # the default tenant: as stored before


async def test_another_tenants_user_of_the_same_name_sees_none_of_her_files_or_batches(
        gw: GatewayServer) -> None:
    a, b = client(gw, "sk-a-alice"), client(gw, "sk-b-alice")
    try:
        up = await a.files.create(file=("in.jsonl", jsonl(2)), purpose="batch")
        batch = await a.batches.create(input_file_id=up.id, endpoint=CHAT,
                                       completion_window="24h")
        listed = [f.id for f in (await b.files.list()).data]
        assert listed == [], f"B's alice lists A's alice's files: {listed}"
        for attempt in (b.files.retrieve(up.id), b.files.content(up.id),
                        b.files.delete(up.id), b.batches.retrieve(batch.id),
                        b.batches.cancel(batch.id),
                        b.batches.create(input_file_id=up.id, endpoint=CHAT,
                                         completion_window="24h")):
            with pytest.raises(openai.NotFoundError) as err:
                await attempt
            assert err.value.status_code == 404, err.value
        batches = [x.id for x in (await b.batches.list()).data]
        assert batches == [], f"B's alice lists A's alice's batches: {batches}"

        assert (await a.files.retrieve(up.id)).id == up.id
        assert [f.id for f in (await a.files.list()).data] == [up.id]
        assert [x.id for x in (await a.batches.list()).data] == [batch.id]
        assert (await a.batches.retrieve(batch.id)).id == batch.id
        await a.batches.cancel(batch.id)
        await until(lambda: _final(a, batch.id), "A's batch finished or cancelled")
        await a.files.delete(up.id)
    finally:
        await a.close()
        await b.close()


async def _final(c: openai.AsyncOpenAI, batch_id: str) -> bool:
    return (await c.batches.retrieve(batch_id)).status in ("completed", "cancelled")


async def test_another_tenants_user_of_the_same_name_cannot_read_her_queue_status_or_usage(
        rig: tuple[GatewayServer, SimServer], busy: BusyFactory,
        http: aiohttp.ClientSession) -> None:
    gw, backend = rig
    held = busy(gw, backend)
    await held.fill("sk-bob")
    queued = asyncio.create_task(call(http, "POST", gw.url + CHAT, key="sk-a-alice", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
    queue = K.queue("interactive", "alice", "A")
    client_ = gw.services.store.client

    async def one_queued() -> bool:
        return int(await client_.llen(queue)) == 1

    await until(one_queued, "A's alice's request queued")
    [request_id] = await client_.lrange(queue, 0, -1)
    url = gw.url + "/v1/fairgate/requests/" + str(request_id)
    status, body, _ = await call(http, "GET", url, key="sk-b-alice")
    assert status == 404, f"B's alice reads A's alice's queued request: {status} {body}"
    assert_error(body, type_="invalid_request_error")
    status, body, _ = await call(http, "GET", url, key="sk-alice")  # alice of her own tenant
    assert status == 404, f"the default tenant's alice reads it: {status} {body}"
    status, body, _ = await call(http, "GET", url, key="sk-a-alice")
    assert status == 200 and body["status"] == "queued", body
    await held.close()
    done = await queued
    assert done[0] == 200, done

    status, a_usage, _ = await call(http, "GET", gw.url + "/v1/fairgate/usage", key="sk-a-alice")
    assert status == 200, a_usage
    status, b_usage, _ = await call(http, "GET", gw.url + "/v1/fairgate/usage", key="sk-b-alice")
    assert status == 200, b_usage
    assert _used(a_usage) > 0, f"A's alice's usage shows nothing spent: {a_usage}"
    assert _used(b_usage) == 0, f"B's alice's usage shows A's alice's: {b_usage}"
    assert (a_usage["tenant"], b_usage["tenant"]) == ("A", "B"), (a_usage, b_usage)


def _used(usage: dict[str, Any]) -> int:
    """Tokens spent by a usage view's key (its daily budget's use)."""
    return sum(int(scope["daily_tokens_used"])
               for scope in usage["limits"] if scope["scope"] == "key")


async def test_records_stored_before_tenants_qualified_owners_stay_with_their_owner(
        gw: GatewayServer) -> None:
    """What the previous release stored under the bare user: the default tenant's alice
    keeps her files; a batch of A's alice (its record names tenant A) is hers, listed
    and read, and no longer the default tenant's alice's."""
    files = gw.services.files
    old_file = await files.create("alice", "old.jsonl", "batch", jsonl(1))
    batch_id = "batch_" + "0" * 32
    now = int(time.time())
    doc = {"id": batch_id, "user": "alice", "endpoint": CHAT, "input_file_id": old_file.id,
           "completion_window": "24h", "metadata": None, "weight": 1.0, "key_id": None,
           "tenant": "A", "created_at": now, "expires_at": now + 86400}
    redis = gw.services.store.client
    await redis.hset(BatchKeys(batch_id).hash, mapping={
        "doc": json.dumps(doc), "status": "completed", "total": 1})
    await redis.zadd(user_batches("alice"), {batch_id: time.time()})  # the old index
    mine, a = client(gw, "sk-alice"), client(gw, "sk-a-alice")
    try:
        assert [f.id for f in (await mine.files.list()).data] == [old_file.id]
        assert (await mine.files.retrieve(old_file.id)).id == old_file.id
        with pytest.raises(openai.NotFoundError):
            await a.files.retrieve(old_file.id)
        listed = [x.id for x in (await a.batches.list()).data]
        assert listed == [batch_id], f"A's alice does not list her old batch: {listed}"
        assert (await a.batches.retrieve(batch_id)).status == "completed"
        others = [x.id for x in (await mine.batches.list()).data]
        assert others == [], f"the default tenant's alice lists A's alice's batch: {others}"
        with pytest.raises(openai.NotFoundError):
            await mine.batches.retrieve(batch_id)
    finally:
        await mine.close()
        await a.close()
