#!/usr/bin/env bash
# Llama-3.3-70B-Instruct, LONG-context pool: 4x H100 80GB, tensor parallel 4, 128k context.
# Prompts that do not fit the short pool (> 8,192 tokens) go here, so they never block the
# short pool's prefill queue. It serves the same model name as the short pool
# (llama-3.3-70b): in fairgate's config this pool's backends declare
# `min_prompt_tokens: 8193` and the short pool's `max_prompt_tokens: 8192`, so fairgate
# sends each prompt to the pool its estimated length fits and the short pool never
# receives a prompt it would reject (a prompt neither takes is refused with a 400).
#
# Memory (bf16): 140 GB weights / 4 = 35 GB per GPU; at 0.92 utilisation ~35 GB per GPU
# remain for KV cache; Llama-70B KV is ~320 KiB/token (80 layers x 8 KV heads x 128 x 2 x 2 B),
# 80 KiB per GPU under TP4 -> ~400k cached tokens, i.e. about three full 131k contexts.
#
# Token budget 2048 per step (roofline lower bounds, ignoring all-reduce):
#   decode-only step ~10.5 ms (35 GB per GPU / 3.35 TB/s); ridge still ~295 tokens/step;
#   a full 2048-token step ~72 ms (2*70e9*2048 FLOP / (4 x 989 TFLOP/s)).
#   TPOT of the running streams stays under ~75 ms + overhead while a long prompt is
#   being prefilled. TTFT of a 131k prompt is >= 64 steps x 72 ms ~ 4.7 s plus the
#   attention over earlier chunks, which grows with every chunk: a bigger budget (8192)
#   saves some of that per-step overhead but lets one step last ~290 ms, so streams in
#   this pool would blow the 150 ms TPOT gate while any long prompt is prefilling.
# Fewer sequences (64) than the short pool: each may hold up to 131k tokens of KV.
set -euo pipefail

MODEL="${MODEL:-meta-llama/Llama-3.3-70B-Instruct}"
SERVED_MODEL_NAME="${SERVED_MODEL_NAME:-llama-3.3-70b}"
PORT="${PORT:-8000}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0,1,2,3}"

exec vllm serve "$MODEL" \
  --served-model-name "$SERVED_MODEL_NAME" \
  --host 0.0.0.0 --port "$PORT" \
  --tensor-parallel-size 4 \
  --max-model-len 131072 \
  --enable-chunked-prefill \
  --enable-prompt-tokens-details \
  --max-num-batched-tokens 2048 \
  --scheduling-policy priority \
  --max-num-seqs 64 \
  --gpu-memory-utilization 0.92 \
  "$@"
