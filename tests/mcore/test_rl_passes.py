"""Every model pass of an RL step on trees equals each sequence alone (torchrun, gloo, fp32):
forward-only log-probs and entropies, critic values and reward scores (``tree_forward_only``),
and a critic's training step (``tree_forward_backward(head="values")``), with a value head
exported and loaded through mbridge; see ``scripts/rl_passes_parity.py``."""

import re

import pytest

from dist_utils import run_torchrun

ROW = re.compile(r"RLPASSES rank=(\d+) (.*?) tree_tokens=")


@pytest.mark.parametrize(
    "args",
    [["--tp", "2", "--recompute", "full"], ["--pp", "2", "--vpp", "2"], ["--ep", "2", "--arch", "qwen3_moe"],
     ["--cp", "2", "--recompute", "selective"]],
    ids=["tp2-recompute-full", "pp2-vpp2", "dp2-unequal-trees-ep2-moe", "cp2-recompute-selective"],
)
@pytest.mark.multiprocess
def test_rl_passes_equal_per_sequence(tmp_path, args):
    out = run_torchrun("scripts/rl_passes_parity.py", 2, ["--ckpt", str(tmp_path), *args], timeout=600)
    rows = ROW.findall(out)
    assert len(rows) == 2, out[-3000:]
    for _, fields in rows:
        errors = {k: float(v) for k, v in (f.split("=") for f in fields.split())}
        assert set(errors) == {"logprobs", "entropy", "values", "scores", "critic_loss_rel", "critic_grad_rel",
                               "actor_entropy_grad_rel"}
        assert max(errors.values()) < 1e-5, fields
