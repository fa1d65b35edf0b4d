"""Disaggregated prefill/decode as vLLM's NixlConnector does it (docs/vllm-pd-and-kv-events.md).

A server's ``role`` is its connector's ``kv_role``: ``both`` (no connector: today's
colocated server, ``kv_transfer_params`` ignored and answered ``null``), ``prefill``
(``kv_producer``) or ``decode`` (``kv_consumer``).

- A **prefill** server given ``kv_transfer_params.do_remote_decode`` computes the prompt
  (the router asks for ``max_tokens: 1``) and answers, in a whole (non-streaming) body,
  the parameters a decode server pulls the blocks with, shaped as NixlConnector's.
- A **decode** server given ``kv_transfer_params.do_remote_prefill`` waits the modelled
  transfer time outside the batch (vLLM keeps such a request waiting for its remote KV),
  then admits the request with every prompt token but the last computed: only that one
  (for the first token's logits) and the output are computed here.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

ROLES = ("both", "prefill", "decode")
# KV of Llama-3.1-8B in bf16: 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes
KV_BYTES_PER_TOKEN = 131_072
DEFAULT_TRANSFER_BYTES_PER_S = 25e9  # one 200 Gb/s RDMA link, roughly
DEFAULT_TRANSFER_LATENCY_S = 0.002  # NIXL's handshake and notification, per request


@dataclass(frozen=True)
class KVTransfer:
    """A server's P/D role and the modelled cost of pulling a prompt's KV."""

    role: str = "both"
    bytes_per_s: float = DEFAULT_TRANSFER_BYTES_PER_S
    latency_s: float = DEFAULT_TRANSFER_LATENCY_S
    bytes_per_token: int = KV_BYTES_PER_TOKEN
    engine_id: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.bytes_per_s <= 0 or self.latency_s < 0:
            raise ValueError("a KV transfer needs a positive rate and a latency of at least 0")
        if not self.engine_id:
            object.__setattr__(self, "engine_id", str(uuid.uuid4()))

    def transfer_s(self, tokens: int) -> float:
        """How long pulling ``tokens`` tokens' KV takes."""
        return self.latency_s + tokens * self.bytes_per_token / self.bytes_per_s

    def pulls(self, body: dict[str, Any]) -> bool:
        """True when this server (a decode server) pulls the prompt's KV for ``body``."""
        return self.role == "decode" and _flag(body, "do_remote_prefill")

    def serves_remote_decode(self, body: dict[str, Any]) -> bool:
        """True when this server (a prefill server) answers transfer parameters."""
        return self.role == "prefill" and _flag(body, "do_remote_decode")

    def answer_params(
        self, request_id: str, host: str, prompt_tokens: int, block_size: int
    ) -> dict[str, Any]:
        """The prefill server's ``kv_transfer_params`` (NixlConnector's shape)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(-(-prompt_tokens // block_size)))],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": host,
            "remote_port": 5600,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
        }


def _flag(body: dict[str, Any], name: str) -> bool:
    params = body.get("kv_transfer_params")
    return isinstance(params, dict) and params.get(name) is True
