"""Every model pass of an RL step on trees equals each sequence alone (torchrun, gloo, fp32):
forward-only log-probs and entropies, critic values and reward scores (``tree_forward_only``),
and a critic's training step (``tree_forward_backward(head="values")``), with a value head
exported and loaded through mbridge; see ``scripts/rl_passes_parity.py``."""

import re

import pytest

from dist_utils import TorchrunCases

ROW = re.compile(r"RLPASSES rank=(\d+) (.*?) tree_tokens=")


CASES = {
    "tp2-recompute-full": ["--tp", "2", "--recompute", "full"],
    "pp2-vpp2": ["--pp", "2", "--vpp", "2"],
    "dp2-unequal-trees-ep2-moe": ["--ep", "2", "--arch", "qwen3_moe"],
    "cp2-recompute-selective": ["--cp", "2", "--recompute", "selective"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The cases of scripts/rl_passes_parity.py in one torchrun job (dist_utils.TorchrunCases)."""
    cases = {case: ("test_rl_passes_equal_per_sequence", 2, "scripts/rl_passes_parity.py", ["--ckpt", "{tmp}", *args])
             for case, args in CASES.items()}
    return TorchrunCases(cases, tmp_path_factory.mktemp("rl_passes"))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.multiprocess
def test_rl_passes_equal_per_sequence(runs, request, case):
    out = runs.output(request, case)
    rows = ROW.findall(out)
    assert len(rows) == 2, out[-3000:]
    for _, fields in rows:
        errors = {k: float(v) for k, v in (f.split("=") for f in fields.split())}
        assert set(errors) == {"logprobs", "entropy", "values", "scores", "critic_loss_rel", "critic_grad_rel",
                               "actor_entropy_grad_rel"}
        assert max(errors.values()) < 1e-5, fields
