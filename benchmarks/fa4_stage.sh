#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4 + the CuTe DSL) for the GPU host, which has no internet: here, once,
#   bash benchmarks/fa4_stage.sh pack        # downloads the cp312 wheels, writes .fa4a/ (~64 MB) and .fa4b/ (~7 MB)
# The CuTe DSL's compiler library alone is 92 MB as a wheel, more than one device call carries (64 MiB with the
# working tree), so FA4 travels xz-compressed in two calls on one warm machine (each within 30 s of the last), and
# Transformer Engine in a third:
#   call 1, carry [".fa4a"]:        bash benchmarks/fa4_stage.sh unpack-a
#   call 2, carry [".fa4b"]:        bash benchmarks/fa4_stage.sh unpack-b
#   call 3, carry [".te", ".whl"]:  bash .te/te-setup.sh && <the GPU work>
# (.fa4a: the compiler library, ~50 MB; .fa4b: the runtime library and everything else, ~19 MB.)
# unpack-* install into /tmp/fa4site; use it with
#   export PYTHONPATH=$PWD:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/fa4site
IR=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
RT=nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so
case "${1:-}" in
pack)
  w=$(mktemp -d)
  for spec in flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
      nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
      apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$w" "$spec"
  done
  python3 -m pip install -q --no-deps --no-compile --target "$w/site" --python-version 3.12 --implementation cp \
    --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 "$w"/*.whl
  mkdir -p .fa4a .fa4b
  for d in /.fa4a/ /.fa4b/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
  xz -9e -T0 -c "$w/site/$IR" > .fa4a/ir.so.xz
  xz -9e -T0 -c "$w/site/$RT" > .fa4b/rt.so.xz
  tar -C "$w/site" -cf - --exclude="$(basename $IR)" --exclude="$(basename $RT)" . | xz -9 -T0 > .fa4b/site.tar.xz
  rm -rf "$w"; du -sh .fa4a .fa4b ;;
unpack-a)
  rm -rf $SITE && mkdir -p $SITE/$(dirname $IR) $SITE/$(dirname $RT)
  xz -dc .fa4a/ir.so.xz > $SITE/$IR && chmod +x $SITE/$IR
  echo "fa4 stage a: ok" ;;
unpack-b)
  test -f $SITE/$IR || { echo "fa4 stage b: run unpack-a first, on this machine"; exit 1; }
  xz -dc .fa4b/rt.so.xz > $SITE/$RT && chmod +x $SITE/$RT
  tar -C $SITE -xJf .fa4b/site.tar.xz && echo "fa4 stage b: ok" ;;
*) echo "usage: $0 pack|unpack-a|unpack-b"; exit 2 ;;
esac
