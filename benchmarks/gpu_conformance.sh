#!/usr/bin/env bash
# Attention conformance on the GPU host (after benchmarks/fa4_stage.sh unpack-a / unpack-b; .te and .whl carried):
# every backend over the head-dim x GQA x dtype grid, forward + backward against the dense fp64 reference.
#
#   PART=routed bash benchmarks/gpu_conformance.sh   # the GPU tests (tests/attention/test_attention_conformance.py,
#                                                    # tests/attention/test_fa4_attention.py) and the routed grid -> $OUT/conformance_routed.json
#   PART=raw DTYPES=bf16 bash benchmarks/gpu_conformance.sh   # the raw kernels (FA4, FlexAttention) on every exact shape
#                                                    # -> $OUT/conformance_raw_bf16.json (one dtype per call: FA4 compiles each variant)
# Outputs under $OUT (default benchmarks/results/te). A raw row that passes is the evidence for adding
# its shape to the backend's PROVEN table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/te}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
python3 -c "import transformer_engine" 2>/dev/null || bash .te/te-setup.sh 2>&1 | tail -1
python3 -c "from megatron_tree.attention.fa4 import fa4_unavailable_reason as r; print('fa4 unavailable:', r())"
if [ "${PART:-routed}" = routed ]; then
  timeout 400 python3 -m pytest -q -p no:cacheprovider -W ignore tests/attention/test_attention_conformance.py \
    tests/attention/test_fa4_attention.py 2>&1 | grep -E "passed|failed|FAILED|Error|assert" | tee "$OUT/conformance_tests.txt"
  timeout 150 python3 -W ignore -m megatron_tree.attention.conformance --modes routed --out "$OUT/conformance_routed.json" \
    > "$OUT/conformance_routed.txt" 2>&1; tail -1 "$OUT/conformance_routed.txt"
else
  timeout 560 python3 -W ignore -m megatron_tree.attention.conformance --modes raw --backends flex fa4 \
    --dtypes ${DTYPES:-bf16} --trees grpo grpo_query_slots --out "$OUT/conformance_raw_${DTYPES:-bf16}.json" \
    > "$OUT/conformance_raw_${DTYPES:-bf16}.txt" 2>&1; tail -1 "$OUT/conformance_raw_${DTYPES:-bf16}.txt"
fi
