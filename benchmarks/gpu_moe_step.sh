#!/usr/bin/env bash
# The 2B MoE shape's training step on the GPU host, after FA4's staging (benchmarks/fa4_stage.sh unpack-a, unpack-b)
# and with .te and .whl carried, each mode at 32k-token micro-batches (the tree's 32.6k unique multi-turn tokens in one
# micro-batch; 52-60 GiB per mode on an H100):
#   PART=check    TE setup; tests/mcore/test_grouped_gemm_gpu.py (TE's CUTLASS grouped GEMM against fp64 and cuBLAS,
#                 bf16); then the GRPO and multi-turn steps, CUTLASS grouped GEMM on (the model build's default)
#   PART=cublas   the multi-turn step with TE's cuBLAS grouped GEMM (NVTE_USE_CUTLASS_GROUPED_GEMM=0)
#   PART=warm2    both workloads, the default build (CUTLASS grouped GEMM), 4 profiled steps per mode, then
#                 benchmarks/step_spread.py over them
#   PART=spread   where the multi-turn steps' spread comes from: both modes with 4 profiled steps each (wall, device-busy
#                 and kernel time per step) and the caching allocator's cudaMalloc calls and retries per step; the tree
#                 alone at learning rate 0 (the router's choices fixed); both modes with PyTorch's expandable segments
#   PART=attention  benchmarks/attention_bench.py alone on the GRPO and multi-turn trees (FA4, cuDNN flex, causal cuDNN)
#   PART=rest     the no-sharing step (flat at 16k tokens: at 32k it ran out of memory after another workload in the
#                 same process; not tried alone), then
#                 benchmarks/attention_bench.py on the GRPO and multi-turn trees (FA4, cuDNN's flex, causal cuDNN)
# Logs and JSON under $OUT (default benchmarks/results/te); STEPS timed steps per mode (default 8) after WARMUP (default
# 2: the first step after one warm-up still grows the caching allocator, cudaMalloc calls in its time).
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_host_env.sh
step() {  # step NAME CUTLASS WORKLOADS FLAT_TOKENS_PER_MB [more e2e_bench.py arguments]
  local name=$1 cutlass=$2 workloads=$3 flat=$4
  shift 4
  NVTE_USE_CUTLASS_GROUPED_GEMM=$cutlass timeout 400 python3 benchmarks/e2e_bench.py --model qwen3-moe-2b \
    --workloads "$workloads" --warmup "${WARMUP:-2}" --steps "${STEPS:-8}" --max-tokens-per-mb 32768 --flat-max-tokens-per-mb "$flat" \
    "$@" --out "$OUT/${name}_$tag.json" > "$OUT/${name}_$tag.log" 2>&1
  grep -E "ratio=|Error|error|ms/" "$OUT/${name}_$tag.log" | grep -v -i warn | tail -5
}
case "${PART:-check}" in
check)
  timeout 240 python3 -m pytest -q -s -m gpu tests/mcore/test_grouped_gemm_gpu.py > "$OUT/grouped_gemm_gpu_test_$tag.txt" 2>&1
  grep -E "^\{|passed|failed|Error" "$OUT/grouped_gemm_gpu_test_$tag.txt" | tail -20
  # One workload per process: in one process the second workload's flat model ran out of memory (54 GiB of the
  # first's still allocated)
  step e2e_moe_grpo_mb32k_cutlass 1 grpo 32768
  step e2e_moe_multi_turn_mb32k_cutlass 1 multi_turn 32768 ;;
cublas) step e2e_moe_multi_turn_mb32k_cublas 0 multi_turn 32768 ;;
warm2)  # both workloads, the default build, two warm-up steps
  step e2e_moe_multi_turn_mb32k_warm2 1 multi_turn 32768 --profile-steps 4
  step e2e_moe_grpo_mb32k_warm2 1 grpo 32768 --profile-steps 4
  python3 benchmarks/step_spread.py "$OUT"/e2e_moe_*_mb32k_warm2_"$tag".json ;;
spread)
  step e2e_moe_multi_turn_mb32k_spread 1 multi_turn 32768 --profile-steps 4
  step e2e_moe_multi_turn_mb32k_spread_lr0 1 multi_turn 32768 --profile-steps 4 --lr 0 --modes tree
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step e2e_moe_multi_turn_mb32k_spread_expandable 1 multi_turn 32768 \
    --profile-steps 4
  python3 benchmarks/step_spread.py "$OUT"/e2e_moe_multi_turn_mb32k_spread*_"$tag".json ;;
attention)  # the attention bench alone
  timeout 300 python3 benchmarks/attention_bench.py --out "$OUT" --tag "${tag}_per_tree" --workloads grpo multi_turn --variants \
    --skip-dense > "$OUT/attention_${tag}_per_tree.log" 2>&1
  grep -E "cudnn_flex|fa4_tree|causal_cudnn|Error" "$OUT/attention_${tag}_per_tree.log" | tail -20 ;;
rest)
  step e2e_moe_no_sharing_mb32k_cutlass 1 no_sharing 16384
  timeout 300 python3 benchmarks/attention_bench.py --out "$OUT" --tag "${tag}_unpadded" --workloads grpo multi_turn \
    --variants --skip-dense > "$OUT/attention_${tag}_unpadded.log" 2>&1
  grep -E "ceiling|efficiency|Error" "$OUT/attention_${tag}_unpadded.log" | tail -20 ;;
esac
