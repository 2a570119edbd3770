"""--use-distributed-optimizer, --overlap-grad-reduce, --overlap-param-gather: DP = 2 with megatron-core's
DistributedOptimizer (gradients reduce-scattered in several overlapped buckets, weights all-gathered during the
next forward) logs the one-process run's losses and gradient norms on trees, over several Adam steps; its
checkpoints resume exactly; the combinations Megatron-LM refuses are one line."""

import json
import re
import types

import pytest

from dist_utils import REPO_ROOT, TorchrunCases
from megatron_tree.mcore.data_parallel import check_optimizer_fits, ddp_config
from megatron_tree.train.__main__ import main

LAUNCHER = str(REPO_ROOT / "examples" / "train_tree.py")
CONFIG = str(REPO_ROOT / "configs" / "tiny_qwen3.yaml")
# 8 GRPO-shaped groups a step: 4 tree micro-batches, 2 per data-parallel rank (so DDP's no_sync matters)
COMMON = ["--config", CONFIG, "--batch-size", "8", "--no-progress"]
OVERLAP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
           "--ddp-bucket-size", "20000"]  # ~95k parameters: several buckets


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Over two processes: the distributed optimizer (3 steps), the same overlapped (4 steps, saved after 2 and 4),
    that run resumed from its step-2 checkpoint, and the overlapped run with trees in chunks of 16 slots."""
    tmp = tmp_path_factory.mktemp("dist_opt")
    test = "test_dp2_distributed_optimizer_equals_one_process"
    cases = {
        "dist": (test, 2, LAUNCHER, [*COMMON, "--steps", "3", "--use-distributed-optimizer",
                                     "--log-jsonl", f"{tmp}/dist.jsonl"]),
        "overlap": (test, 2, LAUNCHER, [*COMMON, *OVERLAP, "--steps", "4", "--save", f"{tmp}/overlap-ckpt",
                                        "--save-interval", "2", "--log-jsonl", f"{tmp}/overlap.jsonl"]),
        "chunks": ("test_dp2_overlapped_chunks_equal_one_process", 2, LAUNCHER,
                   [*COMMON, *OVERLAP, "--steps", "4", "--max-tokens-per-mb", "16",
                    "--log-jsonl", f"{tmp}/chunks.jsonl"]),
        "resumed": ("test_distributed_optimizer_checkpoint_resumes_exactly", 2, LAUNCHER,
                    [*COMMON, *OVERLAP, "--steps", "4", "--load", f"{tmp}/overlap-ckpt/iter_0000002",
                     "--log-jsonl", f"{tmp}/resumed.jsonl"]),
    }
    return TorchrunCases(cases, tmp)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, no distributed optimizer, 4 steps (in this process: no process start)."""
    path = tmp_path_factory.mktemp("one") / "one.jsonl"
    assert main([*COMMON, "--steps", "4", "--log-jsonl", str(path)]) == 0
    return records(path)


def _records_of(runs, request, case):
    out = runs.output(request, case)
    return out, records(runs.tmp / f"{case}.jsonl")


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["dist", "overlap"])
def test_dp2_distributed_optimizer_equals_one_process(runs, request, one_process, case):
    """The issue's acceptance: with trees, DP = 2 with the distributed optimizer (and with overlapped gradient
    reduction and weight all-gather) gives the one-process losses and gradient norms, step after step (Adam's
    state, sharded over the ranks, shapes every later step)."""
    one = one_process
    out, two = _records_of(runs, request, case)
    assert "data parallel: distributed optimizer (state sharded over 2 data-parallel rank(s))" in out
    if case == "overlap":
        buckets = re.search(r"gradient reduction overlapped with the backward in (\d+) bucket\(s\), weight all-gather "
                            r"overlapped with the next forward", out)
        assert buckets and int(buckets.group(1)) > 1, out[-3000:]
    assert len(one) == 4 and len({r["loss"] for r in one}) == 4 and len(two) == (3 if case == "dist" else 4)
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key, a[key], b[key])
        assert b["loss_tokens"] == a["loss_tokens"] and b["tree_tokens"] == a["tree_tokens"]
        assert b["dp_micro_batches"] == [2, 2] and a["micro_batches"] == 4


@pytest.mark.multiprocess
def test_dp2_overlapped_chunks_equal_one_process(runs, request, one_process):
    """The overlapped DP = 2 run with every tree in chunks of 16 slots (each sequence is longer), the chunks beyond
    ``max_kept_tokens`` (16) running their forward again under the weight all-gather's forward hooks and inside DDP's
    no_sync: the one-process losses and gradient norms of whole trees, step after step."""
    _, two = _records_of(runs, request, "chunks")
    assert len(two) == 4
    for a, b in zip(one_process, two):
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key, a[key], b[key])
        assert b["tree_tokens"] == a["tree_tokens"] and b["recomputed_tokens"] > 0 == a["recomputed_tokens"]
        assert sum(b["dp_micro_batches"]) > 4 * a["micro_batches"]


@pytest.mark.multiprocess
def test_distributed_optimizer_checkpoint_resumes_exactly(runs, request):
    """Resumed from its step-2 checkpoint (dp_reshardable optimizer shards, Adam's step), the overlapped DP = 2 run
    repeats the uninterrupted run's steps 3 and 4 bit for bit (step 4 depends on the restored Adam state)."""
    _, full = _records_of(runs, request, "overlap")
    _, resumed = _records_of(runs, request, "resumed")
    exact = [(r["step"], r["loss"], r["grad_norm"]) for r in resumed]
    assert exact == [(r["step"], r["loss"], r["grad_norm"]) for r in full[2:]]


@pytest.mark.parametrize("flags, message", [
    (["--overlap-param-gather"], "parallel.overlap_param_gather (--overlap-param-gather) all-gathers the weights the "
                                 "distributed optimizer updated in shards; it needs parallel.use_distributed_optimizer "
                                 "(add --use-distributed-optimizer or drop --overlap-param-gather)"),
    (["--use-distributed-optimizer", "--overlap-param-gather"],
     "parallel.overlap_param_gather (--overlap-param-gather) needs parallel.overlap_grad_reduce, as in Megatron-LM "
     "(add --overlap-grad-reduce"),
    (["--ddp-bucket-size", "1000"], "parallel.ddp_bucket_size=1000 sizes the buckets of an overlapped gradient "
                                    "reduction; without parallel.overlap_grad_reduce"),
    (["--ddp-bucket-size", "0", "--overlap-grad-reduce"], "parallel.ddp_bucket_size (--ddp-bucket-size) must be null "
                                                          "or an int >= 1, got 0"),
    (["--use-distributed-optimizer", "--optimizer", "sgd"], "parallel.use_distributed_optimizer "
                                                             "(--use-distributed-optimizer) shards Adam's state only"),
])
def test_bad_combinations_are_one_line(capsys, flags, message):
    assert main(["--config", CONFIG, *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("megatron-tree-train: error: ") and message in err[-1], err
    assert not any("Traceback" in line for line in err)


def _chunk(use_distributed_optimizer=None):
    """A stand-in model chunk: Megatron's DDP (its finish_grad_sync and ddp_config) or, with None, a plain module."""
    if use_distributed_optimizer is None:
        return types.SimpleNamespace()
    config = types.SimpleNamespace(use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=False)
    return types.SimpleNamespace(finish_grad_sync=lambda: None, ddp_config=config)


@pytest.mark.parametrize("wrapped, distributed, message", [
    (None, True, "the model is not wrapped in Megatron's DistributedDataParallel"),
    (False, True, "over a model whose DDP all-reduces whole gradients"),
    (True, False, "the model's DDP reduce-scatters its gradients for a distributed optimizer"),
])
def test_optimizer_and_ddp_wrap_must_agree(wrapped, distributed, message):
    """Through the API: megatron-core's get_megatron_optimizer checks neither (a whole-model optimizer over
    reduce-scattered gradients trains on wrong ones, silently; mbridge's DDP default is the distributed one)."""
    with pytest.raises(ValueError, match=message):
        check_optimizer_fits([_chunk(wrapped)], distributed)
    check_optimizer_fits([_chunk(distributed)], distributed)  # agreeing: no error


def test_ddp_config_refuses_what_megatron_lm_refuses():
    assert ddp_config(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
                      bucket_size=10) == dict(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                              overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=10)
    for kwargs in (dict(overlap_param_gather=True, overlap_grad_reduce=True), dict(overlap_param_gather=True,
                   use_distributed_optimizer=True), dict(bucket_size=10)):
        with pytest.raises(ValueError):
            ddp_config(**kwargs)


def test_a_checkpoint_of_the_other_optimizer_kind_is_refused_in_one_line(tmp_path, capsys):
    assert main(["--config", CONFIG, "--steps", "1", "--save", str(tmp_path)]) == 0
    assert main(["--config", CONFIG, "--steps", "2", "--load", str(tmp_path), "--use-distributed-optimizer"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert ("iter_0000001: the checkpoint holds a whole-model optimizer's state (saved without "
            "--use-distributed-optimizer), this run shards it; resume without --use-distributed-optimizer") in err, err
