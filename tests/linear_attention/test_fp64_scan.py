"""fp64 end to end: Gated DeltaNet's scan on a tree (causal conv, SiLU, l2 norm, decay g = -exp(A_log)
softplus(a + dt_bias), gated delta rule) equals every root path run alone to 1e-11 (measured <= 6.0e-13), values and
every input's gradient (conv weight, A_log, dt_bias included): exactness far below fp32's 1e-5, which a sibling
started from another segment's state, or a state off by 1e-8, fails. ``gpu``: the same at Qwen3-Next's sizes on CUDA, and fp32
(TF32 off) there against it: the tree's rounding error against the per-path layout's.
"""

from __future__ import annotations

import random

import pytest
import torch
from forests import dfs_layout
from gdn_trees import SCAN_GRADS, decays_in_input_dtype, path_layout, rel_err, scan_inputs, scan_results, tree_cases

import megatron_tree.linear_attention.tree_delta_rule as tree_module
from megatron_tree.linear_attention import tree_scan_layout

CASES = tree_cases()
HEADS, DK, DV, KERNEL = 2, 8, 6, 4
NAMES = ("o", *SCAN_GRADS)
EXACT = 1e-11
"""fp64 tree vs paths: measured <= 6.0e-13 (dA_log the largest: a sum over every slot, with cancellation)."""


def _tree_and_paths(end, dtype=torch.float64, heads=HEADS, dk=DK, dv=DV, device="cpu", seed=0):
    """(tree results, per-path results) of :func:`gdn_trees.scan_results` on the same inputs and loss weights (drawn
    in fp32: exact in both dtypes) in ``dtype``."""
    inputs = scan_inputs(end.shape[0], heads, dk, dv, KERNEL, seed=seed, dtype=dtype, device=device)
    weight = torch.randn(end.shape[0], heads, dv, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    index, owned, packed = path_layout(end, KERNEL)
    tree = scan_results(tree_scan_layout(end.to(device), conv_kernel=KERNEL), inputs, weight, heads, dk)
    paths = scan_results(packed.to(device), inputs, weight, heads, dk, paths=(index.to(device), owned.to(device)))
    return tree, paths


def _errors(a, b) -> dict[str, float]:
    return {n: rel_err(x, y) for n, x, y in zip(NAMES, a, b)}


@pytest.mark.parametrize("name", ["random-bushy", "random-long"])
def test_fp64_tree_equals_each_root_path_alone(name):
    tree, paths = _tree_and_paths(CASES[name])
    assert all(x.dtype == torch.float64 for x in tree)
    errors = _errors(tree, paths)
    print(f"{name}: fp64 tree vs paths {max(errors.values()):.2e}")
    assert max(errors.values()) < EXACT, errors
    if name == "random-bushy":  # fp64 inputs really compute in fp64: fp32 is 1e-7-ish off
        fp32_tree, _ = _tree_and_paths(CASES[name], dtype=torch.float32)
        assert rel_err(fp32_tree[0], tree[0]) > 1e-10


@pytest.mark.parametrize("fault", ["sibling-state", "state-1e-8"])
def test_fp64_check_sees_a_wrong_start_state(monkeypatch, fault):
    """Every non-root segment starting from the next segment's state (siblings from each other's parents), or from
    its own parent's state times 1 + 1e-8 (an error fp32 checks cannot see): far above :data:`EXACT`."""
    real = tree_module.unchecked_chunk_gated_delta_rule

    def wrong(*args, initial_state=None, **kwargs):
        if initial_state is not None:
            initial_state = initial_state.roll(1, 0) if fault == "sibling-state" else initial_state * (1 + 1e-8)
        return real(*args, initial_state=initial_state, **kwargs)

    monkeypatch.setattr(tree_module, "unchecked_chunk_gated_delta_rule", wrong)
    tree, paths = _tree_and_paths(CASES["random-long"])
    errors = _errors(tree, paths)
    assert max(errors.values()) > (1e-3 if fault == "sibling-state" else 1e-10), errors


def test_fp32_is_within_1e6_of_fp64_with_decays_in_fp64():
    """fp32 vs fp64 on random-bushy: with the chunk's cumulative log decay in fp64 (the library's rule) both layouts
    are within 1e-6 of fp64 (measured <= 3.6e-7); with it in fp32 (before) the decay gradients' cancellation shows
    (dA_log 1.1e-4 tree, 2.6e-4 per path)."""
    exact, _ = _tree_and_paths(CASES["random-bushy"])
    now = _tree_and_paths(CASES["random-bushy"], dtype=torch.float32)
    with decays_in_input_dtype():
        before = _tree_and_paths(CASES["random-bushy"], dtype=torch.float32)
    for layout, a, b in zip(("tree", "paths"), now, before):
        after, fault = _errors(a, exact), _errors(b, exact)
        print(f"{layout}: dA_log {fault['dA_log']:.1e} in fp32 -> {after['dA_log']:.1e}, all {max(after.values()):.1e}")
        assert fault["dA_log"] > 3e-5 and max(after.values()) < 1e-6, (layout, fault, after)


def gpu_trees(seed: int = 0) -> torch.Tensor:
    """subtree_end int32 [6512]: 4 prompts of 200-500 tokens, each with 4-6 responses of 30-400 tokens, some
    branching again 10-100 tokens in (group sampling and multi-turn), 5 padding slots."""
    rng = random.Random(seed)
    seqs, vocab = [], 100_000

    def rand(n):
        return [rng.randrange(10, vocab) for _ in range(n)]

    for _ in range(4):
        prompt = rand(rng.randint(200, 500))
        for _ in range(rng.randint(4, 6)):
            response = prompt + rand(rng.randint(30, 400))
            seqs.append(response)
            if rng.random() < 0.5:
                seqs.append(response[: len(prompt) + rng.randint(10, 100)] + rand(rng.randint(20, 150)))
    end, _ = dfs_layout(seqs, padding=5)
    return end


@pytest.mark.gpu
def test_fp64_and_fp32_tree_against_paths_on_gpu():
    """CUDA, Qwen3-Next's head sizes (Hv = 16, Kd = Vd = 128, conv K = 4), 6512 slots of branching trees (15342 on
    the root paths): fp64 tree == fp64 per path to 1e-10 (a GPU-only defect of the tree path fails here), and the
    fp32 (TF32 off) tree and per-path layout both within 2e-6 of fp64 (H200: <= 4.3e-7 each; with the decays in fp32,
    as before, dA_log 6.7e-5 tree / 5.6e-5 per path). Prints per quantity both fp32 errors, tree vs per path
    (what families_gpu.py's ``own`` measures) and the tree's error with the decays in fp32."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    end = gpu_trees()
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        tree, paths = _tree_and_paths(end, heads=16, dk=128, dv=128, device="cuda")
        tree32, paths32 = _tree_and_paths(end, dtype=torch.float32, heads=16, dk=128, dv=128, device="cuda")
        with decays_in_input_dtype():
            before, _ = _tree_and_paths(end, dtype=torch.float32, heads=16, dk=128, dv=128, device="cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    exact = _errors(tree, paths)
    print(f"\n{end.shape[0]} slots, {path_layout(end, KERNEL)[0].shape[0]} on the root paths; fp64 tree vs paths: "
          f"max {max(exact.values()):.2e} (worst {max(exact, key=exact.get)})")
    worst = 0.0
    for n, t32, p32, e, t_before in zip(NAMES, tree32, paths32, tree, before):
        t_err, p_err = rel_err(t32, e), rel_err(p32, e)
        worst = max(worst, t_err, p_err)
        print(f"{n:9s} fp32 vs fp64: tree {t_err:.2e}  per-path {p_err:.2e};  tree vs per-path ('own') "
              f"{rel_err(t32, p32):.2e};  decays in fp32: tree {rel_err(t_before, e):.2e}")
    assert max(exact.values()) < 1e-10, exact
    assert worst < 2e-6, worst
