#!/usr/bin/env bash
# The README's test command on the one-GPU device host, in parts that each fit one device call (600 s at most): the two
# passes of tests/two_pass.py run by hand, pass 1 with CUDA hidden, pass 2 the GPU tests with CUDA visible.
# Run after FA4's staging (benchmarks/fa4_stage.sh unpack-a, unpack-b), with .te and .whl carried:
#   PART=1a   pass 1 on tests/mcore and tests/train          PART=1b   pass 1 on every other test
#   PART=2a   pass 2 on tests/attention                       PART=2b   pass 2 on every other test
# Logs under $OUT (default benchmarks/results/te): suite_pass<PART>_<gpu>.txt; prints pytest's summary lines.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${PART:-}" in 1a|1b|2a|2b) ;; *) echo "gpu_suite.sh: set PART to 1a, 1b, 2a or 2b (got '${PART:-}')" >&2; exit 2 ;; esac
. benchmarks/gpu_host_env.sh
heavy="tests/mcore tests/train"
rest=$(ls -d tests/*/ tests/test_*.py | grep -v -E "^tests/(mcore|train|cpu_pass|scripts)/?$")
case "$PART" in
1a) CUDA_VISIBLE_DEVICES="" timeout 570 python3 -m pytest -q -p no:cacheprovider $heavy ;;
1b) CUDA_VISIBLE_DEVICES="" timeout 570 python3 -m pytest -q -p no:cacheprovider $rest ;;
2a) MEGATRON_TREE_GPU_PASS=1 timeout 570 python3 -m pytest -q -p no:cacheprovider -m gpu tests/attention ;;
2b) MEGATRON_TREE_GPU_PASS=1 timeout 570 python3 -m pytest -q -p no:cacheprovider -m gpu \
      $(ls -d tests/*/ tests/test_*.py | grep -v -E "^tests/(attention|cpu_pass|scripts)/?$") ;;
esac > "$OUT/suite_pass${PART}_$tag.txt" 2>&1
echo "rc=$? (124: cut by the 570 s limit)"
grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/suite_pass${PART}_$tag.txt" | tail -25
