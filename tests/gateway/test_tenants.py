"""Hierarchical fair share end to end: flooding tenants through the gateway, observed in
the order the simulator's engine started their requests."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from loadtest.sim.server import SimServer
from tests.gateway.conftest import GatewayFactory, SimFactory, complete

PER_USER = 24
# requests started out of the fairness order: the gate's in flight (2 running + 1
# waiting), a burst per snapshot not yet seen, the floods' first arrivals before everyone
# queued, and the policy's bound at the tenant level (2 requests)
SLACK = 8
# user -> (key, tag: max_tokens of its requests)
TAGS = {"a1": 20, "a2": 21, "a3": 22, "b1": 23}


def keys(tenants: bool) -> list[dict[str, Any]]:
    return [{"key": f"sk-{user}", "user": user, "priority_class": "interactive",
             **({"tenant": user[0].upper()} if tenants else {})} for user in TAGS]


def b_started(backend: SimServer) -> tuple[int, int]:
    """(B's requests, all requests) the engine started up to B's last one: the window in
    which every flood was backlogged (B's single user drains first)."""
    records = sorted(backend.engine.records.values(),
                     key=lambda r: r.first_scheduled_s or float("inf"))
    order = [r.max_tokens for r in records]
    last_b = len(order) - 1 - order[::-1].index(TAGS["b1"])
    return order[:last_b + 1].count(TAGS["b1"]), last_b + 1


async def flood(backend: SimServer, url: str) -> None:
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(complete(session, url, f"sk-{user}", tag))
                 for _ in range(PER_USER) for user, tag in TAGS.items()]
        await asyncio.gather(*tasks)
    assert len(backend.engine.records) == PER_USER * len(TAGS)


@pytest.mark.parametrize(("b_weight", "share"), [(1.0, 1 / 2), (2.0, 2 / 3)])
async def test_a_tenant_of_one_user_gets_its_tenant_share_not_a_user_share(
        sim: SimFactory, gateway: GatewayFactory, b_weight: float, share: float) -> None:
    """Tenant A (weight 1) has three flooding users, tenant B one: B's user gets B's
    share of the service (a half, or two thirds at weight 2), not a quarter."""
    backend = await sim(max_num_seqs=2)
    gw = await gateway([backend], api_keys=keys(tenants=True),
                       tenants={"A": {"weight": 1.0}, "B": {"weight": b_weight}},
                       classes={"interactive": {"max_waiting": 1}})
    await flood(backend, gw.url)
    b, window = b_started(backend)
    assert b == PER_USER
    # B's share of the starts while everyone was backlogged: its PER_USER requests took
    # PER_USER / share starts, give or take the slack
    assert abs(window - PER_USER / share) <= SLACK / share, (b, window)


async def test_without_tenants_each_user_is_a_tenant(sim: SimFactory,
                                                     gateway: GatewayFactory) -> None:
    """The same floods from keys naming no tenant: every user is its own tenant, so b1
    gets a quarter, as before tenants existed."""
    backend = await sim(max_num_seqs=2)
    gw = await gateway([backend], api_keys=keys(tenants=False),
                       classes={"interactive": {"max_waiting": 1}})
    await flood(backend, gw.url)
    b, window = b_started(backend)
    assert abs(window - PER_USER * 4) <= SLACK * 4, (b, window)


async def test_trusted_end_users_are_users_of_their_keys_tenant(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """An app key of tenant B with trusted end users: its two flooding end users share
    B's half, while tenant A's user (alone) gets A's half."""
    backend = await sim(max_num_seqs=2)
    api_keys = [{"key": "sk-a", "user": "a", "tenant": "A", "priority_class": "interactive"},
                {"key": "sk-app", "user": "app", "tenant": "B", "trusted_end_users": True,
                 "priority_class": "interactive"}]
    gw = await gateway([backend], api_keys=api_keys, classes={"interactive": {"max_waiting": 1}})
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(complete(session, gw.url, key, tag, **extra))
                 for _ in range(PER_USER)
                 for key, tag, extra in (("sk-a", 20, {}), ("sk-app", 21, {"user": "x"}),
                                         ("sk-app", 22, {"user": "y"}))]
        await asyncio.gather(*tasks)
    records = sorted(backend.engine.records.values(),
                     key=lambda r: r.first_scheduled_s or float("inf"))
    order = [r.max_tokens for r in records]
    # while everyone is backlogged, A's one user takes about as many starts as B's two
    # end users together (without the tenant, each end user would be a tenant: A a third)
    window = order[:PER_USER]
    assert abs(window.count(20) - PER_USER / 2) <= SLACK / 2, window
    assert abs(window.count(21) - window.count(22)) <= SLACK / 2, window


async def test_a_trusted_key_minting_an_end_user_per_request_gets_one_tenants_share(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """Issue 43, item 3: a trusted key naming no tenant sends every request as a new end
    user while bob floods too. Its end users are users of its own tenant (named after the
    key's user), so it gets half the starts while both are backlogged, not a share per end
    user (84 of the first 100 before)."""
    backend = await sim(max_num_seqs=2)
    gw = await gateway([backend], classes={"interactive": {"max_waiting": 1}})
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(complete(session, gw.url, key, tag, **extra))
                 for i in range(PER_USER)
                 for key, tag, extra in (("sk-bob", 20, {}),
                                         ("sk-app", 21, {"user": f"minted-{i}"}))]
        await asyncio.gather(*tasks)
    records = sorted(backend.engine.records.values(),
                     key=lambda r: r.first_scheduled_s or float("inf"))
    window = [r.max_tokens for r in records][:PER_USER]
    app = window.count(21)
    assert abs(app - PER_USER / 2) <= SLACK / 2, f"the app took {app} of {PER_USER}: {window}"


def started_while_both_backlogged(backend: SimServer, tags: tuple[int, int]) -> list[int]:
    """The tags of the requests the engine started, in order, up to the first flood's last
    start (both floods were backlogged until then)."""
    records = sorted(backend.engine.records.values(),
                     key=lambda r: r.first_scheduled_s or float("inf"))
    order = [r.max_tokens for r in records]
    last = min(len(order) - 1 - order[::-1].index(tag) for tag in tags)
    return order[:last + 1]


@pytest.mark.parametrize(("min_share", "low", "high"), [(0.3, 0.3, 0.35), (0.0, 0.05, 0.15)])
async def test_a_light_tenant_with_a_min_share_gets_it_against_a_heavy_one(
        sim: SimFactory, gateway: GatewayFactory, min_share: float, low: float,
        high: float) -> None:
    """Tenant L (weight 1, min_share 0.3) floods against tenant H (weight 9): while both
    are backlogged L gets its guaranteed 0.3 of the starts (less one start at most: it
    is owed when below its share, so served at the next dispatch), not the tenth its
    weight gives it, which it gets without the share."""
    backend = await sim(max_num_seqs=2)
    api_keys = [{"key": "sk-l", "user": "l", "tenant": "L", "priority_class": "interactive"},
                {"key": "sk-h", "user": "h", "tenant": "H", "priority_class": "interactive"}]
    gw = await gateway([backend], api_keys=api_keys,
                       tenants={"L": {"weight": 1.0, "min_share": min_share},
                                "H": {"weight": 9.0}},
                       classes={"interactive": {"max_waiting": 1}})
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(complete(session, gw.url, key, tag))
                 for _ in range(40) for key, tag in (("sk-l", 20), ("sk-h", 21))]
        tasks += [asyncio.create_task(complete(session, gw.url, "sk-h", 21))
                  for _ in range(40)]
        await asyncio.gather(*tasks)
    window = started_while_both_backlogged(backend, (20, 21))
    share = window.count(20) / len(window)
    assert low - 1 / len(window) <= share <= high, (
        f"L took {window.count(20)} of {len(window)} starts ({share:.3f}) with min_share "
        f"{min_share}: {window}")
