"""Every tiny model family on one GPU (fp32, TF32 off), on the Transformer Engine spec and on megatron-core's
local spec: tree log-probs vs Hugging Face per sequence and gradients vs the upstream model per sequence,
<= 1e-5 (``tests/scripts/families_gpu.py``, one process per spec: TF32 is set before CUDA starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

TESTS_DIR = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("spec", ["te", "local"])
def test_every_family_exact_on_gpu(spec, tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if spec == "te":
        from megatron_tree.core.platform import have_transformer_engine

        if not have_transformer_engine():
            pytest.skip("needs Transformer Engine (the TE spec)")
    env = {**os.environ, "NVIDIA_TF32_OVERRIDE": "0",
           "PYTHONPATH": os.pathsep.join([str(TESTS_DIR.parent), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, str(TESTS_DIR / "scripts" / "families_gpu.py"), str(tmp_path)]
    proc = subprocess.run(args + (["--no-te"] if spec == "local" else []), capture_output=True, text=True,
                          env=env, timeout=900, cwd=TESTS_DIR.parent)
    lines = [line for line in proc.stdout.splitlines() if f" spec={spec} " in line]
    print("\n".join(lines))
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-4000:]
