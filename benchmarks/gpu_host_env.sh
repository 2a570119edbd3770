# Sourced by the GPU-host scripts (gpu_fa4.sh, gpu_moe_step.sh, gpu_suite.sh) from the checkout root, with .te and .whl
# carried and FA4 staged (benchmarks/fa4_stage.sh): OUT (default benchmarks/results/te) made; megatron-core, mbridge and
# Transformer Engine installed by .te/te-setup.sh unless they import already (its log in /tmp/te_setup.log, not $OUT:
# a device call returns at most 8 files; its tail printed if it fails); PYTHONPATH with the checkout and FA4's staged
# site; tag = the GPU's short name (h100, h200) for file names.
OUT=${OUT:-benchmarks/results/te}
mkdir -p "$OUT"
if ! python3 -c "import transformer_engine.pytorch, megatron.core" 2>/dev/null; then
  bash .te/te-setup.sh > /tmp/te_setup.log 2>&1 || { tail -20 /tmp/te_setup.log; exit 1; }
fi
export PYTHONPATH=$PWD:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
tag=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]00" | tr H h)
