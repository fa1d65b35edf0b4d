"""Hardware/model profiles and the roofline step-time model.

A profile is a row of numbers, never a code branch. The step time of one engine
iteration is a roofline estimate::

    bytes = weight_bytes + kv_bytes_per_token * context_tokens
    flops = flops_per_token * batch_tokens
    t     = max(bytes / mem_bw_bytes_s, flops / peak_flops) + step_overhead_s

``batch_tokens`` counts every token computed in the step (one per decode, a chunk per
prefill); ``context_tokens`` counts the KV entries read by attention (each scheduled
request's context up to and including its new tokens).

H100 SXM + Llama-3.1-8B (bf16): 16.06 GB of weights over 3.35 TB/s gives a 4.8 ms decode
step; a 2,000-token prefill costs 2·8.03e9·2000 FLOP at 989 TFLOP/s ≈ 32.5 ms; the ridge
point (memory time == compute time) sits at ≈ 295 tokens per step.

LoRA (an assumption, documented in ``docs/adapters.md``): vLLM's punica kernels run every
adapter of a batch in one launch per layer and module, so a step with adapters pays a
fixed ``lora_step_overhead_s`` (the shrink and expand kernels) plus, for each distinct
adapter in it, reading that adapter's weights once::

    t += lora_step_overhead_s + adapters * lora_bytes_per_rank * max_lora_rank / mem_bw_bytes_s

For Llama-3.1-8B an adapter on all seven linear modules of 32 layers holds
``rank * 81,920 * 32`` parameters (q, o: 4096+4096; k, v: 4096+1024; gate, up, down:
4096+14336 per rank), 5.2 MB per rank in bf16: a rank-16 adapter is 84 MB, 25 µs at
3.35 TB/s. The fixed part (0.5 ms, about a tenth of a decode step) is in line with the
10-20 % slowdown reported for multi-LoRA decode.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PROFILE = "h100-llama3.1-8b"


@dataclass(frozen=True)
class Profile:
    """Cost numbers of one (accelerator, model) pair."""

    name: str
    weight_bytes: float
    mem_bw_bytes_s: float
    peak_flops: float
    flops_per_token: float
    kv_bytes_per_token: float
    step_overhead_s: float
    default_kv_blocks: int
    max_model_len: int
    lora_bytes_per_rank: float = 0.0
    lora_step_overhead_s: float = 0.0

    def lora_time_s(self, adapters: int, rank: int) -> float:
        """What ``adapters`` distinct LoRA adapters of ``rank`` add to a step."""
        if adapters <= 0:
            return 0.0
        weights_s = adapters * self.lora_bytes_per_rank * rank / self.mem_bw_bytes_s
        return self.lora_step_overhead_s + weights_s

    def step_time_s(self, batch_tokens: int, context_tokens: int) -> float:
        """Modelled duration of one step computing ``batch_tokens`` new tokens.

        A step with no tokens costs nothing (the engine is idle).
        """
        if batch_tokens <= 0:
            return 0.0
        read_bytes = self.weight_bytes + self.kv_bytes_per_token * context_tokens
        memory_s = read_bytes / self.mem_bw_bytes_s
        compute_s = self.flops_per_token * batch_tokens / self.peak_flops
        return max(memory_s, compute_s) + self.step_overhead_s

    @property
    def ridge_tokens(self) -> float:
        """Tokens per step where weight streaming and compute take equally long."""
        if self.flops_per_token == 0:
            return float("inf")
        return self.weight_bytes * self.peak_flops / (self.mem_bw_bytes_s * self.flops_per_token)


_LLAMA_8B_PARAMS = 8.03e9
# 32 layers x 8 KV heads x 128 head dim x (K and V) x 2 bytes (bf16).
_LLAMA_8B_KV_BYTES = 32 * 8 * 128 * 2 * 2

PROFILES: dict[str, Profile] = {
    DEFAULT_PROFILE: Profile(
        name=DEFAULT_PROFILE,
        weight_bytes=2 * _LLAMA_8B_PARAMS,
        mem_bw_bytes_s=3.35e12,
        peak_flops=989e12,
        flops_per_token=2 * _LLAMA_8B_PARAMS,
        kv_bytes_per_token=_LLAMA_8B_KV_BYTES,
        step_overhead_s=0.0002,
        # (80 GB x 0.92 - 16 GB weights - ~4 GB activations) / (16 tokens x 128 KiB).
        default_kv_blocks=25_000,
        max_model_len=131_072,
        lora_bytes_per_rank=2 * 81_920 * 32,
        lora_step_overhead_s=0.0005,
    ),
    # A tiny float32 Llama on two CPU cores, like the reference vLLM CPU run.
    "cpu-tiny": Profile(
        name="cpu-tiny",
        weight_bytes=4 * 2.0e6,
        mem_bw_bytes_s=10e9,
        peak_flops=50e9,
        flops_per_token=2 * 2.0e6,
        kv_bytes_per_token=2 * 2 * 128 * 4,
        step_overhead_s=0.002,
        default_kv_blocks=4_096,
        max_model_len=2_048,
        # hidden 128, 2 layers: q, k, v, o (128+128) and an MLP of 512 (128+512, x3), fp32
        lora_bytes_per_rank=4 * (4 * 256 + 3 * 640) * 2,
        lora_step_overhead_s=0.0005,
    ),
    # Zero step cost: measures the simulator's and the gateway's own overhead.
    "instant": Profile(
        name="instant",
        weight_bytes=0.0,
        mem_bw_bytes_s=1.0,
        peak_flops=1.0,
        flops_per_token=0.0,
        kv_bytes_per_token=0.0,
        step_overhead_s=0.0,
        default_kv_blocks=100_000,
        max_model_len=131_072,
    ),
}
