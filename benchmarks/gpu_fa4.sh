#!/usr/bin/env bash
# The FA4 tree attention backend on the GPU host (after benchmarks/fa4_stage.sh unpack-a / unpack-b; .te and .whl carried).
#
#   PART=kernel bash benchmarks/gpu_fa4.sh   # GPU tests, attention_bench (4 workloads, TE THD and cuDNN refs),
#                                            # fa4_kernel_profile (the kernels of one tree call),
#                                            # fa4_host_probe (host vs kernel time of a tree call), fa4_mask_ab
#                                            # (patched vs FA4's own mask_mod path),
#                                            # the 1-GPU bf16 training step (auto = FA4) against fp32
#   PART=e2e bash benchmarks/gpu_fa4.sh      # long-context multi-turn (trajectories up to ~50k) end to end, 0.6B:
#                                            # TE THD flat vs tree with FA4, then tree with FlexAttention
#   PART=cudnn bash benchmarks/gpu_fa4.sh    # cuDNN frontend's flex kernels (the cudnn_flex backend, same CuTe DSL;
#                                            # nvidia-cudnn-frontend comes with TE's wheels in .te/): its GPU tests and
#                                            # the raw conformance grid of its proven dtype (bf16) on head dims 64 / 128,
#                                            # GQA 1-8:1 (evidence for cudnn_flex.PROVEN; each new shape compiles
#                                            # its varlen kernels: a few seconds per row on a fresh host)
#   PART=cudnn_speed bash benchmarks/gpu_fa4.sh  # attention_bench with FA4, cuDNN flex (on Megatron's token-major
#                                            # q / k / v) and causal cuDNN in one run (GRPO, multi-turn, 128k)
#   PART=cudnn_step bash benchmarks/gpu_fa4.sh   # cudnn_flex's GPU tests, then the 0.6B shape's tree step with
#                                            # cudnn_flex against FA4 (whether auto should pick it: docs/results.md),
#                                            # each with a profiled step (cudnn_flex also a cProfile'd one); files *_backend*
#   PART=cudnn_profile bash benchmarks/gpu_fa4.sh  # the kernels of one tree call and their times: cuDNN flex next to
#                                            # causal cuDNN (cudnn_flex_kernel_profile.py) and FA4's
#                                            # (fa4_kernel_profile.py), where the per-pair gap to causal cuDNN goes;
#                                            # then the host time of one cudnn_flex call (cudnn_flex_call_host.py)
#   PART=cudnn_item4 bash benchmarks/gpu_fa4.sh  # cudnn_speed's bench, then cudnn_flex_kernel_profile.py alone: the
#                                            # per-call ratios and where GRPO's call time goes, in one device call
#                                            # (without FA4 staged it runs too, its FA4 rows left out: one call
#                                            # carrying .te and .whl measures cudnn_flex against causal cuDNN)
# Outputs under $OUT (default benchmarks/results/te).
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_host_env.sh
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1   # compiled kernels reused across the processes below
cudnn_kernel_profile() {  # the kernels of one cudnn_flex call next to causal cuDNN's (PART=cudnn_profile, cudnn_item4)
  timeout 200 python3 benchmarks/cudnn_flex_kernel_profile.py --out "$OUT/cudnn_flex_profile_$tag.txt" 2>&1 \
    | grep -v -i warn | tail -8
}
python3 -c "from megatron_tree.attention.fa4 import fa4_unavailable_reason as r; print('fa4 unavailable:', r())"
if [ "${PART:-kernel}" = kernel ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -W ignore tests/attention/test_fa4_attention.py 2>&1 \
    | grep -E "passed|failed|FAILED|Error|assert" | tee "$OUT/fa4_tests.txt"
  timeout 400 python3 benchmarks/attention_bench.py --out "$OUT" --tag h200_fa4 --variants --skip-dense --iters 10 \
    --warmup 3 > "$OUT/attention_fa4.log" 2>&1
  grep -v -i warn "$OUT/attention_fa4.log" | tail -34 | tee "$OUT/attention_fa4.txt"
  timeout 100 python3 benchmarks/fa4_kernel_profile.py --out "$OUT/fa4_profile.txt" 2>&1 | grep -v -i warn | tail -3
  timeout 200 python3 benchmarks/fa4_host_probe.py --out "$OUT/fa4_host.json" 2>&1 | grep -v -i warn | tail -3
  timeout 200 python3 benchmarks/fa4_mask_ab.py --out "$OUT/fa4_mask_ab.json" 2>&1 | grep -v -i warn | tail -4
  echo "== 1 GPU bf16 step, auto backend (FA4), each against the fp32 flat step" | tee "$OUT/fa4_bf16_step.txt"
  timeout 200 torchrun --nproc-per-node 1 tests/scripts/schedule_parity.py --ckpt /tmp/ck_b1 --bf16 2>&1 \
    | grep -E "BF16|bf16:|Error|error:" | grep -v -i warn | tee -a "$OUT/fa4_bf16_step.txt"
elif [ "$PART" = cudnn ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/attention/test_cudnn_flex.py 2>&1 \
    | grep -E "passed|failed|FAILED|Error|assert" | tee "$OUT/cudnn_flex_tests_per_tree_$tag.txt"
  timeout 400 python3 -m megatron_tree.attention.conformance --backends cudnn_flex --modes raw --dtypes bf16 \
    --head-dims 64 128 --gqa-ratios 1 2 4 8 --out "$OUT/conformance_cudnn_flex_per_tree_$tag.json" 2>&1 \
    | grep -v -i warn | grep -v "^Compiled" | tee "$OUT/conformance_cudnn_flex_per_tree_$tag.txt" | tail -3
elif [ "$PART" = cudnn_speed ] || [ "$PART" = cudnn_item4 ]; then
  timeout 300 python3 benchmarks/attention_bench.py --out "$OUT" --tag "${tag}_cudnn_backend" --variants --skip-dense --iters 20 \
    --warmup 5 --workloads grpo multi_turn long_multi_turn > "$OUT/attention_${tag}_cudnn_backend.log" 2>&1
  grep -v -i warn "$OUT/attention_${tag}_cudnn_backend.log" | grep -E "^(grpo|multi|long)"
  if [ "$PART" = cudnn_item4 ]; then
    cudnn_kernel_profile
  fi
elif [ "$PART" = cudnn_step ]; then
  MEGATRON_TREE_GPU_PASS=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -W ignore -m gpu \
    tests/attention/test_cudnn_flex.py 2>&1 | grep -E "passed|failed|FAILED|Error|assert" | tee "$OUT/cudnn_flex_tests_$tag.txt"
  for b in cudnn_flex fa4; do  # cProfile'd step for cudnn_flex only (a device call returns at most 8 files)
    timeout 200 python3 benchmarks/e2e_bench.py --model qwen3-0.6b --workloads grpo,multi_turn --modes tree \
      --attention-backend $b --warmup 2 --steps 5 $([ $b = cudnn_flex ] && echo --host-profile) \
      --out "$OUT/e2e_tree_${b}_${tag}_backend.json" 2>&1 | grep -E "^qwen3|Error|error" \
      | tee -a "$OUT/e2e_tree_backends_${tag}_backend.txt"
  done
elif [ "$PART" = cudnn_profile ]; then
  cudnn_kernel_profile
  timeout 200 python3 benchmarks/fa4_kernel_profile.py --out "$OUT/fa4_profile_$tag.txt" 2>&1 | grep -v -i warn | tail -3
  timeout 100 python3 benchmarks/cudnn_flex_call_host.py --out "$OUT/cudnn_flex_call_host_$tag.json" 2>&1 \
    | grep -v -i warn | tail -8
else
  common="--model qwen3-0.6b --workloads long_multi_turn --max-tokens-per-mb 65536 --recompute full --warmup 1 --steps 2 --no-profile"
  timeout 420 python3 benchmarks/e2e_bench.py $common --attention-backend auto --out "$OUT/e2e_long_fa4.json" 2>&1 \
    | grep -E "^qwen3|Error|error" | tee "$OUT/e2e_long.txt"
  timeout 150 python3 benchmarks/e2e_bench.py $common --attention-backend flex --modes tree \
    --out "$OUT/e2e_long_flex.json" 2>&1 | grep -E "^qwen3|Error|error" | tee -a "$OUT/e2e_long.txt"
  python3 benchmarks/plot_e2e_long.py "$OUT" && echo "wrote $OUT/e2e_long.png"
fi
