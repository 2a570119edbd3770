#!/usr/bin/env bash
# Attention conformance on the GPU host (after benchmarks/fa4_stage.sh unpack-a / unpack-b; .te and .whl carried):
# every backend over the head-dim x GQA x dtype grid, forward + backward against the dense fp64 reference.
#
#   PART=grid bash benchmarks/gpu_conformance.sh    # routed grid (every backend as training calls it)
#                                                   #   -> $OUT/conformance_routed.{json,txt}
#                                                   # raw kernels (FA4, FlexAttention) on every exact shape, bf16,
#                                                   # GQA 1 / 2 / 4 / 8 -> $OUT/conformance_raw_{a,b}.{json,txt}
#   PART=check bash benchmarks/gpu_conformance.sh   # the README suite (-n 12) -> $OUT/suite.txt; raw GQA 5:1 / 7:1 -> raw_c, 96 -> raw_d
#   PART=raw32 bash benchmarks/gpu_conformance.sh   # FlexAttention raw in fp32 / fp16 -> $OUT/conformance_raw_e.*
#   PART=suite bash benchmarks/gpu_conformance.sh   # the README's test command (GPU tests included) -> $OUT/suite.txt
# Outputs under $OUT (default benchmarks/results/te). A raw row that passes is the evidence for adding
# its shape to the backend's PROVEN table. Each JSON file is rewritten after every row: a run cut short keeps its rows.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/te}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
python3 -c "import transformer_engine" 2>/dev/null || bash .te/te-setup.sh 2>&1 | tail -1
python3 -c "from megatron_tree.attention.fa4 import fa4_unavailable_reason as r; print('fa4 unavailable:', r())"
conf() {  # conf NAME SECONDS ARGS...: one conformance run -> $OUT/conformance_NAME.{json,txt}
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -W ignore -m megatron_tree.attention.conformance --out "$OUT/conformance_$name.json" "$@" \
    > "$OUT/conformance_$name.txt" 2>&1
  echo "$name: rc $? $(tail -n 1 "$OUT/conformance_$name.txt")"
}
case "${PART:-grid}" in
grid)
  conf routed "${ROUTED_S:-120}" --modes routed
  conf raw_a "${RAW_A_S:-200}" --modes raw --backends fa4 flex --dtypes bf16 --head-dims 128 64 96 \
    --gqa-ratios 4 8 1 2 --trees grpo grpo_query_slots
  conf raw_b "${RAW_B_S:-180}" --modes raw --backends flex fa4 --dtypes bf16 --head-dims 80 72 104 112 192/128 256 \
    --gqa-ratios 1 2 4 8 --trees grpo grpo_query_slots ;;
check)  # the README suite on this host, then the raw kernels at GQA 5:1 and 7:1 (35 heads) and 96 at 4:1 / 8:1 under query slots
  timeout "${SUITE_S:-330}" python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-12}" tests > "$OUT/suite.txt" 2>&1
  echo "suite: rc $? $(tail -n 1 "$OUT/suite.txt")"
  conf raw_c "${RAW_C_S:-150}" --modes raw --backends fa4 flex --dtypes bf16 --heads 35 --head-dims 128 64 \
    --gqa-ratios 7 5 --trees grpo grpo_query_slots
  conf raw_d "${RAW_D_S:-60}" --modes raw --backends fa4 flex --dtypes bf16 --head-dims 96 --gqa-ratios 4 8 \
    --trees grpo_query_slots ;;
raw32)
  conf raw_e "${RAW_E_S:-300}" --modes raw --backends flex --dtypes fp32 fp16 --gqa-ratios 1 2 4 8 \
    --trees grpo grpo_query_slots ;;
suite)
  timeout "${SUITE_S:-560}" python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-8}" tests 2>&1 | tee "$OUT/suite.txt" | tail -n 40 ;;
*) echo "usage: PART=grid|check|raw32|suite $0"; exit 2 ;;
esac
