#!/usr/bin/env bash
# Exactness checks with Transformer Engine on the GPU host, in one device call (logs under $OUT).
#
#   ../shared/gpu/fetch-wheels.sh && ../shared/gpu/fetch-te.sh && cp ../shared/gpu/te-setup.sh .te/   # here, once
#   bash benchmarks/gpu_te_checks.sh          # there, with .whl and .te carried (1 or 2 GPUs)
#
# fp32 checks run with TF32 off (NVIDIA_TF32_OVERRIDE=0): TE's fp32 GEMMs use TF32 by default,
# which moves fp32 log-probs by ~3e-3. CHECKS (default "parity step1 bf16 tp2 ep2 tp2ep2 pp2")
# picks what runs; the 2-GPU ones are skipped on one GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
LOG="$OUT/te_checks.log"
bash .te/te-setup.sh 2>&1 | grep -v -i warn | tail -2 | tee "$LOG"
ngpu=$(nvidia-smi -L | wc -l)
echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$ngpu" | tee -a "$LOG"
python3 -c "import transformer_engine, megatron.core as m; print('TE', transformer_engine.__version__, 'megatron-core', m.__version__)" 2>/dev/null | tee -a "$LOG"
run() {  # run NAME CMD...: one check, its output filtered into the log
  echo "== $1" | tee -a "$LOG"; shift
  timeout 400 "$@" 2>&1 | grep -E "PARITY|THD|BF16|passed|failed|FAILED|Error|error:|tree vs HF|logprob|RoPE|bf16:" | grep -v -i "warn" | tee -a "$LOG"
}
want() { [[ " ${CHECKS:-parity step1 bf16 tp2 ep2 tp2ep2 pp2} " == *" $1 "* ]]; }
tr="torchrun --nproc-per-node"
want parity && run "tree vs HF / per-sequence grads, TE checkpoints, verify, chain attention; fp32, TF32 off" \
  env NVIDIA_TF32_OVERRIDE=0 python3 -m pytest -q -s tests/mcore/test_tree_parity.py tests/mcore/test_verify.py tests/attention/test_attention.py -k "not tensor_and_expert and not patch_leaves and (parity or gpu or chain or te_checkpoints)"
want step1 && run "1 GPU step fp32: tree vs flat per-sequence vs TE THD flat" \
  env NVIDIA_TF32_OVERRIDE=0 $tr 1 tests/scripts/schedule_parity.py --ckpt /tmp/ck_s1
want bf16 && run "1 GPU step bf16 (each against the fp32 flat step)" $tr 1 tests/scripts/schedule_parity.py --ckpt /tmp/ck_b1 --bf16
if [ "$ngpu" -ge 2 ]; then
  want tp2 && run "TP=2 + sequence parallel, fp32" env NVIDIA_TF32_OVERRIDE=0 $tr 2 tests/scripts/schedule_parity.py --tp 2 --ckpt /tmp/ck_t2
  want tp2 && run "TP=2 + sequence parallel, bf16" $tr 2 tests/scripts/schedule_parity.py --tp 2 --ckpt /tmp/ck_t2b --bf16
  want ep2 && run "EP=2 MoE (grouped GEMM), fp32" env NVIDIA_TF32_OVERRIDE=0 $tr 2 tests/scripts/schedule_parity.py --ep 2 --arch qwen3_moe --ckpt /tmp/ck_e2
  want tp2ep2 && run "TP=2 x EP=2 MoE + sequence parallel, fp32" env NVIDIA_TF32_OVERRIDE=0 $tr 2 tests/scripts/schedule_parity.py --tp 2 --ep 2 --etp 1 --arch qwen3_moe --ckpt /tmp/ck_te2
  want pp2 && run "PP=2, fp32" env NVIDIA_TF32_OVERRIDE=0 $tr 2 tests/scripts/schedule_parity.py --pp 2 --ckpt /tmp/ck_p2
fi
if want e2e; then  # a short end-to-end run: tree vs the TE THD flat baseline on one workload
  echo "== e2e smoke" | tee -a "$LOG"
  timeout 500 python3 benchmarks/e2e_bench.py --model qwen3-0.6b --workloads grpo --warmup 1 --steps 2 --no-profile \
    --out "$OUT/e2e_te_smoke.json" 2>&1 | grep -v -i warn | tail -5 | tee -a "$LOG"
fi
