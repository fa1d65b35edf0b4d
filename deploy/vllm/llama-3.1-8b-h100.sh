#!/usr/bin/env bash
# Llama-3.1-8B-Instruct on 1x H100 80GB: the default fairgate backend.
#
# Token budget 2048 per step (trade-off, H100 SXM bf16 roofline lower bounds):
#   decode-only step ~4.8 ms (16 GB weights / 3.35 TB/s); ridge ~295 tokens/step;
#   a full 2048-token step ~33 ms (2*8e9*2048 FLOP / 989 TFLOP/s; a 2,000-token
#   prefill is ~32 ms). So a stream that shares a step with a prefill chunk sees at
#   most ~33 ms (+ overhead) for that token: TPOT stays far below the 150 ms gate.
#   The price: a prompt longer than ~2,000 tokens (minus the running decodes, which
#   take the budget first) is spread over several steps, e.g. 8k tokens -> >=4 steps,
#   so its TTFT grows. vLLM's H100 default (8192) halves the steps of long prompts but
#   lets one step last >=130 ms, i.e. TPOT spikes past 150 ms in practice.
# Usage: HF_TOKEN=... ./llama-3.1-8b-h100.sh [extra vllm flags]
set -euo pipefail

MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
SERVED_MODEL_NAME="${SERVED_MODEL_NAME:-llama-3.1-8b}"
PORT="${PORT:-8000}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"

exec vllm serve "$MODEL" \
  --served-model-name "$SERVED_MODEL_NAME" \
  --host 0.0.0.0 --port "$PORT" \
  --enable-chunked-prefill \
  --enable-prompt-tokens-details \
  --max-num-batched-tokens 2048 \
  --scheduling-policy priority \
  --max-num-seqs 256 \
  --gpu-memory-utilization 0.92 \
  "$@"
