#!/usr/bin/env bash
# Context parallel on a 2-GPU host, in one device call each (logs and JSON under $OUT):
#   PART=checks  NCCL exactness at CP=2: a training step (fp32 without and with Transformer Engine, bf16
#                with TE) and the RL passes (fp32, TE), each against one sequence per micro-batch;
#   PART=bench   benchmarks/cp_bench.py: one long multi-turn tree per step at CP=1 (1 GPU) and CP=2
#                (2 GPUs), SLOTS (default 65536,131072) unique tokens, MODEL (default qwen3-0.6b), with TE;
#                CP=1 also with full recompute at the largest size.
#
#   ../shared/gpu/fetch-wheels.sh && ../shared/gpu/fetch-te.sh && cp ../shared/gpu/te-setup.sh .te/   # here, once
#   PART=checks bash benchmarks/gpu_cp.sh; PART=bench bash benchmarks/gpu_cp.sh    # there, .whl and .te carried
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
PART=${PART:-checks}
LOG="$OUT/cp_$PART.txt"
echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l), $(date -u +%F)" | tee "$LOG"
filter() { grep -E "PARITY|THD|BF16|CP rank|RLPASSES|PATH|CPBENCH|Error|error:|OutOfMemory" | grep -v -i warn; }
tr="torchrun --nproc-per-node"
if [ "$PART" = checks ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
  echo "== CP=2 step, fp32 (TF32 off), no TE (local spec, flex attention)" | tee -a "$LOG"
  NVIDIA_TF32_OVERRIDE=0 timeout 300 $tr 2 tests/scripts/schedule_parity.py --cp 2 --ckpt /tmp/cp_a 2>&1 | filter | tee -a "$LOG"
  bash .te/te-setup.sh 2>&1 | grep -v -i warn | tail -1 | tee -a "$LOG"
  echo "== CP=2 step, fp32 (TF32 off), TE spec" | tee -a "$LOG"
  NVIDIA_TF32_OVERRIDE=0 timeout 300 $tr 2 tests/scripts/schedule_parity.py --cp 2 --ckpt /tmp/cp_b 2>&1 | filter | tee -a "$LOG"
  echo "== CP=2 step, bf16, TE spec (each path against the fp32 flat step)" | tee -a "$LOG"
  timeout 300 $tr 2 tests/scripts/schedule_parity.py --cp 2 --bf16 --ckpt /tmp/cp_c 2>&1 | filter | tee -a "$LOG"
  echo "== CP=2 RL passes, fp32 (TF32 off), TE spec, selective recompute" | tee -a "$LOG"
  NVIDIA_TF32_OVERRIDE=0 timeout 300 $tr 2 tests/scripts/rl_passes_parity.py --cp 2 --recompute selective \
    --ckpt /tmp/cp_d 2>&1 | filter | tee -a "$LOG"
else
  bash .te/te-setup.sh 2>&1 | grep -v -i warn | tail -1 | tee -a "$LOG"
  SLOTS=${SLOTS:-65536,131072}
  MODEL=${MODEL:-qwen3-0.6b}
  J="$OUT/cp_bench.json"
  for n in 2 1; do
    echo "== CP=$n, $MODEL, slots $SLOTS" | tee -a "$LOG"
    timeout 400 $tr $n benchmarks/cp_bench.py --model "$MODEL" --slots "$SLOTS" --out "$J" 2>&1 | filter | tee -a "$LOG"
  done
  echo "== CP=1, full recompute, ${SLOTS##*,} slots" | tee -a "$LOG"
  timeout 400 $tr 1 benchmarks/cp_bench.py --model "$MODEL" --slots "${SLOTS##*,}" --recompute full --out "$J" \
    --plot "$OUT/cp_bench.png" 2>&1 | filter | tee -a "$LOG"
fi
