"""fairgate in front of a real vLLM (CPU): pacing keeps vLLM's queue short, newcomers
overtake a flood. The same flood sent straight to vLLM piles up in its waiting queue."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.core.settings import Backend
from gateway.http.server import GatewayServer
from tests.e2e_vllm.conftest import (
    FOUR_SLOTS,
    SharedServer,
    VllmServer,
    off_cpus,
    server_cpus,
)
from tests.e2e_vllm.helpers import (
    PACED_RUNS,
    Finished,
    QueueLength,
    Sampler,
    complete,
    completion_body,
    histogram_totals,
    limits,
    wait_until,
)
from tests.gateway.conftest import gateway_settings

pytestmark = pytest.mark.vllm

FLOOD = 64
FLOOD_TOKENS = 128
MAX_WAITING = 3  # the interactive class's gate (default settings)
SMALL_BATCH = FOUR_SLOTS  # --max-num-seqs of the pacing tests' server
# vLLM's waiting gauge may show one request more for an engine step: a request that
# entered a slot freed by one that just finished (the gate sent it when the first left)
MAX_SEEN = MAX_WAITING + 1
BACKEND = "cpu0"


@pytest.fixture(scope="module")
def small_batch(request: pytest.FixtureRequest,
                four_slots: SharedServer) -> Iterator[VllmServer]:
    """A server with a batch of SMALL_BATCH sequences, which a flood fills on 2 cores (the
    session's 16 slots it does not: the CPU API server delivers answers late), so the
    pacing tests see requests wait behind a full batch: the package's 4-slot server
    (``four_slots`` in conftest.py, test_locality_vllm's second server after this module;
    these tests judge it by their own requests and by differences of its counters)."""
    try:
        yield four_slots.get()
    finally:
        four_slots.release(request)


@pytest.fixture
async def gw_small(
    small_batch: VllmServer, redis: aioredis.Redis, redis_url: str
) -> AsyncIterator[GatewayServer]:
    # the server has a CPU of its own (conftest's four_slots), the gateway, the clients and
    # the samplers the others: on 2 cores an engine on both starves them (and their
    # /metrics samples) for seconds
    with off_cpus(server_cpus()):
        async with paced_gateway(small_batch, redis_url) as server:
            yield server


def queue_length(vllm_server: VllmServer, gw: GatewayServer) -> QueueLength:
    """vLLM's queue sampled every 50 ms, with the gateway's exact count of requests at it."""
    async def inflight() -> int:
        states = await gw.services.store.fleet.backend_states(vllm_server.model, [BACKEND])
        return states[BACKEND].inflight

    return QueueLength(Sampler(vllm_server.url, 0.05, inflight))


@contextlib.asynccontextmanager
async def paced_gateway(vllm_server: VllmServer, redis_url: str
                        ) -> AsyncIterator[GatewayServer]:
    """A gateway in front of one real vLLM, default pacing, scrape settings for the CPU
    build's slow /metrics."""
    settings = gateway_settings(
        redis_url,
        [vllm_server],
        scrape_interval_s=0.05,
        # vLLM's API server answers /metrics slowly while 2 cores are busy: do not call
        # the backend unhealthy or the snapshot stale for that.
        scrape_timeout_s=5.0,
        snapshot_stale_s=10.0,
        unhealthy_after_failures=20,
    )
    # gateway_settings names the backends' model after the simulator's: serve "tiny".
    backend = Backend(name=BACKEND, url=vllm_server.url, model=vllm_server.model)
    server = GatewayServer(settings.model_copy(update={"backends": [backend]}))
    await server.start()
    try:
        for handle in server.services.pool.handles.values():
            await asyncio.wait_for(handle.scraped.wait(), 30)
        yield server
    finally:
        await server.stop()


async def flood_and_newcomer(
    base: str,
    model: str,
    headers_flood: dict[str, str],
    headers_new: dict[str, str],
    sampler: Sampler | QueueLength,
    direct: bool = False,
    queued: Callable[[], Awaitable[bool]] | None = None,
) -> tuple[list[Finished], Finished]:
    """A flood of FLOOD completions, then one newcomer once the flood is queued: by
    ``queued`` when given (the gateway's own queue), else once vLLM reports it running."""
    url = base + "/v1/completions"
    async with httpx.AsyncClient(limits=limits(FLOOD + 8)) as client, sampler:
        flood = [
            asyncio.create_task(
                complete(client, url, f"a{i}", completion_body(model, FLOOD_TOKENS), headers_flood,
                         retry_dropped=direct)
            )
            for i in range(FLOOD)
        ]

        # let the flood get queued (in the gateway or in vLLM) before the newcomer comes.
        # (Through the gateway vLLM does not fill its 16 slots here: each lagging /metrics
        # snapshot lets only max_waiting more through; seen: running <= 7, waiting 0.)
        async def busy() -> bool:
            return max(sampler.running, default=0) >= 1

        # (vLLM's CPU API server may answer no /metrics at all for a while during the
        # burst: then, straight to vLLM, the newcomer simply comes later and the
        # assertions read the samples. Through the gateway its own queue says it: seen in
        # CI, no sample in 60 s, and the newcomer came after the whole flood had ended.)
        with contextlib.suppress(TimeoutError):
            await wait_until(queued or busy, timeout_s=60)
        await asyncio.sleep(0.3)
        newcomer = await complete(client, url, "bob", completion_body(model, 16), headers_new,
                                  retry_dropped=direct)
        done = await asyncio.gather(*flood)
    return done, newcomer


async def test_gateway_paces_real_vllm(small_batch: VllmServer, gw_small: GatewayServer) -> None:
    vllm_server, gw = small_batch, gw_small

    async def flood_queued() -> bool:  # most of the flood waits in the gateway
        depths = await gw.services.store.reads.depths(vllm_server.model)
        return depths["interactive"] >= FLOOD // 2

    for _ in range(PACED_RUNS):  # again only while the sampler was starved (helpers)
        through = queue_length(vllm_server, gw)
        done, bob = await asyncio.wait_for(
            flood_and_newcomer(
                gw.url,
                vllm_server.model,
                {"Authorization": "Bearer sk-alice"},
                {"Authorization": "Bearer sk-bob"},
                through,
                queued=flood_queued,
            ),
            240,
        )
        if through.fed():
            break
    assert all(d.completion_tokens == FLOOD_TOKENS for d in done)
    assert bob.completion_tokens == 16
    # the newcomer overtakes the flooder's queue
    assert bob.at < max(d.at for d in done)
    after_bob = sum(1 for d in done if d.at > bob.at)
    assert after_bob >= FLOOD // 4, after_bob
    # pacing: vLLM's waiting queue stays at the gate's threshold
    through.assert_paced(MAX_WAITING, MAX_SEEN)


async def test_direct_flood_piles_up(vllm_server: VllmServer) -> None:
    """The baseline: the same flood straight to vLLM piles up in its waiting queue.
    (A test of its own, so no gateway scrapes the busy 2-core API server meanwhile.)

    Judged by vLLM's own cumulative queue-time histogram, not by the sampled gauge alone:
    the CPU build's API server may answer no /metrics during the whole burst (seen in CI:
    every sample 0), while the requests still sat in its queue."""
    hists = ("vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds")
    before = await histogram_totals(vllm_server.url, hists)
    direct = Sampler(vllm_server.url, 0.05)
    done_d, _ = await asyncio.wait_for(
        flood_and_newcomer(vllm_server.url, vllm_server.model, {}, {}, direct, direct=True), 240
    )
    assert all(d.completion_tokens == FLOOD_TOKENS for d in done_d)
    after = await histogram_totals(vllm_server.url, hists)
    (q_sum, q_n), (i_sum, i_n) = (
        (after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in hists)
    assert q_n >= FLOOD and i_n >= FLOOD, (q_n, i_n)
    # 64 requests for 16 slots: most wait one or more generations; measured ≈ 1.5×
    queued_vs_inference = (q_sum / q_n) / (i_sum / i_n)
    assert queued_vs_inference >= 0.5, (
        f"mean queue time {q_sum / q_n:.2f} s vs inference {i_sum / i_n:.2f} s; sampled "
        f"max waiting {max(direct.waiting, default=None)} of {len(direct.waiting)} samples")


async def stream_chat(client: httpx.AsyncClient, url: str, model: str) -> int:
    """One streamed chat completion; returns the content frames received."""
    body = {"model": model, "messages": [{"role": "user", "content": "the fair queue"}],
            "max_tokens": FLOOD_TOKENS // 2, "ignore_eos": True, "temperature": 0.0,
            "stream": True}
    frames = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers={"Authorization": "Bearer sk-alice"},
                             timeout=300) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            frames += line.startswith("data: {") and '"content":"' in line
    return frames


async def test_gateway_paces_a_chat_stream_flood(small_batch: VllmServer,
                                                 gw_small: GatewayServer) -> None:
    """vLLM sends the chat role frame with the first output; the gate slot frees at the
    first generated token either way, so a chat flood keeps vLLM's queue as short as a
    completions one."""
    vllm_server, gw = small_batch, gw_small
    for _ in range(PACED_RUNS):  # again only while the sampler was starved (helpers)
        queue = queue_length(vllm_server, gw)
        async with httpx.AsyncClient(limits=limits(FLOOD // 2 + 4)) as client, queue:
            frames = await asyncio.wait_for(asyncio.gather(*(
                stream_chat(client, gw.url, vllm_server.model) for _ in range(FLOOD // 2))),
                240)
        assert all(n >= 1 for n in frames)
        if queue.fed():
            break
    queue.assert_paced(MAX_WAITING, MAX_SEEN)
