"""What fairgate relies on, checked against a real vLLM (CPU): /metrics and priorities."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.vllm_metrics import TPOT_HISTOGRAMS, parse_metrics
from tests.e2e_vllm.conftest import MAX_NUM_SEQS, VllmServer
from tests.e2e_vllm.helpers import complete, completion_body, limits, scrape, wait_until

pytestmark = pytest.mark.vllm


async def test_parse_real_metrics(vllm_server: VllmServer) -> None:
    async with httpx.AsyncClient(limits=limits(64)) as client:
        text = (await client.get(vllm_server.url + "/metrics")).text
        assert "vllm:num_requests_running" in text
        before = parse_metrics(text)
        assert before.running >= 0 and before.waiting >= 0
        assert 0.0 <= before.kv_usage <= 1.0
        base = {h: before.sums.get(h, (0.0, 0.0))[1] for h in TPOT_HISTOGRAMS}

        url = vllm_server.api + "/completions"
        # Gauges were parsed above; catching them non-zero during a burst is left to the
        # gateway tests (the 2-core API server answers /metrics too irregularly here).
        # Histograms: 48 requests for 16 slots, so most of them also wait in the queue.
        url = vllm_server.api + "/completions"
        tasks = [
            asyncio.create_task(
                complete(client, url, f"r{i}", completion_body(vllm_server.model, 512),
                         retry_dropped=True)
            )
            for i in range(3 * MAX_NUM_SEQS)
        ]
        done = await asyncio.gather(*tasks)
        assert all(d.completion_tokens == 512 for d in done)

        await _until_idle(client, vllm_server, timeout_s=10)
        after = await scrape(client, vllm_server.url)
        # The per-request TPOT histogram is the one the gates use: present and grown.
        tpot = "vllm:request_time_per_output_token_seconds"
        assert tpot in after.sums, sorted(after.sums)
        total, count = after.sums[tpot]
        assert count - base[tpot] >= 2 * MAX_NUM_SEQS
        assert total > 0 and 0 < total / count < 5.0
        assert "vllm:inter_token_latency_seconds" in after.sums
        # 48 requests for 16 slots: most of them waited, as the queue-time histogram shows
        queued = _histogram_sum(await client.get(vllm_server.url + "/metrics"),
                                "vllm:request_queue_time_seconds")
        assert queued > 0


def _histogram_sum(resp: httpx.Response, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(resp.text)
               for s in f.samples if s.name == name + "_sum")


async def test_priority_honoured(vllm_server: VllmServer) -> None:
    """16 running + a queue at priority 10: a priority-0 newcomer jumps the queue.

    It takes the first slot that frees, so every flood request still waiting when it
    arrived finishes after it; under FCFS none would. Order, not wall time. On 2 shared
    cores the API server accepts requests and delivers responses with lags of seconds,
    so the waves are long (1536 tokens each) to keep them apart; and now and then the
    newcomer reaches the engine only after the queue drained (seen: 1 run in 4 with 0
    overtaken; and 3 in a row once, on a slower host right after the metrics burst). So the
    experiment runs up to 5 times: broken priorities fail every time. Once the newcomer
    has its answer the flood still running or queued is what finishes after it: it is
    counted then and cancelled (vLLM aborts it), not waited for.
    """
    results: list[object] = []
    for _ in range(5):
        try:
            waiting, after = await _flood_then_vip(vllm_server)
        except TimeoutError:  # the flood never filled the engine in time: inconclusive
            results.append("setup timed out")
            continue
        results.append((waiting, after))
        # Priority: after == waiting (16 or 32); FCFS: after == 0. Half of it as the bar.
        if after >= waiting / 2:
            return
    raise AssertionError(f"the priority-0 request never overtook the queue: {results}")


async def _flood_then_vip(vllm_server: VllmServer) -> tuple[float, int]:
    flood_n, flood_tokens = 3 * MAX_NUM_SEQS, 1536
    url = vllm_server.api + "/completions"
    async with httpx.AsyncClient(limits=limits(flood_n + 8)) as client:
        flood = [
            asyncio.create_task(
                complete(
                    client,
                    url,
                    f"flood{i}",
                    completion_body(vllm_server.model, flood_tokens, priority=10),
                    retry_dropped=True,
                )
            )
            for i in range(flood_n)
        ]
        waiting = 0.0

        async def queued() -> bool:
            nonlocal waiting
            try:
                m = await scrape(client, vllm_server.url)
            except httpx.HTTPError:  # the busy CPU API server dropped the scrape: ask again
                return False
            waiting = m.waiting
            return m.running == MAX_NUM_SEQS and m.waiting >= MAX_NUM_SEQS

        try:
            await wait_until(queued, timeout_s=90, interval_s=0.05)
        except TimeoutError:
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
            raise
        vip = await complete(client, url, "vip", completion_body(vllm_server.model, 8, priority=0),
                             retry_dropped=True)
        # No await since complete() took vip.at: the flood requests done now are those that
        # finished before the VIP, every other one finishes after it. That count is all the
        # experiment needs, so the rest are cancelled, not waited for (two more waves of
        # 1536 tokens): their connections close and vLLM aborts them (with_cancellation
        # on its /v1/completions).
        done = [task for task in flood if task.done()]
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        # (result(): a flood request that failed fails the test, as before)
        before_vip = sum(1 for task in done if task.result().at <= vip.at)
        await _until_idle(client, vllm_server)
    return waiting, flood_n - before_vip


async def _until_idle(client: httpx.AsyncClient, vllm_server: VllmServer,
                      timeout_s: float = 300.0) -> None:
    """Until vLLM runs and queues nothing (a finished or cancelled flood over): what comes
    next starts on an idle server."""
    async def idle() -> bool:
        try:
            m = await scrape(client, vllm_server.url)
        except httpx.HTTPError:  # the busy CPU API server dropped the scrape: ask again
            return False
        return m.running == 0 and m.waiting == 0

    try:
        await wait_until(idle, timeout_s=timeout_s, interval_s=0.2)
    except TimeoutError:
        raise AssertionError(f"vLLM still ran or queued requests after {timeout_s:.0f} s "
                             "(its flood over or cancelled)") from None
