"""On a GPU: a launcher run whose rollout batches change length every step compiles nothing after its second step.

torch.compile'd code on the step's path (the log-prob kernel, megatron-core's fused functions) may compile once
for the first shape and once more when a dimension turns out to vary (Dynamo then marks it dynamic); a function that
recompiles for every new length would cost seconds in every step of a real run (synthetic runs with
``same_batch_every_step`` never see it). Dynamo's recompile log (``TORCH_LOGS=recompiles``) must stay silent from
the third step on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megatron_tree.attention.fa4 import fa4_available

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not fa4_available(), reason="needs a Hopper GPU and flash-attn-4")
def test_batches_of_new_lengths_compile_nothing_after_the_second_step(tmp_path):
    config = yaml.safe_load((REPO / "configs" / "tiny_qwen3.yaml").read_text())
    config["model"]["hf_overrides"]["head_dim"] = 64  # FA4 is proven there (bf16, GQA 2:1)
    config["data"]["same_batch_every_step"] = False
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "TORCH_LOGS": "recompiles", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "megatron_tree.train", "--config", str(tmp_path / "run.yaml"), "--bf16",
                          "--steps", "6", "--loss", "ppo", "--no-progress"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env, timeout=900)
    out = run.stdout
    assert run.returncode == 0, out[-4000:]
    lines = out.splitlines()
    steps = [i for i, line in enumerate(lines) if line.lstrip().startswith("iteration ")]
    assert len(steps) == 6, out[-4000:]
    later = [line for line in lines[steps[1] + 1:] if "Recompiling function" in line]
    assert not later, "recompiled after the second step:\n" + "\n".join(later[:10])
