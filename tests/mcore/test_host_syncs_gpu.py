"""A tree step's own code never waits on the GPU: forward-only log-probs and a training step, on chunks of trees larger
than a micro-batch and on whole trees, under CUDA's sync debug mode (``tests/scripts/host_syncs.py``); every sync
left is megatron-core's or PyTorch's (printed), none is megatron_tree's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import gpu_env

pytestmark = pytest.mark.gpu

TESTS_DIR = Path(__file__).resolve().parents[1]


def test_no_host_sync_in_megatron_tree(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = gpu_env()
    proc = subprocess.run([sys.executable, str(TESTS_DIR / "scripts" / "host_syncs.py"), "--ckpt", str(tmp_path / "ck")],
                          capture_output=True, text=True, env=env, timeout=600, cwd=TESTS_DIR.parent)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "SYNCS_DONE" in out, out[-4000:]
    sites = [line.split()[1:] for line in out.splitlines() if line.startswith("SYNC ")]
    print("\n".join(f"{site}: {calls} calls" for site, calls in sites))
    assert not [site for site, _ in sites if site.startswith("megatron_tree/")], sites
