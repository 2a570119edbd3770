"""Tree steps through megatron-core's schedules equal flat steps (torchrun, gloo, fp32), and
bad input to the schedule integration is refused clearly."""

import re

import pytest

from dist_utils import run_torchrun

PARITY = re.compile(r"PARITY rank=(\d+) tree_mbs=(\d+) .*? loss_rel=(\S+) grad_rel=(\S+)")


@pytest.mark.parametrize(
    "nproc, args",
    [
        (2, ["--tp", "2"]),
        (2, ["--pp", "2"]),
        (2, ["--pp", "2", "--vpp", "2"]),
        (2, []),  # DP = 2 with unequal numbers of trees per rank
        (2, ["--ep", "2", "--arch", "qwen3_moe"]),
        (1, ["--recompute", "full"]),
        (4, ["--tp", "2", "--pp", "2"]),
        (4, ["--ep", "2", "--pp", "2", "--arch", "qwen3_moe"]),
        (2, ["--cp", "2", "--recompute", "full"]),
        (2, ["--cp", "2", "--ep", "2", "--arch", "qwen3_moe"]),
        (4, ["--cp", "2", "--tp", "2"]),
        (4, ["--cp", "2", "--pp", "2", "--vpp", "2"]),
        (4, ["--cp", "2"]),
    ],
    ids=["tp2", "pp2", "pp2-vpp2", "dp2", "ep2-moe", "recompute-full", "tp2xpp2", "ep2xpp2-moe",
         "cp2-recompute-full", "cp2-ep2-moe", "cp2xtp2", "cp2xpp2-vpp2", "cp2xdp2"],
)
@pytest.mark.multiprocess
def test_tree_step_equals_flat_step(tmp_path, nproc, args):
    out = run_torchrun("scripts/schedule_parity.py", nproc, ["--ckpt", str(tmp_path), *args], timeout=600)
    rows = PARITY.findall(out)
    assert len(rows) == nproc, out[-3000:]
    for _, _, loss_rel, grad_rel in rows:
        assert float(loss_rel) < 1e-5 and float(grad_rel) < 1e-5


@pytest.mark.parametrize(
    "nproc, args, last",
    [
        (2, ["--pp", "2", "--vpp", "2"], "OK all checks"),
        (2, [], "OK all checks"),
        (2, ["--ep", "2"], "OK raised: ranks hold between 1 and 6"),
        (2, ["--cp", "2"], "OK raised: tree MoE router statistics"),
    ],
    ids=["vpp", "dp2", "ep2-moe", "cp2"],
)
@pytest.mark.multiprocess
def test_schedule_rejects_bad_input(tmp_path, nproc, args, last):
    out = run_torchrun("scripts/schedule_errors.py", nproc, ["--ckpt", str(tmp_path), *args], timeout=600)
    assert last in out, out[-3000:]


@pytest.mark.multiprocess
def test_context_parallel_step_equals_one_rank(tmp_path):
    """CP=2 (each micro-batch's slots split over two ranks) gives the CP=1 step's loss and gradients."""
    dumps = {}
    for nproc, args in ((1, []), (2, ["--cp", "2"])):
        dumps[nproc] = tmp_path / f"grads_{nproc}.pt"
        out = run_torchrun("scripts/schedule_parity.py", nproc,
                           ["--ckpt", str(tmp_path / "ckpt"), "--dump", str(dumps[nproc]), *args], timeout=600)
        assert len(PARITY.findall(out)) == nproc, out[-3000:]
    if nproc == 2:
        assert "cp_ranks_equal_grads=True" in out and "cp_ranks_equal_grads=False" not in out
    import torch

    one, two = (torch.load(dumps[n]) for n in (1, 2))
    assert abs(one["loss"] - two["loss"]) <= 1e-6 * abs(one["loss"])
    assert float((one["grads"] - two["grads"]).abs().max() / one["grads"].abs().max()) < 1e-5
