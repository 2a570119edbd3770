#!/usr/bin/env bash
# The GPU benchmarks in one device call, spread over the host's GPUs (results under $OUT,
# default benchmarks/results): one queue of e2e_bench.py runs per GPU, in parallel.
#
#   ../shared/gpu/fetch-wheels.sh                 # here, once: megatron-core + mbridge wheels into .whl/
#   ../shared/gpu/fetch-te.sh && cp ../shared/gpu/te-setup.sh .te/   # optional: Transformer Engine
#   bash benchmarks/gpu_campaign.sh               # on the GPU host, with .whl/ (and .te/) carried
#
# With .te/ present TE is installed first and the flat baseline is Megatron's THD sequence packing
# through cuDNN attention. QUEUE0, QUEUE1, ... (one per GPU) list "model[:extra e2e flags]" runs
# separated by ";" (default: QUEUE0="qwen3-0.6b", QUEUE1="qwen3-moe-2b:--no-profile");
# WORKLOADS (default all three) and E2E_ARGS apply to every run; ATTENTION=1 adds the attention
# microbenchmark on GPU 0 at the end. Every run stops at DEADLINE (epoch seconds; default 540 s
# from the start); e2e_bench writes its JSON after every run, so a cut-short run keeps what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-benchmarks/results}
DEADLINE=${DEADLINE:-$(($(date +%s) + 540))}
mkdir -p "$OUT"
if [ -f .te/te-setup.sh ]; then
  python3 -c "import transformer_engine.pytorch" 2>/dev/null || bash .te/te-setup.sh 2>&1 | grep -v -i warn | tail -1
elif ! python3 -c "import megatron.core, mbridge" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
queue() {  # queue GPU "model[:flags];model[:flags]..."
  local gpu=$1 item model flags
  IFS=';' read -ra items <<< "$2"
  for item in "${items[@]}"; do
    model=${item%%:*}; flags=""; [[ $item == *:* ]] && flags=${item#*:}
    left=$((DEADLINE - $(date +%s)))
    echo "== GPU $gpu: $model $flags ${E2E_ARGS:-} (${left}s left)"
    [ "$left" -gt 30 ] || continue
    CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$((29511 + gpu)) timeout "$left" \
      python3 benchmarks/e2e_bench.py --model "$model" --workloads "${WORKLOADS:-grpo,multi_turn,no_sharing}" \
      $flags ${E2E_ARGS:-} --out "$OUT/e2e_$model.json" 2>&1 | grep -v -i -E "warn|deprecat|number of parameters"
  done
}
ngpu=$(nvidia-smi -L | wc -l)
for ((g = 0; g < ngpu; g++)); do
  var=QUEUE$g; default=""
  [ $g = 0 ] && default="qwen3-0.6b"
  [ $g = 1 ] && default="qwen3-moe-2b:--no-profile"
  q=${!var:-$default}
  [ -n "$q" ] && queue "$g" "$q" > "$OUT/e2e_gpu$g.log" 2>&1 &
done
wait
cat "$OUT"/e2e_gpu*.log
python3 benchmarks/plot_e2e.py "$OUT"/e2e_*.json --out "$OUT/e2e_h200.png"
if [ "${ATTENTION:-0}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/attention_bench.py --out "$OUT" 2>&1 | grep -v -i "warn" | tee "$OUT/attention.log"
fi
