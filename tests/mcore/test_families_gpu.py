"""Every tiny model family on one GPU (fp32, TF32 off), on the Transformer Engine spec and on megatron-core's
local spec: tree log-probs vs Hugging Face per sequence and gradients vs the upstream model per sequence,
<= 1e-5 (``tests/scripts/families_gpu.py``, one process per spec: TF32 is set before CUDA starts); where fp32
rounds further (the Gated DeltaNet families), the tree's gradients as close to the fp64 truth as the per-sequence
runs' (``--truth``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import gpu_env

pytestmark = pytest.mark.gpu

TESTS_DIR = Path(__file__).resolve().parents[1]
GDN_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    """``tests/scripts/NAME args...`` with TF32 off and the repo and tests on the path (its output captured)."""
    env = gpu_env(NVIDIA_TF32_OVERRIDE="0")
    return subprocess.run([sys.executable, str(TESTS_DIR / "scripts" / name), *args], capture_output=True, text=True,
                          env=env, timeout=900, cwd=TESTS_DIR.parent)


@pytest.fixture(scope="module")
def gdn_truth(tmp_path_factory):
    """The fp64 truth of the Gated DeltaNet families (local spec, the same for both specs' runs), whose fp32
    gradients round past 1e-5 (layer 0's conv1d.weight, Qwen3-Next: 5e-5 in every implementation, HF's and
    upstream's included): the directory ``gdn_grad_gap.py --save`` wrote."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    tmp = tmp_path_factory.mktemp("gdn_truth")
    proc = _script("gdn_grad_gap.py", str(tmp / "gap"), "--no-te", "--fp64", "--save", str(tmp / "truth"), *GDN_ARCHS)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return tmp / "truth"


@pytest.mark.parametrize("spec", ["te", "local"])
def test_every_family_exact_on_gpu(spec, tmp_path, gdn_truth):
    if spec == "te":
        from megatron_tree.core.platform import have_transformer_engine

        if not have_transformer_engine():
            pytest.skip("needs Transformer Engine (the TE spec)")
    proc = _script("families_gpu.py", str(tmp_path), "--truth", str(gdn_truth), *(["--no-te"] if spec == "local" else []))
    lines = [line for line in proc.stdout.splitlines() if f" spec={spec} " in line]
    print("\n".join(lines))
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-4000:]
