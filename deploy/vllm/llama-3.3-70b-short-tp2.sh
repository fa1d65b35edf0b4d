#!/usr/bin/env bash
# Llama-3.3-70B-Instruct, SHORT-context pool: 2x H100 80GB, tensor parallel 2, 10k context.
# Half the GPUs of the long pool per replica; fairgate sends it every prompt that fits.
#
# Memory: bf16 weights (140 GB, 70 GB per GPU) leave only ~3.6 GB per GPU at 0.92
# utilisation, less after activations and CUDA graphs: KV for roughly one 10k-token
# sequence (160 KiB/token per GPU under TP2), useless for batching. So this profile quantises the weights to FP8 on load (--quantization fp8,
# H100 FP8 tensor cores): 70 GB weights / 2 = 35 GB per GPU, ~33 GB per GPU of KV cache
# (160 KiB/token per GPU under TP2) -> ~200k cached tokens = ~20 full 10k contexts,
# hundreds of typical chats. Set QUANTIZATION= (empty) to run bf16 anyway.
#
# Token budget 2048 per step (roofline lower bounds, FP8 on H100: 1,979 TFLOP/s, 1 B/param):
#   decode-only step ~10.5 ms (35 GB per GPU / 3.35 TB/s); ridge ~295 tokens/step;
#   a full 2048-token step ~72 ms (2*70e9*2048 FLOP / (2 x 1,979 TFLOP/s)).
#   TPOT stays under ~75 ms + overhead even while prompts are being prefilled; a
#   10k-token prompt (the longest allowed) needs >= 5 steps, TTFT >= ~0.36 s. A larger
#   budget would cut that TTFT but push a mixed step past the 150 ms TPOT gate.
set -euo pipefail

MODEL="${MODEL:-meta-llama/Llama-3.3-70B-Instruct}"
SERVED_MODEL_NAME="${SERVED_MODEL_NAME:-llama-3.3-70b}"
PORT="${PORT:-8000}"
QUANTIZATION="${QUANTIZATION-fp8}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0,1}"

quant_args=()
if [[ -n "$QUANTIZATION" ]]; then
  quant_args=(--quantization "$QUANTIZATION")
fi

exec vllm serve "$MODEL" \
  --served-model-name "$SERVED_MODEL_NAME" \
  --host 0.0.0.0 --port "$PORT" \
  --tensor-parallel-size 2 \
  --max-model-len 10240 \
  "${quant_args[@]}" \
  --enable-chunked-prefill \
  --enable-prompt-tokens-details \
  --max-num-batched-tokens 2048 \
  --scheduling-policy priority \
  --max-num-seqs 256 \
  --gpu-memory-utilization 0.92 \
  "$@"
