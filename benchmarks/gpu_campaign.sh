#!/usr/bin/env bash
# The GPU benchmarks in one device call (results and logs under $OUT, default benchmarks/results).
#
#   ../shared/gpu/fetch-wheels.sh                 # here, once: megatron-core + mbridge wheels into .whl/
#   bash benchmarks/gpu_campaign.sh               # on the GPU host, with .whl/ carried
#
# MODELS (default "qwen3-0.6b qwen3-moe-2b") picks the e2e models, WORKLOADS (default all three,
# comma-separated) their workloads, E2E_ARGS more e2e_bench.py flags (e.g. "--recompute full" for
# qwen3-4b); ATTENTION=1 adds the attention microbenchmark. Each e2e run profiles one step per
# mode (step_profile.py).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if ! python3 -c "import megatron.core, mbridge" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for model in ${MODELS:-qwen3-0.6b qwen3-moe-2b}; do
  python3 benchmarks/e2e_bench.py --model "$model" --workloads "${WORKLOADS:-grpo,multi_turn,no_sharing}" ${E2E_ARGS:-} --out "$OUT/e2e_$model.json" 2>&1 \
    | grep -v -i "warn" | tee "$OUT/e2e_$model.log"
done
python3 benchmarks/plot_e2e.py "$OUT"/e2e_*.json --out "$OUT/e2e_h200.png"
if [ "${ATTENTION:-0}" = 1 ]; then
  python3 benchmarks/attention_bench.py --out "$OUT" 2>&1 | grep -v -i "warn" | tee "$OUT/attention.log"
fi
