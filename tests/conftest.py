"""Shared fixtures: a real Redis server (embedded Valkey, or FAIRGATE_TEST_REDIS_URL).

Temporary files: the session works in one directory, removed at its end, so a run leaves
nothing under /tmp. ``tmp_path``/``tmp_path_factory`` live in it (unless ``--basetemp``
names another place, which pytest then keeps), and so does ``TMPDIR`` for this process and
every process it starts (gateways, embedded Redis, Chromium, vLLM and its compiler caches).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI

from gateway.core.logs import configure_logging
from gateway.storage.embedded_redis import EmbeddedRedis
from loadtest.valkey_cluster import ValkeyCluster

_SESSION_TMP = pytest.StashKey[tuple[Path, str | None]]()


@pytest.hookimpl(tryfirst=True)  # before pytest's tmpdir plugin reads --basetemp
def pytest_configure(config: pytest.Config) -> None:
    root = Path(tempfile.mkdtemp(prefix="fairgate-tests-"))
    config.stash[_SESSION_TMP] = (root, os.environ.get("TMPDIR"))
    if config.option.basetemp is None:
        config.option.basetemp = str(root / "pytest")
    (root / "tmp").mkdir()
    os.environ["TMPDIR"] = tempfile.tempdir = str(root / "tmp")
    # the gateways run in the test processes log as `fairgate serve` does, not through
    # structlog's defaults: those render each exception as a highlighted rich traceback,
    # which stood the event loop still for over 8 s on a loaded machine (a store outage
    # logs a few) and failed the cluster failover test's control streams
    configure_logging(cache=False)


def pytest_unconfigure(config: pytest.Config) -> None:
    root, tmpdir = config.stash.get(_SESSION_TMP, (None, None))
    if root is None:
        return
    tempfile.tempdir = None
    if tmpdir is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = tmpdir
    shutil.rmtree(root, ignore_errors=True)


SLOW_TIERS = ("chaos", "bench", "fuzz", "e2e_vllm")
# run by one worker, one after the other (``pytest_xdist_make_scheduler``)
ENGINE_BOUND = ("tests/e2e_vllm/", "tests/bench/")
# ... but for these, which any free worker takes: in-process checks of a few seconds that
# start no simulator, gateway or server and measure no window (a file, or a test's node id)
ENGINE_FREE = frozenset({
    "tests/bench/test_report.py",  # a report written from fixed rows
    "tests/bench/test_autoscale_smoke.py::test_threshold_rule",  # the rule, pure
    "tests/bench/test_smoke.py::test_newcomer_one_endpoint",  # option parsing, stubbed phases
    "tests/bench/test_smoke.py::test_scheduler",  # the Store on the worker's own Redis
})


def engine_bound(nodeid: str) -> bool:
    """Does this test run on the engines' worker?"""
    test = nodeid.split("[", 1)[0]
    return nodeid.startswith(ENGINE_BOUND) and not (
        test in ENGINE_FREE or test.split("::", 1)[0] in ENGINE_FREE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the slow tiers ``slow`` (``make test-fast``: ``-m "not slow"``)."""
    root = Path(__file__).resolve().parent
    slow = {root / tier for tier in SLOW_TIERS}
    for item in items:
        if slow & set(Path(str(item.fspath)).resolve().parents):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With workers (``-n``): each test goes to the next free worker, except the real-vLLM
    tier and the benchmark smoke tests, which one worker runs one after the other: the
    tier runs whole there (one install, its servers started once), and no benchmark runs
    beside a vLLM engine taking both cores (a quick fairness run beside it completed
    nothing in its window, CI 2026-12-02). The few in-process checks of ``ENGINE_FREE``
    go to any free worker. xdist's own ``--dist loadgroup`` would do
    this, but it renames node ids in a way pytest 9 no longer reads."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "engines" if engine_bound(nodeid) else nodeid

    return TierScheduling(config, log)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    external = os.environ.get("FAIRGATE_TEST_REDIS_URL")
    if external:
        yield external
        return
    with EmbeddedRedis(data_dir=tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client on a freshly flushed database."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()


OpenAIClients = Callable[..., AsyncOpenAI]


@pytest.fixture
async def openai_clients() -> AsyncIterator[OpenAIClients]:
    """``make(url, key, **options)``: an ``openai.AsyncOpenAI`` on ``url + "/v1"`` (no
    retries unless ``options`` say), closed when the test ends. A client left to the
    garbage collector closes itself on whatever event loop runs then: a later test's,
    where its connections' closed loop logs "Task exception was never retrieved"."""
    made: list[AsyncOpenAI] = []

    def make(url: str, key: str, **options: object) -> AsyncOpenAI:
        made.append(AsyncOpenAI(base_url=url + "/v1", api_key=key,
                                **{"max_retries": 0, **options}))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for client in made:
        await client.close()


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """A Valkey Cluster on loopback (3 masters, 3 replicas), shared by the session's
    tests that need one; a test that kills a node starts its own."""
    with ValkeyCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
async def cluster_nodes(valkey_cluster: ValkeyCluster) -> list[str]:
    """The shared cluster's nodes (``host:port``), every master flushed."""
    for node in valkey_cluster.live():
        if node.call("ROLE")[0] == "master":
            node.call("FLUSHALL")
    return valkey_cluster.addresses
