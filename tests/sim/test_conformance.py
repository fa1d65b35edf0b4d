"""The simulator against recorded real-vLLM transcripts (no vLLM needed).

``tests/data/vllm-0.32-conformance.json`` was recorded from vLLM 0.32 (CPU) by
``tests/e2e_vllm/test_conformance.py``; the same script runs here against the simulator
and every structural difference outside the allow-list in ``loadtest/sim/conformance.py``
fails the test: frame sequences, field sets and order, status codes, error shapes,
metric families, and when frames are sent relative to scheduling.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.sim.conformance import compare, normalize_frames, record
from tests.sim.conftest import MODEL, ServerFactory

RECORDING = Path(__file__).resolve().parents[1] / "data" / "vllm-0.32-conformance.json"


def recording() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDING.read_text())
    return data


async def test_simulator_matches_recorded_vllm(make_server: ServerFactory) -> None:
    expected = recording()
    server = await make_server(
        model="tiny", profile="cpu-tiny", max_num_seqs=4, max_num_batched_tokens=512,
        max_model_len=expected["server"]["max_model_len"],
    )  # fmt: skip
    actual = await record(server.url, fill=4)
    diffs = compare(expected, actual)
    assert not diffs, "simulator differs from the vLLM recording:\n" + "\n".join(diffs[:60])


def test_recording_shows_what_the_gateway_relies_on() -> None:
    """The facts the relay's pacing depends on, read from the real server's recording."""
    cases = recording()["cases"]
    queued = cases["queued_chat_stream"]
    assert queued["waited_in_engine_queue"] and queued["headers_while_queued"]
    assert queued["frames_while_queued"] == []  # no role frame before scheduling
    assert queued["role_frame_with_first_token"]
    frames = normalize_frames(cases["chat_stream"]["frames"])
    role, token, last = frames["choice 0"]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert token["choices"][0]["delta"] == {"content": "<str>"}
    assert last["choices"][0]["finish_reason"] == "length"  # finish rides on the last token
    assert frames["no choice"] == ["[DONE]"]
    usage = normalize_frames(cases["chat_stream_usage"]["frames"])["no choice"]
    assert usage[0]["choices"] == [] and "usage" in usage[0] and usage[1] == "[DONE]"
    assert cases["abort_chat_stream"]["request_success_delta"] == {}


async def test_chat_role_frame_waits_for_first_output(make_server: ServerFactory) -> None:
    """A queued chat stream gets headers at once, then nothing until the engine runs it;
    the role frame and the first token then arrive in one write."""
    server = await make_server(profile="h100-llama3.1-8b", max_num_seqs=1)
    engine = server.engine
    long = {"model": MODEL, "prompt": "hi", "max_tokens": 100_000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "ignore_eos": True, "stream": True}  # fmt: skip
    async with aiohttp.ClientSession() as http:
        running = await http.post(server.url + "/v1/completions", json=long)
        await running.content.readuntil(b"\n\n")
        queued = await http.post(server.url + "/v1/chat/completions", json=chat)
        assert queued.status == 200 and engine.num_waiting == 1
        read = asyncio.ensure_future(queued.content.readany())
        done, _ = await asyncio.wait({read}, timeout=0.3)
        assert not done, f"a frame before the request was scheduled: {read.result()!r}"
        running.close()
        first = await asyncio.wait_for(read, 10)
        frames = [f for f in first.split(b"\n\n") if f]
        assert len(frames) >= 2, first
        assert json.loads(frames[0][6:])["choices"][0]["delta"] == {
            "role": "assistant", "content": ""}
        assert json.loads(frames[1][6:])["choices"][0]["delta"]["content"]
        queued.close()


def test_a_finish_merged_with_the_last_token_is_excused_only_where_vllm_merged() -> None:
    """vLLM far behind its engine sends every token and the finish reason in one frame
    (seen in CI on a loaded machine); the simulator's token frame before its finishing
    frame is then not a difference. Where vLLM sent them apart, it still is."""
    token = {"id": "<str>", "choices": [{"index": 0, "text": "<str>", "finish_reason": None,
                                         "stop_reason": None}]}
    finish = {"id": "<str>", "choices": [{"index": 0, "text": "<str>",
                                          "finish_reason": "length", "stop_reason": None}]}

    def transcript(frames: list[Any]) -> dict[str, Any]:
        return {"health": 200, "models": {}, "metrics": {}, "cases": {"s": {"frames": frames}}}

    separate, merged = transcript([token, token, finish]), transcript([finish])
    assert compare(merged, separate) == []
    assert compare(separate, separate) == []
    diffs = compare(separate, merged)
    assert diffs and "1 items != 2" in diffs[0], diffs
