#!/usr/bin/env bash
# Every model pass of an RL step on the GPU host, in one device call (logs under $OUT):
#   1. tests/scripts/rl_passes_parity.py without Transformer Engine (local spec), fp32 + bf16;
#   2. the same with TE (adds the TE THD flat path Megatron users run), fp32 + bf16;
#   3. the launcher's whole PPO step (PPO_CONFIG, default configs/ppo_qwen3_0.6b_shape.yaml; the 1.7B shape:
#      configs/ppo_qwen3_1.7b_shape.yaml), tree vs flat, with TE.
#
#   ../shared/gpu/fetch-wheels.sh && ../shared/gpu/fetch-te.sh && cp ../shared/gpu/te-setup.sh .te/   # here, once
#   bash benchmarks/gpu_rl_passes.sh          # there, with .whl and .te carried
#
# fp32 runs turn TF32 off (NVIDIA_TF32_OVERRIDE=0). PPO_STEPS (default 4) sets the PPO run length; PART=ppo runs
# step 3 alone; PPO_ARGS adds launcher flags to both modes' PPO runs (steps 3, profile, startup), PPO_TREE_ARGS /
# PPO_FLAT_ARGS to one mode's in step 3 (each mode at its best: the flat step's fp32 logits of a 64k-token forward
# micro-batch do not fit an 80 GB card), e.g. PPO_TREE_ARGS="--forward-max-tokens-per-mb 65536"
# PPO_FLAT_ARGS="--forward-max-tokens-per-mb 32768". The summary gives the whole step's and each model pass's median
# (records' pass_*_s).
# Two more parts, each alone, on PPO_CONFIG (FA4 staged first: benchmarks/fa4_stage.sh):
#   PART=profile  benchmarks/ppo_profile.py, 2 warm-up steps then one with every pass profiled, tree and flat
#                 (-> $OUT/ppo_profile.json: per pass wall / device busy / idle and the host ops the GPU waited on);
#   PART=startup  benchmarks/startup_bench.py, each mode's first step with its kernel caches cold, then warm
#                 (-> $OUT/startup.json; four launcher runs of 3 steps).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-benchmarks/results}
PPO_CONFIG=${PPO_CONFIG:-configs/ppo_qwen3_0.6b_shape.yaml}
mkdir -p "$OUT"
LOG="$OUT/rl_passes_gpu$([ "${PART:-all}" = all ] || echo "_$PART").txt"  # PART=ppo: rl_passes_gpu_ppo.txt
echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F)" | tee "$LOG"
filter() { grep -E "RLPASSES|PATH|passed|failed|FAILED|Error|error:|Traceback" | grep -v -i warn; }
parity() {  # parity LABEL: fp32 then bf16 (each path against the fp32 per-sequence results)
  echo "== $1, fp32 (TF32 off) + bf16" | tee -a "$LOG"
  NVIDIA_TF32_OVERRIDE=0 timeout 300 torchrun --nproc-per-node 1 tests/scripts/rl_passes_parity.py \
    --ckpt "/tmp/ck_rl_$2" --bf16 2>&1 | filter | tee -a "$LOG"
}
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
python3 -c "import megatron.core as m; print('megatron-core', m.__version__, '(no Transformer Engine)')" 2>/dev/null | tee -a "$LOG"
if [ "${PART:-all}" = all ]; then
  parity "no TE (local spec, flex attention)" local
fi
bash .te/te-setup.sh 2>&1 | grep -v -i warn | tail -1 | tee -a "$LOG"
if [ "${PART:-all}" = all ]; then
  parity "TE (TE spec, cuDNN THD flat path)" te
fi
case "${PART:-all}" in
  profile) python3 benchmarks/ppo_profile.py --config "$PPO_CONFIG" --warmup 2 \
             --out "$OUT/ppo_profile.json" -- ${PPO_ARGS:-} 2>&1 | grep -v -i warn | tee -a "$LOG"; exit ;;
  startup) python3 benchmarks/startup_bench.py --config "$PPO_CONFIG" --steps 3 \
             --out "$OUT/startup.json" -- ${PPO_ARGS:-} 2>&1 | grep -v -i warn | tee -a "$LOG"; exit ;;
esac
for mode in tree-training no-tree-training; do
  [ "$mode" = tree-training ] && extra=${PPO_TREE_ARGS:-} || extra=${PPO_FLAT_ARGS:-}
  echo "== PPO whole step, $PPO_CONFIG, bf16, TE: --$mode ${PPO_ARGS:-} $extra" | tee -a "$LOG"
  timeout 420 python3 -m megatron_tree.train --config "$PPO_CONFIG" --steps "${PPO_STEPS:-4}" \
    --"$mode" ${PPO_ARGS:-} $extra --no-progress --log-jsonl "$OUT/ppo_${mode%%-*}.jsonl" 2>&1 | grep -v -i warn | tail -4 | tee -a "$LOG"
done
python3 benchmarks/ppo_records.py "$OUT/ppo_tree.jsonl" "$OUT/ppo_no.jsonl" | tee -a "$LOG"
