#!/usr/bin/env bash
# The README's test command on the one-GPU device host, in parts that each fit one device call (600 s at most): the two
# passes of tests/two_pass.py run by hand, pass 1 with CUDA hidden, pass 2 the GPU tests with CUDA visible (kernel
# compilation makes them slow: 27 of tests/attention's 54 took 570 s on an H100).
# Run after FA4's staging (benchmarks/fa4_stage.sh unpack-a, unpack-b), with .te and .whl carried:
#   PART=1a   pass 1 on tests/mcore     PART=1b   pass 1 on tests/train     PART=1c   pass 1 on every other test
#   PART=2a   pass 2: attention dispatch and conformance     PART=2b   pass 2: chunk context, cudnn_flex
#   PART=2c   pass 2: FA4                                    PART=2d   pass 2: FlexAttention, sliding windows
#   PART=2e   pass 2 outside tests/attention, up to tests/mcore/test_f*   PART=2f   pass 2 on the rest of tests/mcore
# Logs under $OUT (default benchmarks/results/te): suite_pass<PART>_<gpu>.txt, each test's name and result and the
# durations (pass 1: each line stamped with the seconds since the start; a part cut by its limit still says which
# tests ran and how long each took); prints pytest's summary lines.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${PART:-}" in 1a|1b|1c|2a|2b|2c|2d|2e|2f) ;; *) echo "gpu_suite.sh: set PART to 1a, 1b, 1c, 2a, 2b, 2c, 2d, 2e or 2f (got '${PART:-}')" >&2; exit 2 ;; esac
. benchmarks/gpu_host_env.sh
a=tests/attention
stamp() { python3 -c "import sys, time; t = time.time(); [print(f'{time.time() - t:6.1f}s {l}', end='') for l in sys.stdin]"; }
pass1() { CUDA_VISIBLE_DEVICES="" timeout 570 python3 -m pytest -v -p no:cacheprovider "$@" | stamp; }  # each line timed
pass2() { MEGATRON_TREE_GPU_PASS=1 timeout 570 python3 -m pytest -v --durations=0 -p no:cacheprovider -m gpu "$@"; }
case "$PART" in
1a) pass1 tests/mcore ;;  # split from tests/train: the two ran past 570 s on an H100 host (2026-12-07, 360 of 461 tests)
1b) pass1 tests/train ;;
1c) pass1 $(ls -d tests/*/ tests/test_*.py | grep -v -E "^tests/(mcore|train|cpu_pass|scripts)/?$") ;;
2a) pass2 $a/test_attention.py $a/test_attention_conformance.py ;;
2b) pass2 $a/test_chunk_context.py $a/test_cudnn_flex.py ;;
2c) pass2 $a/test_fa4_attention.py $a/test_fa4_warmup.py ;;
2d) pass2 $(ls $a/test_*.py | grep -v -E "test_(attention|attention_conformance|chunk_context|cudnn_flex|fa4_attention|fa4_warmup)\.py$") ;;
2e) pass2 $(ls -d tests/*/ tests/test_*.py | grep -v -E "^tests/(attention|mcore|cpu_pass|scripts)/?$") \
      $(ls tests/mcore/test_[a-f]*.py) ;;  # split at g: the whole ran past 570 s on an H100 (2026-12-06)
2f) pass2 $(ls tests/mcore/test_[g-z]*.py) ;;
esac > "$OUT/suite_pass${PART}_$tag.txt" 2>&1
echo "rc=$? (124: cut by the 570 s limit)"
grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/suite_pass${PART}_$tag.txt" | tail -25
