"""Disaggregated prefill/decode in the simulator, checked against vLLM's handshake
(``docs/vllm-pd-and-kv-events.md``): the example proxy's two requests, the prefill server's
one-token answer with NixlConnector-shaped ``kv_transfer_params``, the decode server taking
them and computing only the prompt's last token, a colocated server ignoring them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtest.sim.disagg import KVTransfer
from loadtest.sim.server import SimServer
from tests.sim.conftest import MODEL, ServerFactory

FIXTURE = Path(__file__).parents[1] / "data" / "vllm-0.32-kv-events.json"
PROMPT = [(7 * i + 11) % 2000 + 4 for i in range(300)]
REQUEST = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
           "return_token_ids": True}
NIXL_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
             "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size",
             "pp_size", "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode"}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The example proxy's prefill request (toy_proxy_server.py, send_request_to_service)."""
    real = json.loads(FIXTURE.read_text())["pd"]["prefill_request_kv_transfer_params"]
    return {**body, "kv_transfer_params": real, "stream": False, "max_tokens": 1}


async def post(server: SimServer, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.post(
            server.url + "/v1/completions", json={"model": MODEL, **body}) as resp:
        data: dict[str, Any] = await resp.json()
        assert resp.status == 200, data
        return data


def computed_tokens(server: SimServer) -> int:
    """Tokens the server's engine computed (prompt and decode) in every step so far."""
    return sum(step.batch_tokens for step in server._engine.step_log)


async def test_the_handshake_through_a_prefill_and_a_decode_server(
        make_server: ServerFactory) -> None:
    prefill = await make_server(kv_transfer=KVTransfer(role="prefill"))
    decode = await make_server(kv_transfer=KVTransfer(role="decode", latency_s=0.0))
    colocated = await make_server()

    first = await post(prefill, prefill_body(REQUEST))
    real = json.loads(FIXTURE.read_text())["pd"]["prefill_answer"]["body"]
    assert set(first) == set(real), sorted(set(first) ^ set(real))  # vLLM's answer's fields
    assert first["usage"]["completion_tokens"] == 1, first["usage"]
    params = first["kv_transfer_params"]
    assert set(params) == NIXL_KEYS, sorted(params)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False, params
    assert params["remote_engine_id"] == prefill.config.kv_transfer.engine_id, params
    assert params["remote_num_tokens"] == len(PROMPT), params
    assert params["remote_block_ids"] == [list(range(19))], params  # ceil(300 / 16)

    answer = await post(decode, {**REQUEST, "kv_transfer_params": params})
    alone = await post(colocated, REQUEST)
    assert answer["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"], (answer, alone)
    assert answer["usage"] == alone["usage"], (answer["usage"], alone["usage"])
    assert answer["kv_transfer_params"] is None, answer
    # the decode server computed the prompt's last token and 7 more: not the prompt
    assert computed_tokens(decode) == 1 + 7, computed_tokens(decode)
    assert computed_tokens(colocated) == len(PROMPT) + 7, computed_tokens(colocated)
    assert computed_tokens(prefill) == len(PROMPT), computed_tokens(prefill)

    # the pulled blocks are cached there, as vLLM caches received blocks
    again = await post(decode, REQUEST)
    assert again["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"], again
    assert computed_tokens(decode) == 8 + (len(PROMPT) - 18 * 16) + 7, computed_tokens(decode)


@pytest.mark.parametrize("role", ["both", "decode"])
async def test_transfer_params_a_server_does_not_serve_are_ignored(
        make_server: ServerFactory, role: str) -> None:
    server = await make_server(kv_transfer=KVTransfer(role=role))
    answer = await post(server, prefill_body(REQUEST))  # do_remote_decode: a prefill's job
    assert answer["kv_transfer_params"] is None, answer
    assert computed_tokens(server) == len(PROMPT), computed_tokens(server)


async def test_a_colocated_server_computes_a_decode_request_itself(
        make_server: ServerFactory) -> None:
    server = await make_server()
    params = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [[0]]}
    answer = await post(server, {**REQUEST, "kv_transfer_params": params})
    assert answer["kv_transfer_params"] is None, answer
    assert computed_tokens(server) == len(PROMPT) + 7, computed_tokens(server)


def test_transfer_time_and_validation() -> None:
    kv = KVTransfer(role="decode", bytes_per_s=1e9, latency_s=0.5, bytes_per_token=1000)
    assert kv.transfer_s(2000) == pytest.approx(0.5 + 2000 * 1000 / 1e9), kv.transfer_s(2000)
    with pytest.raises(ValueError):
        KVTransfer(role="kv_both")
    with pytest.raises(ValueError):
        KVTransfer(bytes_per_s=0)
