#!/usr/bin/env bash
# EXPERIMENTAL: Llama-3.1-8B with disaggregated prefill/decode on 2x H100 80GB.
# Run it twice on one host, once per role; both load the same weights and exchange
# KV cache over NIXL (UCX; NVLink within a host, RDMA across hosts):
#
#   ROLE=prefill ./llama-3.1-8b-pd-disagg.sh   # GPU 0, port 8100
#   ROLE=decode  ./llama-3.1-8b-pd-disagg.sh   # GPU 1, port 8200
#
# A request must go to the prefill server first (max_tokens=1, kv_transfer_params
# {"do_remote_decode": true}) and then to the decode server with the returned
# kv_transfer_params: vLLM ships a small proxy for that handshake
# (examples/online_serving/disaggregated_serving/ in the vLLM repo). Put fairgate in
# front of that proxy as one backend, and point its metrics scrape at the decode server,
# whose TPOT and waiting queue are what the gates protect.
#
# Token budget trade-off, per role (8B on H100 roofline: decode step ~4.8 ms, 2,000-token
# prefill ~32 ms, ridge ~295 tokens/step):
#   prefill: no decodes run here, so nothing to smooth; 8192 tokens/step (~130 ms/step)
#            prefills an 8k prompt in one step: shortest TTFT.
#   decode:  only one-token steps (KV arrives over NIXL, prompts are not recomputed), so
#            steps stay near the 4.8 ms weight-read floor (plus KV reads that grow with
#            the batch) whatever other users' prompt lengths; 2048 only caps the rare
#            local prefill (e.g. a failed transfer).
# This isolates TTFT from TPOT; it does not add throughput (two GPUs, one model copy each).
set -euo pipefail

ROLE="${ROLE:?set ROLE=prefill or ROLE=decode}"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
SERVED_MODEL_NAME="${SERVED_MODEL_NAME:-llama-3.1-8b}"

case "$ROLE" in
  prefill) gpu=0; port=8100; side_port=5600; budget=8192 ;;
  decode)  gpu=1; port=8200; side_port=5601; budget=2048 ;;
  *) echo "ROLE must be prefill or decode, got: $ROLE" >&2; exit 2 ;;
esac

export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-$gpu}"
# Each instance on a host needs its own NIXL handshake port.
export VLLM_NIXL_SIDE_CHANNEL_PORT="${VLLM_NIXL_SIDE_CHANNEL_PORT:-$side_port}"
PORT="${PORT:-$port}"

exec vllm serve "$MODEL" \
  --served-model-name "$SERVED_MODEL_NAME" \
  --host 0.0.0.0 --port "$PORT" \
  --enable-chunked-prefill \
  --enable-prompt-tokens-details \
  --max-num-batched-tokens "${MAX_NUM_BATCHED_TOKENS:-$budget}" \
  --scheduling-policy priority \
  --max-num-seqs 256 \
  --gpu-memory-utilization 0.92 \
  --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}' \
  "$@"
