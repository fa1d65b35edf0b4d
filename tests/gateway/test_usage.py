"""Usage accounting end to end: requests through the openai SDK, the admin export as JSON
and CSV, the dashboard's panel data and the per-tenant metrics."""

from __future__ import annotations

import csv
import io
import time
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from gateway.scheduling.usage import day_of
from gateway.storage.keys import ModelKeys
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, call
from tests.ops.conftest import until

ADMIN = "sk-admin"
KEYS = [{"key": "sk-r1", "user": "rae", "tenant": "research", "limits": {"rpm": 2}},
        {"key": "sk-r2", "user": "ron", "tenant": "research"},
        {"key": "sk-p1", "user": "pia", "tenant": "product", "priority_class": "interactive"},
        {"key": "sk-solo", "user": "sol"}]
TENANTS = {"research": {"weight": 2, "limits": {"daily_tokens": 100000}},
           "product": {"weight": 1}}


async def test_usage_export_dashboard_and_metrics(sim: SimFactory, gateway: GatewayFactory,
                                                  http: aiohttp.ClientSession,
                                                  redis: aioredis.Redis) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend], api_keys=KEYS, tenants=TENANTS, admin_keys=[ADMIN],
                       usage_retention_days=30)
    expected: dict[tuple[str, str], dict[str, int]] = {}

    async def use(key: str, tenant: str, user: str, n: int, max_tokens: int) -> None:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        row = expected.setdefault((tenant, user), {"requests": 0, "prompt_tokens": 0,
                                                   "completion_tokens": 0, "errors": 0})
        try:
            for _ in range(n):
                row["requests"] += 1
                try:
                    answer = await client.completions.create(
                        model=MODEL, prompt="count me in", max_tokens=max_tokens,
                        extra_body={"ignore_eos": True})
                except openai.RateLimitError:
                    row["errors"] += 1
                    continue
                assert answer.usage is not None
                row["prompt_tokens"] += answer.usage.prompt_tokens
                row["completion_tokens"] += answer.usage.completion_tokens
        finally:
            await client.close()

    await use("sk-r1", "research", "rae", 3, 5)  # the third is over rpm 2: an error
    await use("sk-r2", "research", "ron", 2, 7)
    await use("sk-p1", "product", "pia", 1, 3)
    await use("sk-solo", "sol", "sol", 1, 2)  # no tenant: its own, named after the user
    assert expected["research", "rae"]["errors"] == 1

    status, body, _ = await call(http, "GET", gw.url + "/admin/usage?group_by=tenant,user",
                                 key=ADMIN)
    assert status == 200, body
    today = time.strftime("%Y-%m-%d", time.gmtime())
    assert body["from"] == body["to"] == today and body["group_by"] == ["tenant", "user"]
    got = {(r["tenant"], r["user"]): {k: r[k] for k in ("requests", "prompt_tokens",
                                                        "completion_tokens", "errors")}
           for r in body["data"]}
    assert got == expected
    assert all(r["total_tokens"] == r["prompt_tokens"] + r["completion_tokens"]
               for r in body["data"])
    totals = [r["total_tokens"] for r in body["data"]]
    assert totals == sorted(totals, reverse=True)

    # by tenant, over an explicit range, as CSV
    url = gw.url + f"/admin/usage?group_by=tenant&from={today}&to={today}&format=csv"
    async with http.get(url, headers={"Authorization": f"Bearer {ADMIN}"}) as resp:
        assert resp.status == 200 and resp.content_type == "text/csv"
        text = await resp.text()
    rows = list(csv.DictReader(io.StringIO(text)))
    assert list(rows[0]) == ["tenant", "requests", "prompt_tokens", "cached_prompt_tokens",
                             "completion_tokens", "errors", "cancelled", "total_tokens"]
    research = next(r for r in rows if r["tenant"] == "research")
    assert int(research["requests"]) == 5 and int(research["errors"]) == 1
    assert int(research["completion_tokens"]) == sum(
        v["completion_tokens"] for (t, _), v in expected.items() if t == "research")

    # by model and class; and the key dimension names keys by id, never by secret
    status, body, _ = await call(http, "GET", gw.url + "/admin/usage?group_by=class,key",
                                 key=ADMIN)
    assert status == 200
    assert {r["class"] for r in body["data"]} == {"default", "interactive"}
    assert all(r["key"].startswith("cfg-") for r in body["data"])
    assert "sk-r1" not in str(body)

    # bad queries are 400s in OpenAI's format
    for query in ("group_by=tenant,color", "from=2026-13-01", "from=2026-02-02&to=2026-02-01",
                  "format=xml"):
        status, body, _ = await call(http, "GET", gw.url + "/admin/usage?" + query,
                                     key=ADMIN)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", query
    status, _, _ = await call(http, "GET", gw.url + "/admin/usage", key="sk-r2")
    assert status == 403

    # kept for the configured retention
    ttl = await redis.ttl(ModelKeys(MODEL).usage(day_of(time.time())))
    assert 30 * 86400 < ttl <= 31 * 86400

    # the dashboard's panel: top tenants and users today, tenant budgets used
    status, state, _ = await call(http, "GET", gw.url + "/admin/state", key=ADMIN)
    assert status == 200
    panel = state["usage_today"]
    assert panel["tenants"][0]["tenant"] == "research"
    assert {(u["tenant"], u["user"]) for u in panel["users"]} == set(expected)
    (budget,) = panel["budgets"]
    research_tokens = sum(v["prompt_tokens"] + v["completion_tokens"]
                          for (t, _), v in expected.items() if t == "research")
    assert budget == {"tenant": "research", "period": "daily", "used": research_tokens,
                      "limit": 100000}

    # per-tenant metrics
    registry = gw.services.metrics.registry

    def sample(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    assert sample("fairgate_tenant_tokens_total", tenant="research",
                  kind="completion") == 5 + 5 + 7 + 7
    assert sample("fairgate_tenant_requests_total", tenant="research",
                  priority_class="default", outcome="error") == 1
    assert sample("fairgate_tenant_limit_refusals_total", tenant="research",
                  code="rate_limit_exceeded") == 1


def test_tenant_series_are_bounded() -> None:
    from gateway.core.metrics import GatewayMetrics

    metrics = GatewayMetrics(top_users=2)
    for i in range(10):
        metrics.usage.on_tenant_usage(f"t{i}", "default", 1, 1, False)
    labels: set[Any] = {s.labels["tenant"] for m in metrics.registry.collect()
                        if m.name == "fairgate_tenant_tokens" for s in m.samples}
    assert labels == {"t0", "t1", "other"}


def test_counts_name_each_requests_day_and_row_as_written() -> None:
    """The hash fields and day key a request adds to (kept between requests) are those
    of its own UTC day and row: a request a millisecond past midnight goes to the next
    day's hash, another key's or class's to its own fields."""
    import json

    from gateway.core.settings import ApiKey
    from gateway.scheduling.usage import UsageLedger

    ledger = UsageLedger(None, retention_days=3)  # type: ignore[arg-type]  # counts only
    alice = ApiKey(key="sk-alice-key-1", user="alice", tenant="lab", id="k1")
    bob = ApiKey(key="sk-bob-key-123", user="bob", id="k2")
    midnight = 1_700_006_400.0  # 2023-11-15T00:00:00Z
    seen = []
    for key, klass, now in ((alice, "default", midnight - 0.001), (alice, "default", midnight),
                            (bob, "batch", midnight + 1), (alice, "batch", midnight - 86400)):
        usage = ledger.counts(key, MODEL, klass, 5, 2, error=False, now=now)
        row = [key.tenant_name, key.user, key.id, MODEL, klass]
        expected = {json.dumps([*row, name]): amount for name, amount in
                    (("requests", 1), ("prompt_tokens", 5), ("completion_tokens", 2))}
        assert usage.key == ModelKeys(MODEL).usage(day_of(now)), (now, usage.key)
        assert usage.counts == expected, (row, usage.counts)
        seen.append(usage.key)
    assert seen[0] == seen[3] != seen[1] == seen[2], seen


@pytest.mark.parametrize("value", ["=cmd()", "+1", "-2", "@x", "\t=cmd()", "\r=cmd()"])
def test_csv_cells_never_run_as_formulas(value: str) -> None:
    from gateway.scheduling.usage import to_csv

    text = to_csv([{"tenant": value, "requests": 1, "prompt_tokens": 0,
                    "completion_tokens": 0, "errors": 0, "cancelled": 0, "cached_prompt_tokens": 0,
                    "total_tokens": 0}], ["tenant"])
    [row] = list(csv.reader(io.StringIO(text, newline="")))[1:]
    assert row[0] == "'" + value, f"cell {row[0]!r} for {value!r}"


async def test_a_client_that_hangs_up_counts_as_cancelled_not_as_an_error(
        sim: SimFactory, gateway: GatewayFactory, http: aiohttp.ClientSession) -> None:
    """The caller ended it: usage says cancelled, not errors (a cancelled batch's lines
    end the same way: their tasks are cancelled)."""
    gw = await gateway([await sim()], api_keys=KEYS, admin_keys=[ADMIN])
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    async with http.post(gw.url + "/v1/completions", json=body,
                         headers={"Authorization": "Bearer sk-r2"}) as resp:
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: {"), first
    # the response is closed: the client hung up mid-stream

    async def recorded() -> bool:
        _, usage, _ = await call(http, "GET", gw.url + "/admin/usage?group_by=user", key=ADMIN)
        return any(r["user"] == "ron" and r["requests"] == 1 for r in usage["data"])
    await until(recorded, what="the hung-up request's usage")
    _, usage, _ = await call(http, "GET", gw.url + "/admin/usage?group_by=user", key=ADMIN)
    ron = next(r for r in usage["data"] if r["user"] == "ron")
    assert (ron["cancelled"], ron["errors"]) == (1, 0), ron
