"""One bf16 training step on a GPU, tree vs flat, within the flat path's own bf16 error (FlashAttention's rule).

``tests/scripts/schedule_parity.py --bf16`` (one process): a tiny Qwen3 and a tiny Qwen3.5 (3 Gated DeltaNet layers, one
gated full-attention layer), each path's loss, gradients and log-probs against the fp32 flat step (TF32 off), the
tree's errors at most 2x the worst flat path's: flat chains, reordered, packed, and with Transformer Engine
Megatron's sequence packing (TE THD attention; the GDN layers on THD ``packed_seq_params``). And the same step in
fp32 (TF32 off): tree vs flat and, with TE, vs the THD flat path within 1e-5 (the GDN layers' THD path in a whole
model, which the CPU suite cannot run: the local spec's attention has no THD).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import gpu_env

pytestmark = pytest.mark.gpu

TESTS_DIR = Path(__file__).resolve().parents[1]
ROW = re.compile(r"BF16VSFP32 rank=0 (loss|grad|logprob) (.*?) tree/worst_flat=(\S+)")


def schedule_parity(arch: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``tests/scripts/schedule_parity.py --arch ARCH ARGS`` in one process on the GPU, TF32 off."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = gpu_env(NVIDIA_TF32_OVERRIDE="0")
    cmd = [sys.executable, str(TESTS_DIR / "scripts" / "schedule_parity.py"), "--arch", arch, "--ckpt",
           str(tmp_path / arch), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=TESTS_DIR.parent)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_fp32_step_tree_equals_flat_and_te_thd(arch, tmp_path):
    from megatron_tree.core.platform import have_transformer_engine

    proc = schedule_parity(arch, tmp_path)
    out = proc.stdout + proc.stderr
    print("\n".join(line for line in out.splitlines() if line.startswith(("PARITY", "THD"))))
    assert proc.returncode == 0 and "PARITY rank=0" in out, out[-4000:]  # the script checks 1e-5
    assert ("THD rank=0" in out) == have_transformer_engine(), out[-4000:]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_bf16_step_tree_within_flat_error(arch, tmp_path):
    from megatron_tree.core.platform import have_transformer_engine

    proc = schedule_parity(arch, tmp_path, "--bf16")
    out = proc.stdout + proc.stderr
    rows = ROW.findall(out)
    print("\n".join(f"{arch} {metric}: {paths} tree/worst_flat={ratio}" for metric, paths, ratio in rows))
    assert proc.returncode == 0 and len(rows) == 3, out[-4000:]
    for metric, paths, ratio in rows:
        assert float(ratio) <= 2.0, (metric, paths)
        assert ("te_thd_flat=" in paths) == have_transformer_engine(), paths
