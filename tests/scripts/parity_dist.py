"""Multi-process tree parity: tree-packed log-probs and gradients under TP / EP (gloo, CPU, fp32).

Run: torchrun --standalone --nproc-per-node 2 tests/scripts/parity_dist.py WORK_DIR CASE...
with CASE = ``tp<N>:<arch>:<mode>`` or ``ep<N>:<arch>:<mode>``, mode ``full`` / ``selective``
(recompute granularity of the gradient check) or ``forward`` (log-probs only), e.g.
``tp2:qwen3:full ep2:qwen3_moe:forward`` (``<arch>``: a tiny arch or a sliding-window case of
``parity_common.SLIDING_WINDOW_CASES``, e.g. ``tp2:qwen2_swa:full``; ``qwen2_5_vl`` / ``glm4v`` / ``glm4v_moe``: image prompts,
gradients vs each sequence alone through the same tree model). For each case every rank builds the tree model (under
patch_bridge_for_tree_training) at that parallel size and checks, on a branching forest, tree
log-probs vs Hugging Face per sequence (< 1e-5); unless ``forward``, it also builds the upstream
model and checks this rank's parameter gradients of a weighted log-prob sum vs that model run
per sequence (relative < 1e-5). Rank 0 prints ``CASE logprob=... grad=...``; exit status 1 when
a check fails on any rank.

CPU limits (the CPU shim rewrites CUDA devices through a TorchFunctionMode, which autograd does
not carry into backward): MoE cannot run full recompute (its router moves weights to
``torch.cuda.current_device()`` when recomputed) and expert-parallel backward allocates
``device=torch.cuda.current_device()`` buffers; so EP cases run ``forward``.
"""

from __future__ import annotations

import os
import sys

import torch
from scripts.parity_common import (
    SLIDING_WINDOW_CASES,
    branching_forest,
    build_model,
    hf_logprobs,
    hf_vision_logprobs,
    max_diff,
    micro_batches,
    param_grads,
    relative_grad_error,
    run_dist_cases,
    tree_and_alone_backward,
    tree_and_flat_backward,
    tree_logprobs,
    vision_forest,
    vision_micro_batches,
)

from megatron_tree.runtime import init_cpu_distributed, save_tiny_hf_checkpoint

TOL = 1e-5


def run_case(case: str, work_dir: str) -> tuple[float, float]:
    kind, arch, recompute = case.split(":")
    size = int(kind[2:])
    init_cpu_distributed(**{kind[:2]: size})
    if arch in ("qwen2_5_vl", "glm4v", "glm4v_moe"):  # image prompts: gradients vs each sequence alone, same model
        path = save_tiny_hf_checkpoint(arch, os.path.join(work_dir, f"{kind}_{arch}"))
        seqs, images = vision_forest()
        mbs, want = vision_micro_batches(seqs, images), hf_vision_logprobs(path, seqs, images)
        if recompute == "forward":
            tree = build_model(path, tree=True)[0].eval()
            with torch.no_grad():
                return max_diff(tree_logprobs(tree, mbs), want), 0.0
        model = build_model(path, tree=True, recompute=recompute)[0].train()
        tree_grads, tree_lp, _ = tree_and_alone_backward(model, seqs, images, mbs)
        return max_diff(tree_lp, want), relative_grad_error(tree_grads, param_grads(model))
    base, overrides = SLIDING_WINDOW_CASES.get(arch, (arch, {}))  # e.g. qwen2_swa: Qwen2 with a sliding window
    path = save_tiny_hf_checkpoint(base, os.path.join(work_dir, f"{kind}_{arch}"), **overrides)
    seqs = branching_forest()
    mbs = micro_batches(seqs)
    if recompute == "forward":
        tree = build_model(path, tree=True)[0].eval()
        with torch.no_grad():
            return max_diff(tree_logprobs(tree, mbs), hf_logprobs(path, seqs)), 0.0
    tree = build_model(path, tree=True, recompute=recompute)[0].train()
    flat = build_model(path, tree=False)[0].train()
    tree_lp, flat_lp = tree_and_flat_backward(tree, flat, seqs, mbs)
    lp_err = max_diff(tree_lp, hf_logprobs(path, seqs))
    grad_err = relative_grad_error(param_grads(tree), param_grads(flat))
    return lp_err, grad_err


def main() -> int:
    return run_dist_cases(run_case, sys.argv[1], sys.argv[2:], TOL)


if __name__ == "__main__":
    sys.exit(main())
