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
    ],
    ids=["tp2", "pp2", "pp2-vpp2", "dp2", "ep2-moe", "recompute-full", "tp2xpp2", "ep2xpp2-moe"],
)
def test_tree_step_equals_flat_step(tmp_path, nproc, args):
    out = run_torchrun("scripts/schedule_parity.py", nproc, ["--ckpt", str(tmp_path), *args], timeout=600)
    rows = PARITY.findall(out)
    assert len(rows) == nproc, out[-3000:]
    for _, _, loss_rel, grad_rel in rows:
        assert float(loss_rel) < 1e-5 and float(grad_rel) < 1e-5


@pytest.mark.parametrize("nproc, args", [(2, ["--pp", "2", "--vpp", "2"]), (2, []), (2, ["--ep", "2"])],
                         ids=["vpp", "dp2", "ep2-moe"])
def test_schedule_rejects_bad_input(tmp_path, nproc, args):
    out = run_torchrun("scripts/schedule_errors.py", nproc, ["--ckpt", str(tmp_path), *args], timeout=600)
    assert ("OK raised: ranks hold between 1 and 6" if "--ep" in args else "OK raised: context parallel size 2") in out
