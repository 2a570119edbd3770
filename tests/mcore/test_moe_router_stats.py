"""MoE router statistics on tree micro-batches (megatron_tree.mcore.router_stats), CPU, fp32.

A tree training step with Megatron's load-balancing losses, z-loss or expert bias on equals the
flat step with the same grouping (tests/scripts/router_stats_parity.py: loss, every gradient,
logged aux losses, per-expert token counts), in-process at EP=1 (also under full recompute),
over gloo at EP=2, PP=2 and CP=2 (against the one-rank step), at the router under sequence
parallel (tests/scripts/router_stats_sp.py), and on one GPU under Transformer Engine; routers that
count each slot once are far off. What a tree cannot reproduce is refused.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from dist_utils import REPO_ROOT, TESTS_DIR, TorchrunCases, cpu_env
from hypothesis import given, settings
from scripts.router_stats_parity import CASES, TOL, batch, build, compare, run_case, tree_step

from forests import any_batch
from megatron_tree import MicroBatchSpec, pack_trees
from megatron_tree.compat import apply_compat_patches
from megatron_tree.mcore.router_stats import weighted_router_statistics
from megatron_tree.core.context_parallel import padded_slots, shard_micro_batch, slot_multiple
from megatron_tree.mcore.router_stats import (
    SlotWeights,
    _slot_weights,
    rank_slot_weights,
    tree_padding_mask,
    weigh_router_statistics,
)
from megatron_tree.runtime import cpu_mode, destroy_distributed, init_cpu_distributed, save_tiny_hf_checkpoint

@settings(max_examples=60, deadline=None)
@given(any_batch)
def test_per_sequence_sums_match_the_incidence_matrix(seqs):
    mb = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=200), pad_to_multiple_of=8)[0]
    slot = torch.arange(mb.num_slots)
    incidence = ((slot <= mb.last_slots[:, None]) & (mb.last_slots[:, None] < mb.attention_mask)).double()  # [n, T]
    weights = SlotWeights(
        multiplicity=mb.multiplicity[0],
        subtree_end=mb.attention_mask[0],
        last_slots=mb.last_slots,
        num_tokens=mb.num_original_tokens,
        num_sequences=len(mb.sequence_ids),
    )
    x = torch.randn(mb.num_slots, 3, dtype=torch.float32, requires_grad=True)
    sums = weights.per_sequence(x)
    torch.testing.assert_close(sums.double(), incidence @ x.double(), rtol=1e-6, atol=1e-5)
    out_grad = torch.randn_like(sums)
    sums.backward(out_grad)
    torch.testing.assert_close(x.grad.double(), incidence.T @ out_grad.double(), rtol=1e-6, atol=1e-5)
    routed = torch.rand(mb.num_slots, 3) < 0.5
    counts = weights.per_sequence(routed)
    assert counts.dtype == torch.int64 and torch.equal(counts, (incidence @ routed.double()).long())


@settings(max_examples=30, deadline=None)
@given(any_batch)
def test_rank_slot_weights_split_the_micro_batch(seqs):
    """Each rank's slot weights (a CP shard's, each sequence-parallel half of that) are the micro-batch's
    multiplicities at its slots; summed over the ranks, per-sequence sums and token counts are the whole's."""
    mb = pack_trees(seqs, MicroBatchSpec(max_tokens_per_mb=200))[0]
    for cp in (1, 2):
        padded = mb.padded_to(padded_slots(mb.num_slots, slot_multiple(cp=cp, sequence_parallel=2)))
        whole_mask = tree_padding_mask(padded)
        whole = _slot_weights(whole_mask)
        x = torch.randn(padded.num_slots, 3, dtype=torch.float64)
        sums, tokens, held = torch.zeros(len(padded.sequence_ids), 3, dtype=torch.float64), 0, []
        for r in range(cp):
            mask = tree_padding_mask(padded, shard_micro_batch(padded, cp, r) if cp > 1 else None)
            rank = _slot_weights(mask)
            for q in range(2):  # sequence parallel over two ranks, as megatron-core splits the mask
                part = rank_slot_weights(rank, mask.shape[1] // 2, q, 2)
                assert torch.equal(part.multiplicity, padded.multiplicity[0, part.slots])
                sums += part.per_sequence(x[part.slots])
                tokens += int(part.multiplicity.sum())
                held.append(part.slots)
        assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(padded.num_slots))
        torch.testing.assert_close(sums, whole.per_sequence(x), rtol=1e-12, atol=1e-12)
        assert tokens == whole.num_tokens == padded.num_original_tokens
    assert rank_slot_weights(whole, padded.num_slots) is whole
    with pytest.raises(ValueError, match=f"the router got 3 tokens but its padding mask stands for {padded.num_slots}"):
        rank_slot_weights(whole, 3, 0, 2)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    # The compatibility patches stay active while MoE runs without Transformer Engine.
    with apply_compat_patches(), cpu_mode():
        init_cpu_distributed(seed=7)
        yield save_tiny_hf_checkpoint("qwen3_moe", tmp_path_factory.mktemp("tiny_moe"), num_hidden_layers=2)
        destroy_distributed()


@pytest.mark.parametrize("case", list(CASES))
def test_tree_step_equals_flat_step(moe_checkpoint, case):
    r = run_case(moe_checkpoint, case, batch(np.random.default_rng(0), 160), max_tokens=48)
    assert r["mbs"] > 1 and r["shared"] > 1.5
    for kind in ("tree", "chains"):
        assert max(r[kind].values()) < TOL, (kind, r)
    # Each slot counted once: the gradient (or, for expert bias, the token counts) is far off.
    assert max(r["unweighted"]["grad"], r["unweighted"]["counts"]) > 0.1, r


def test_micro_batches_without_sequences_add_nothing(moe_checkpoint):
    mbs = pack_trees(batch(np.random.default_rng(0), 160), MicroBatchSpec(max_tokens_per_mb=48, n_mbs=6))
    assert any(mb.num_tokens == 0 for mb in mbs)
    with_empty = tree_step(build(moe_checkpoint, "all"), mbs)
    without = tree_step(build(moe_checkpoint, "all"), [mb for mb in mbs if mb.num_tokens])
    assert max(compare(with_empty, without).values()) == 0.0


def test_tree_step_equals_flat_step_with_full_recompute(moe_checkpoint):
    r = run_case(moe_checkpoint, "all", batch(np.random.default_rng(1), 160), max_tokens=48, recompute="full")
    assert max(r["tree"].values()) < TOL and r["unweighted"]["grad"] > 0.1, r


DISTRIBUTED = {
    "ep2": (["--ep", "2"], list(CASES)),
    "pp2-recompute-full": (["--pp", "2", "--recompute", "full", "--cases", "all"], ["all"]),
    "cp2": (["--cp", "2", "--dump", "{tmp}/steps"], list(CASES)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The cases of scripts/router_stats_parity.py in one torchrun job per process count (dist_utils.TorchrunCases)."""
    script = "scripts/router_stats_parity.py"
    cases = {case: ("test_tree_step_equals_flat_step_distributed", 2, script, ["--ckpt", "{tmp}", *args])
             for case, (args, _) in DISTRIBUTED.items()}
    cases["cp2"] = ("test_context_parallel_step_equals_one_rank", *cases["cp2"][1:])
    one_rank = ["--ckpt", "{tmp}", "--dump", "{tmp}/steps"]
    cases["one-rank"] = ("test_context_parallel_step_equals_one_rank", 1, script, one_rank)
    cases["sp-routers"] = ("test_sequence_parallel_routers_equal_one_router", 2, "scripts/router_stats_sp.py", [])
    return TorchrunCases(cases, tmp_path_factory.mktemp("router_stats"))


@pytest.mark.parametrize("case", [c for c in DISTRIBUTED if c != "cp2"])
@pytest.mark.multiprocess
def test_tree_step_equals_flat_step_distributed(runs, request, case):
    out = runs.output(request, case)
    check_records(out, case)


def check_records(out: str, case: str, *, nproc: int = 2, cases: list[str] | None = None) -> None:
    cases = DISTRIBUTED[case][1] if cases is None else cases
    # One "ROUTERSTATS rank=R case=C key=value ..." record per rank and case (lines may be glued).
    rows = [dict(re.findall(r"(\w+)=([^\s;]+)", part)) for part in out.split("ROUTERSTATS")[1:]]
    rows = [r for r in rows if "rank" in r and "case" in r]
    want = sorted((r, c) for r in range(nproc) for c in cases)
    assert sorted((int(r["rank"]), r["case"]) for r in rows) == want, out[-3000:]
    for r in rows:
        assert max(float(v) for k, v in r.items() if k.startswith("tree_")) < TOL, r
        assert max(float(r["unweighted_grad"]), float(r["unweighted_counts"])) > 0.1, r


@pytest.mark.gpu  # Transformer Engine's spec (grouped-GEMM experts, all-to-all dispatcher) on one GPU
@pytest.mark.multiprocess
def test_tree_step_equals_flat_step_on_one_gpu(tmp_path):
    """scripts/router_stats_parity.py on one GPU under Transformer Engine, fp32 with TF32 off: every case
    of the tree step equals the rows, unweighted routers are far off."""
    from megatron_tree.core.platform import have_transformer_engine

    if not have_transformer_engine():
        pytest.skip("needs Transformer Engine (the TE spec)")
    env = cpu_env(NVIDIA_TF32_OVERRIDE="0")
    env.pop("CUDA_VISIBLE_DEVICES")
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    script = TESTS_DIR / "scripts" / "router_stats_parity.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(script),
           "--ckpt", str(tmp_path / "ckpt")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=REPO_ROOT)
    out = proc.stdout + proc.stderr
    print(out[-4000:])
    assert proc.returncode == 0, out[-6000:]
    check_records(out, "gpu", nproc=1, cases=list(CASES))


@pytest.mark.multiprocess
def test_context_parallel_step_equals_one_rank(runs, request):
    """CP = 2 (each micro-batch's slots over two ranks, each weighing its own): the one-rank tree step
    (which equals the rows, above) in loss, gradients, per-expert counts (expert-bias counts summed over
    the CP ranks) and logged values (shares summed); in-job, the CP chains too. Unweighted: far off."""
    check_records(runs.output(request, "cp2"), "cp2")
    runs.output(request, "one-rank")

    def load(job: str, case: str) -> dict:
        steps = torch.load(runs.tmp / job / "steps" / f"{case}.pt")
        return {kind: logged_nonzero(step) for kind, step in steps.items()}

    for case in CASES:
        # Megatron's tracker keeps the names an earlier case of the same job logged (zeros here).
        one, two = load("one-rank", case), load("cp2", case)
        errors = compare(two["tree"], one["tree"])
        print(case, errors)
        assert max(errors.values()) < TOL, (case, errors)
        unweighted = compare(two["unweighted"], one["tree"])
        assert max(unweighted["grad"], unweighted["counts"]) > 0.1, (case, unweighted)


def test_refused_configurations(moe_checkpoint):
    with pytest.raises(ValueError, match="moe_expert_capacity_factor=1.0"):
        build_with(moe_checkpoint, moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs")
    with pytest.raises(ValueError, match="sinkhorn"):
        build_with(moe_checkpoint, moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0)
    # A megatron-core whose router internals changed is refused by name.
    router = build(moe_checkpoint, "aux_loss", weighted=False)[0].module.decoder.layers[0].mlp.router
    router._apply_seq_aux_loss = lambda probs, scores, routing_map: probs
    with pytest.raises(RuntimeError, match=r"TopKRouter._apply_seq_aux_loss takes \('probs', 'scores', 'routing_map'\)"):
        weighted_router_statistics(router, lambda padding_mask: None)


def build_with(path, **overrides):
    from megatron_tree.mcore.bridge import build_tree_model

    return build_tree_model(path, extra_args=overrides, load_weights=False)


def test_training_forward_without_tree_padding_mask_is_refused(moe_checkpoint):
    gpt = build(moe_checkpoint, "z_loss")[0]
    mb = pack_trees(batch(np.random.default_rng(0), 160), MicroBatchSpec(max_tokens_per_mb=48))[0]
    with pytest.raises(ValueError, match="tree_padding_mask"):
        gpt(mb.input_ids, mb.position_ids, mb.attention_mask)
    gpt(mb.input_ids, mb.position_ids, mb.attention_mask, padding_mask=tree_padding_mask(mb))
    with torch.no_grad():  # statistics are computed only with gradients
        gpt(mb.input_ids, mb.position_ids, mb.attention_mask)


def logged_nonzero(step: dict) -> dict:
    """``step`` without the logged names that hold zeros."""
    return {**step, "logged": {k: v for k, v in step["logged"].items() if v.any()}}


@pytest.mark.multiprocess
def test_sequence_parallel_routers_equal_one_router(runs, request):
    """Sequence parallel at the router (scripts/router_stats_sp.py): two ranks, each routing half of a
    micro-batch's slots with its own multiplicities and megatron-core's reductions over their TP group,
    give one router's logits gradients, logged values (shares summed) and counts; upstream routers
    on the same split are far off."""
    out = runs.output(request, "sp-routers")
    rows = [dict(re.findall(r"(\w+)=([^\s;]+)", part)) for part in out.split("ROUTERSP")[1:]]
    rows = [r for r in rows if "rank" in r]
    assert sorted(int(r["rank"]) for r in rows) == [0, 1], out[-3000:]
    for r in rows:
        assert max(float(r[k]) for k in ("grad", "logged", "counts")) < TOL, r
        assert max(float(r["unweighted_grad"]), float(r["unweighted_counts"])) > 0.1, r
