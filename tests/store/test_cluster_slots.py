"""Every script call and every transaction fairgate makes keeps to one Redis Cluster
slot: each adapter's verbs run against a real Valkey Cluster (3 masters) through the
cluster client of the Redis boundary, and the keys of every script call are checked with
redis-py's ``key_slot``. A key in another slot fails twice: the server answers CROSSSLOT
(or refuses a script touching a key another node holds), and the check below names the
script and its keys."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry
from redis.crc import key_slot

from gateway.access.keyring import RuntimeKeys
from gateway.access.sessions import SessionStore
from gateway.backends.registry import ADMIN, BackendList
from gateway.batch.files import FileStore
from gateway.batch.records import BatchStore
from gateway.core.metrics import GatewayMetrics
from gateway.core.metrics.redis import SCRIPT_COMMANDS, RedisMetrics
from gateway.core.settings import ApiKey, Backend, RedisCluster, SettingsHolder, load_settings
from gateway.scheduling.quotas import Quotas
from gateway.scheduling.usage import UsageLedger
from gateway.services import build_pool
from gateway.storage.dispatch_call import dispatch_args
from gateway.storage.records import LeaseWish, Preempt, Start
from gateway.storage.redis_client import BoundaryRedis, connect_cluster
from gateway.storage.store import Store
from policies.gates import BackendSnapshot
from tests.store.test_scripts import req

MODELS = ("m", "llama-3.1-8b", "mistral")  # three hash tags, one on each master
ALL_OPEN = {"interactive": 5, "default": 5, "batch": 5}


class Recorder(RedisMetrics):
    """The boundary's metrics hook, keeping each command's arguments."""

    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
        self.calls: list[tuple[tuple[Any, ...], str]] = []

    def count(self, args: tuple[Any, ...], scripts: dict[str, str]) -> None:
        command = str(args[0]).upper()
        name = scripts.get(str(args[1]), "?") if command in SCRIPT_COMMANDS else ""
        self.calls.append((args, name))

    def script_calls(self) -> list[tuple[str, list[str]]]:
        found = []
        for args, name in self.calls:
            if str(args[0]).upper() in SCRIPT_COMMANDS:
                count = int(args[2])
                found.append((name, [str(k) for k in args[3:3 + count]]))
        return found


def script_files() -> set[str]:
    lua = resources.files("gateway.storage") / "lua"
    return {f.name.removesuffix(".lua") for f in lua.iterdir() if f.name.endswith(".lua")
            and not f.name.startswith("_")}


async def exercise_store(client: BoundaryRedis, model: str) -> None:
    store = Store.over(client, 600)
    now = time.time()
    await store.replicas.heartbeat([model], "r1", now, {model: now})
    await store.replicas.heartbeat([model], "r2", now, {model: now})
    snap = BackendSnapshot(waiting=0, running=0, kv_usage=0.1, tpot_s=0.02, taken_at_s=now)
    stored = await store.fleet.store_snapshot(model, "b1", snap, "{}")
    assert stored.stored, "the snapshot was not stored"
    assert await store.fleet.publish_failure(model, "b2", 1) == "1"
    queued, views = (await store.fleet.scrape_leases("s1", 1.0, {model: [
        LeaseWish("b1", True), LeaseWish("b2", True)]}))[model]
    assert queued == 0 and views["b1"].held and views["b2"].published is not None, views
    reqs = [req("a1", "alice", at=now), req("b1", "bob", at=now, owner="r2"),
            req("c1", "carol", at=now)]
    then = dispatch_args(model, "b1", {"default": 1}, "r1", now, 10.0)
    positions, done = await store.queue.enqueue_many(model, reqs[:2], 10, then=then)
    assert positions == [1, 1] and done is not None and len(done.grants) == 1, (positions, done)
    first = done.grants[0]
    await store.queue.enqueue(model, reqs[2], 10)
    grants, depth = await store.queue.dispatch(model, "b1", ALL_OPEN, "r1", now, 10.0, max_grants=2)
    assert len(grants) == 2 and depth == 0, (grants, depth)
    await store.queue.mark_started(model, grants[0], now + 0.1,
                             then=dispatch_args(model, "b1", ALL_OPEN, "r1", now, 10.0))
    ledger = UsageLedger(client, 30, lambda: [model])
    usage = ledger.counts(ApiKey(key="sk-x", user="alice"), model, "default", 12, 3,
                          error=False, now=now)
    released, _ = await store.queue.settle_and_dispatch(
        model, first, 5.0, usage=usage, starts=[Start(grants[1].request_id, "b1", now)],
        then=dispatch_args(model, "b1", ALL_OPEN, "r1", now, 10.0))
    assert released, "the settle released nothing"
    today = datetime.fromtimestamp(now, UTC).date()
    rows = [r for r in await ledger.rows(today, today) if r["model"] == model]
    assert [(r["user"], r["requests"], r["prompt_tokens"]) for r in rows] == [
        ("alice", 1, 12)], rows
    await ledger.record(ApiKey(key="sk-y", user="bob"), model, "default", 0, 0, error=True)
    await store.queue.enqueue(model, req("d1", "dave", at=now), 10)
    assert await store.queue.cancel(model, "d1", "dave", "default"), "cancel found nothing"
    assert await store.shares.add_service(model, {"alice": 10.0}, now, 60.0, 100, 3600) == 1
    assert set(await store.shares.service_shares(model)) == {"alice"}
    states = await store.fleet.backend_states(model, ["b1", "b2"])
    assert states["b1"].inflight == 2, states
    held = await store.replicas.held_by(model, "r1")
    assert {g.request_id for g, _ in held} <= {"a1", "b1", "c1"}
    await store.reads.queued_users(model, 5)
    await store.reads.queued_sample(model, 5)
    await store.reads.queue_place(model, "default", "alice", None)
    await store.fleet.set_drained(model, "b2", True)
    await store.replicas.next_order(model, "r2", 0.01)  # its script runs in the model's slot
    view = await store.preempts.preemption_view(model, ["interactive", "default", "batch"], 0.0)
    assert {r["id"] for r in view.inflight} <= {"a1", "b1", "c1"}, view
    order = Preempt(grants[1].request_id, grants[1].request_id, "b1")
    if await store.preempts.order_preemption(model, order, now, 2, 0.1, 5.0):
        await store.preempts.preempt_refused(model, order)
    assert await store.queue.reap(model, now + 60, 3.0) >= 0
    await store.queue.enqueue(model, req("e1", "app/eve", at=now), 10)  # a trusted key's end user
    assert await store.queue.cancel(model, "e1", "app/eve", "default"), "cancel found nothing"
    assert await store.queue.forget_idle(model, now + 60, 30.0, 10) == (1, 0)
    await store.reads.add_history(int(now * 1000), {"n": 1.0, f"d:{model}": 2.0}, {"tmax": 0.5}, 60)
    assert (await store.reads.history(int(now * 1000)))[-1][1]["n"] >= 1


async def exercise_accounts(client: BoundaryRedis, tmp: Path) -> None:
    holder = SettingsHolder(load_settings(None, tenants={
        "acme": {"limits": {"rpm": 100, "tpm": 10000, "max_concurrent": 3,
                            "daily_tokens": 10**6, "monthly_tokens": 10**7}}}))
    quotas = Quotas(client, holder)
    key = ApiKey(key="sk-q", user="alice", tenant="acme", id="key_q",
                 limits={"rpm": 10, "max_concurrent": 2, "daily_tokens": 1000})
    held = await quotas.admit(key, "q1", 50)
    assert held is not None and len(held.scopes) == 2, held
    await quotas.settle(held, 30)
    assert [row["scope"] for row in await quotas.view(key)] == ["key", "tenant"]

    keys = RuntimeKeys(client, holder)
    record, secret = await keys.create("bob", "acme", "default", 1.0, None)
    assert (await keys.lookup(secret)) is not None, "a created key was not found"
    assert await keys.rotate(record["id"], 60.0) is not None
    assert await keys.revoke(record["id"]), "revoke found nothing"

    sessions = SessionStore(client, 60)
    token = await sessions.open("admin")
    await sessions.close(token)

    store = Store.over(client, 600)
    listed = SettingsHolder(load_settings(None, backends=[
        {"name": "c0", "url": "http://127.0.0.1:9", "model": "m"}]))
    async with aiohttp.ClientSession() as session:
        backends = BackendList(client, listed, build_pool(listed, session, store.fleet,
                                                          GatewayMetrics()), store.fleet)
        await backends.add(Backend(name="rt0", url="http://127.0.0.1:10", model="m"), ADMIN)
        assert await backends.remove("rt0", 0.0, ADMIN) is None, "the idle backend stayed"

    files = FileStore(client, tmp, 10**6)
    meta = await files.create("alice", "in.jsonl", "batch", b"{}\n")
    assert [m.id for m in await files.owned("alice")] == [meta.id]
    await files.delete("alice", meta.id)

    batches = BatchStore(client)
    batch = await batches.create("alice", meta.id, "/v1/chat/completions", "24h", None, 1)
    assert await batches.transition(batch["id"], ("validating",), "in_progress",
                                    "in_progress_at")
    assert await batches.lease(batch["id"], "r1", 5.0)
    assert await batches.record(batch["id"], "line-1", {"ok": True}, ok=True)
    assert [b["id"] for b in await batches.running()] == [batch["id"]]
    assert (await batches.page("alice", 10, None))[0][0]["id"] == batch["id"]
    await batches.retire(batch["id"])


async def test_every_script_call_and_transaction_keeps_to_one_slot(
        cluster_nodes: list[str], tmp_path: Path) -> None:
    recorder = Recorder()
    client = connect_cluster(RedisCluster(nodes=cluster_nodes), recorder)
    try:
        for model in MODELS:
            await exercise_store(client, model)
        await exercise_accounts(client, tmp_path)
    finally:
        await client.aclose()
    calls = recorder.script_calls()
    crossing = [(name, keys, sorted({key_slot(k.encode()) for k in keys}))
                for name, keys in calls if len({key_slot(k.encode()) for k in keys}) > 1]
    assert crossing == [], f"script calls over several slots: {crossing}"
    assert all(keys for _, keys in calls), [n for n, k in calls if not k]
    ran = {name for name, _ in calls}
    assert ran == script_files(), f"scripts not exercised: {script_files() - ran}"
    slots = {key_slot(keys[0].encode()) for name, keys in calls if name == "enqueue"}
    assert len(slots) == len(MODELS), f"models share a slot: {slots}"
