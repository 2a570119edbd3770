"""Tree steps through megatron-core's schedules equal flat steps (torchrun, gloo, fp32), and
bad input to the schedule integration is refused clearly."""

import re

import pytest

from dist_utils import TorchrunCases

PARITY = re.compile(r"PARITY rank=(\d+) tree_mbs=(\d+) .*? loss_rel=(\S+) grad_rel=(\S+)")


PARITY_CASES = {
    "tp2": (2, ["--tp", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "pp2-vpp2": (2, ["--pp", "2", "--vpp", "2"]),
    "dp2": (2, []),  # DP = 2 with unequal numbers of trees per rank
    "ep2-moe": (2, ["--ep", "2", "--arch", "qwen3_moe"]),
    "recompute-full": (1, ["--recompute", "full"]),
    "tp2xpp2": (4, ["--tp", "2", "--pp", "2"]),
    "ep2xpp2-moe": (4, ["--ep", "2", "--pp", "2", "--arch", "qwen3_moe"]),
    "cp2-recompute-full": (2, ["--cp", "2", "--recompute", "full"]),
    "cp2-ep2-moe": (2, ["--cp", "2", "--ep", "2", "--arch", "qwen3_moe"]),
    "cp2xtp2": (4, ["--cp", "2", "--tp", "2"]),
    "cp2xpp2-vpp2": (4, ["--cp", "2", "--pp", "2", "--vpp", "2"]),
    "cp2xdp2": (4, ["--cp", "2"]),
    # trees in chunks of 8 slots, fewer than any sequence has (MicroBatchSpec(chunk_trees=True))
    "chunks-dp2": (2, ["--chunk", "8"]),
    "chunks-tp2": (2, ["--chunk", "8", "--tp", "2"]),
    "chunks-ep2-moe": (2, ["--chunk", "8", "--ep", "2", "--arch", "qwen3_moe"]),
}
ERROR_CASES = {
    "vpp": (2, ["--pp", "2", "--vpp", "2"], "OK all checks"),
    "dp2": (2, [], "OK all checks"),
    "ep2-moe": (2, ["--ep", "2"], "OK raised: ranks hold between 1 and 6"),
    "cp2": (2, ["--cp", "2"], "OK raised: the upstream model (tree=False) cannot run under context parallel"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's script runs, one torchrun job per process count (dist_utils.TorchrunCases)."""
    parity, errors = "scripts/schedule_parity.py", "scripts/schedule_errors.py"
    cases = {case: ("test_tree_step_equals_flat_step", n, parity, ["--ckpt", "{tmp}", *args])
             for case, (n, args) in PARITY_CASES.items()}
    dump = ["--ckpt", "{tmp}", "--dump", "{tmp}/grads.pt"]
    cases["cp-one-rank"] = ("test_context_parallel_step_equals_one_rank", 1, parity, dump)
    cases["cp-two-ranks"] = ("test_context_parallel_step_equals_one_rank", 2, parity, [*dump, "--cp", "2"])
    cases |= {f"errors-{case}": ("test_schedule_rejects_bad_input", n, errors, ["--ckpt", "{tmp}", *args])
              for case, (n, args, _) in ERROR_CASES.items()}
    return TorchrunCases(cases, tmp_path_factory.mktemp("schedule"))


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c.startswith("chunks") else c for c in PARITY_CASES]
)
@pytest.mark.multiprocess
def test_tree_step_equals_flat_step(runs, request, case):
    out = runs.output(request, case)
    rows = PARITY.findall(out)
    assert len(rows) == PARITY_CASES[case][0], out[-3000:]
    for _, _, loss_rel, grad_rel in rows:
        assert float(loss_rel) < 1e-5 and float(grad_rel) < 1e-5
    if case.startswith("chunks"):  # chunks beyond max_kept_tokens (8) run again; under EP where any rank plans it
        again = re.findall(r"run_again=(\[.*?\])", out)
        assert any(a != "[]" for a in again) and (case != "chunks-ep2-moe" or len(set(again)) > 1), again


@pytest.mark.parametrize("case", ERROR_CASES)
@pytest.mark.multiprocess
def test_schedule_rejects_bad_input(runs, request, case):
    out = runs.output(request, f"errors-{case}")
    assert ERROR_CASES[case][2] in out, out[-3000:]


@pytest.mark.multiprocess
def test_context_parallel_step_equals_one_rank(runs, request):
    """CP=2 (each micro-batch's slots split over two ranks) gives the CP=1 step's loss and gradients."""
    import torch

    outs = {n: runs.output(request, case) for n, case in ((1, "cp-one-rank"), (2, "cp-two-ranks"))}
    for n, out in outs.items():
        assert len(PARITY.findall(out)) == n, out[-3000:]
    assert "cp_ranks_equal_grads=True" in outs[2] and "cp_ranks_equal_grads=False" not in outs[2]
    one, two = (torch.load(runs.tmp / case / "grads.pt") for case in ("cp-one-rank", "cp-two-ranks"))
    assert abs(one["loss"] - two["loss"]) <= 1e-6 * abs(one["loss"])
    assert float((one["grads"] - two["grads"]).abs().max() / one["grads"].abs().max()) < 1e-5
